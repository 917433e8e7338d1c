//! Offload policies: which blocks are worth moving down a tier.
//!
//! # Zero-allocation synchronous results
//!
//! Most policies answer from memory (the registry's presence bits and frequency sketch), a few
//! must ask a remote service (object presence, object locks). The trait returns
//! [`Either`]: `Left(Ready)` for an answer known now — no box, no allocation for a single block,
//! built with [`sync_result`] / [`sync_batch_result`] — and `Right(BoxFuture)` only when the
//! policy really has to wait ([`async_result`] / [`async_batch_result`]). The evaluator handles a
//! ready answer inline; only boxed futures are scheduled concurrently, bounded by
//! `max_concurrent_evaluations`, each under `policy_timeout`.
//!
//! # Composition
//!
//! [`AllOfPolicy`] evaluates its children in order and asks each later child only about the
//! blocks every earlier child passed, so a side-effecting policy (a lock) placed last is only
//! consulted for blocks that would otherwise be offloaded. [`AnyOfPolicy`] asks later children
//! only about blocks no earlier child passed.
//!
//! # Release
//!
//! [`OffloadPolicy::release`] is called once for every block that passed the policy, when the
//! block leaves the pipeline (completed, failed or cancelled), so a policy holding a resource per
//! block (a lock) can let it go.

use std::future::{Future, Ready, ready};
use std::pin::Pin;
use std::sync::Arc;

use either::Either;
use kvbm_logical::{BlockRegistry, SequenceHash, TierId};

use crate::config::PolicyConfig;
use crate::error::PolicyError;

/// Boxed future type for async policy evaluation.
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// Future type for single-block policy evaluation.
pub type PolicyFuture =
    Either<Ready<Result<bool, PolicyError>>, BoxFuture<Result<bool, PolicyError>>>;

/// Future type for batch policy evaluation (one verdict per context, in order).
pub type PolicyBatchFuture =
    Either<Ready<Result<Vec<bool>, PolicyError>>, BoxFuture<Result<Vec<bool>, PolicyError>>>;

/// Create a synchronous policy result (zero allocation).
#[inline]
pub fn sync_result(pass: bool) -> PolicyFuture {
    Either::Left(ready(Ok(pass)))
}

/// Create an async policy result (boxes the future).
pub fn async_result(
    fut: impl Future<Output = Result<bool, PolicyError>> + Send + 'static,
) -> PolicyFuture {
    Either::Right(Box::pin(fut))
}

/// Create a synchronous batch policy result (no future is boxed).
#[inline]
pub fn sync_batch_result(verdicts: Vec<bool>) -> PolicyBatchFuture {
    Either::Left(ready(Ok(verdicts)))
}

/// Create an async batch policy result (boxes the future).
pub fn async_batch_result(
    fut: impl Future<Output = Result<Vec<bool>, PolicyError>> + Send + 'static,
) -> PolicyBatchFuture {
    Either::Right(Box::pin(fut))
}

/// Context provided to policies for block evaluation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvalContext {
    /// The block's sequence hash.
    pub sequence_hash: SequenceHash,
    /// The block's 256-bit digest, for BLAKE3 sequences (the identity its copy in a tier that
    /// leaves the process must carry; see [`identity_of`](crate::identity_of)).
    pub digest: Option<kvbm_logical::BlockDigest>,
    /// The source block's id when known before upgrade (external and strong blocks).
    pub block_id: Option<usize>,
    /// Tier the block is in.
    pub source: TierId,
    /// Tier it would move to.
    pub destination: TierId,
}

/// Trait for offload policies that filter blocks.
///
/// Implementations must be cheap for synchronous answers: the evaluator calls them inline on the
/// hot path.
pub trait OffloadPolicy: Send + Sync + 'static {
    /// A short name for logs.
    fn name(&self) -> &'static str;

    /// Whether the block should be offloaded.
    fn evaluate(&self, ctx: &EvalContext) -> PolicyFuture;

    /// Verdicts for many blocks, one per context in order. The default calls
    /// [`evaluate`](Self::evaluate) per block and stays synchronous while every answer is;
    /// override it for batched lookups.
    fn evaluate_batch(&self, ctxs: &[EvalContext]) -> PolicyBatchFuture {
        let mut verdicts = Vec::with_capacity(ctxs.len());
        let mut pending: Vec<(usize, BoxFuture<Result<bool, PolicyError>>)> = Vec::new();
        for (i, ctx) in ctxs.iter().enumerate() {
            match self.evaluate(ctx) {
                Either::Left(r) => match r.into_inner() {
                    Ok(v) => verdicts.push(v),
                    Err(e) => return Either::Left(ready(Err(e))),
                },
                Either::Right(f) => {
                    verdicts.push(false);
                    pending.push((i, f));
                }
            }
        }
        if pending.is_empty() {
            return sync_batch_result(verdicts);
        }
        async_batch_result(async move {
            let (idx, futs): (Vec<_>, Vec<_>) = pending.into_iter().unzip();
            let results = futures::future::join_all(futs).await;
            for (i, r) in idx.into_iter().zip(results) {
                verdicts[i] = r?;
            }
            Ok(verdicts)
        })
    }

    /// Called once for each block that passed, when it leaves the pipeline. Default: nothing.
    fn release(&self, _hashes: &[SequenceHash]) {}
}

/// A pass-all policy (no filtering).
#[derive(Debug, Clone, Copy, Default)]
pub struct PassAllPolicy;

impl OffloadPolicy for PassAllPolicy {
    fn name(&self) -> &'static str {
        "pass_all"
    }
    #[inline]
    fn evaluate(&self, _ctx: &EvalContext) -> PolicyFuture {
        sync_result(true)
    }
    fn evaluate_batch(&self, ctxs: &[EvalContext]) -> PolicyBatchFuture {
        sync_batch_result(vec![true; ctxs.len()])
    }
}

/// G1→G2 filter: skip blocks already present in the destination tier.
#[derive(Clone)]
pub struct PresenceFilter {
    registry: BlockRegistry,
}

impl std::fmt::Debug for PresenceFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PresenceFilter").finish_non_exhaustive()
    }
}

impl PresenceFilter {
    /// A filter reading presence from `registry` (the destination is the context's).
    pub fn new(registry: BlockRegistry) -> Self {
        Self { registry }
    }
}

impl OffloadPolicy for PresenceFilter {
    fn name(&self) -> &'static str {
        "presence"
    }
    #[inline]
    fn evaluate(&self, ctx: &EvalContext) -> PolicyFuture {
        sync_result(!self.registry.is_present(ctx.sequence_hash, ctx.destination))
    }
    fn evaluate_batch(&self, ctxs: &[EvalContext]) -> PolicyBatchFuture {
        sync_batch_result(
            ctxs.iter()
                .map(|c| !self.registry.is_present(c.sequence_hash, c.destination))
                .collect(),
        )
    }
}

/// Default frequency threshold of [`PresenceAndLFUFilter`] (a configuration default, kept with
/// the others).
pub use crate::config::DEFAULT_MIN_LFU_COUNT;

/// G2→G3 filter: presence check + LFU count threshold.
///
/// Passes a block that is not in the destination and whose registry frequency estimate is at
/// least `min_lfu_count` (disk writes cost wear; one-off blocks are not worth them).
#[derive(Clone)]
pub struct PresenceAndLFUFilter {
    registry: BlockRegistry,
    min_lfu_count: u32,
}

impl std::fmt::Debug for PresenceAndLFUFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PresenceAndLFUFilter")
            .field("min_lfu_count", &self.min_lfu_count)
            .finish_non_exhaustive()
    }
}

impl PresenceAndLFUFilter {
    /// A filter with an explicit threshold.
    pub fn new(registry: BlockRegistry, min_lfu_count: u32) -> Self {
        Self {
            registry,
            min_lfu_count,
        }
    }

    /// A filter with [`DEFAULT_MIN_LFU_COUNT`].
    pub fn with_default_threshold(registry: BlockRegistry) -> Self {
        Self::new(registry, DEFAULT_MIN_LFU_COUNT)
    }

    /// The threshold.
    pub fn min_lfu_count(&self) -> u32 {
        self.min_lfu_count
    }

    #[inline]
    fn pass(&self, ctx: &EvalContext) -> bool {
        !self.registry.is_present(ctx.sequence_hash, ctx.destination)
            && self.registry.frequency(ctx.sequence_hash) >= self.min_lfu_count
    }
}

impl OffloadPolicy for PresenceAndLFUFilter {
    fn name(&self) -> &'static str {
        "presence_lfu"
    }
    #[inline]
    fn evaluate(&self, ctx: &EvalContext) -> PolicyFuture {
        sync_result(self.pass(ctx))
    }
    fn evaluate_batch(&self, ctxs: &[EvalContext]) -> PolicyBatchFuture {
        sync_batch_result(ctxs.iter().map(|c| self.pass(c)).collect())
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    All,
    Any,
}

fn combine(
    mode: Mode,
    children: Arc<[Arc<dyn OffloadPolicy>]>,
    ctxs: &[EvalContext],
) -> PolicyBatchFuture {
    // verdict[i]: for All, "still passing"; for Any, "already passed".
    let mut verdict = vec![mode == Mode::All; ctxs.len()];
    let undecided = move |v: bool| if mode == Mode::All { v } else { !v };
    for (k, child) in children.iter().enumerate() {
        let idx: Vec<usize> = (0..ctxs.len()).filter(|&i| undecided(verdict[i])).collect();
        if idx.is_empty() {
            break;
        }
        let sub: Vec<EvalContext> = idx.iter().map(|&i| ctxs[i]).collect();
        match child.evaluate_batch(&sub) {
            Either::Left(r) => match r
                .into_inner()
                .and_then(|v| merge(mode, &mut verdict, &idx, &v, child.name()))
            {
                Ok(()) => {}
                Err(e) => return Either::Left(ready(Err(e))),
            },
            Either::Right(fut) => {
                let ctxs = ctxs.to_vec();
                return async_batch_result(async move {
                    let v = fut.await?;
                    merge(mode, &mut verdict, &idx, &v, children[k].name())?;
                    for child in children.iter().skip(k + 1) {
                        let idx: Vec<usize> =
                            (0..ctxs.len()).filter(|&i| undecided(verdict[i])).collect();
                        if idx.is_empty() {
                            break;
                        }
                        let sub: Vec<EvalContext> = idx.iter().map(|&i| ctxs[i]).collect();
                        let v = match child.evaluate_batch(&sub) {
                            Either::Left(r) => r.into_inner()?,
                            Either::Right(f) => f.await?,
                        };
                        merge(mode, &mut verdict, &idx, &v, child.name())?;
                    }
                    Ok(verdict)
                });
            }
        }
    }
    sync_batch_result(verdict)
}

/// Folds a child's verdicts in; a child answering with the wrong number of verdicts is an
/// error (never a silent pass for the blocks it left out).
fn merge(
    mode: Mode,
    verdict: &mut [bool],
    idx: &[usize],
    v: &[bool],
    policy: &'static str,
) -> Result<(), PolicyError> {
    if v.len() != idx.len() {
        return Err(PolicyError::Verdicts {
            policy,
            expected: idx.len(),
            got: v.len(),
        });
    }
    for (&i, &ok) in idx.iter().zip(v) {
        // Only undecided blocks were asked: for All they were passing, for Any not yet passed;
        // either way the child's answer is the new verdict.
        let _ = mode;
        verdict[i] = ok;
    }
    Ok(())
}

/// Composite policy that requires ALL sub-policies to pass (AND logic).
///
/// Children are asked in order, each only about blocks all earlier children passed. An empty
/// list passes everything.
#[derive(Clone)]
pub struct AllOfPolicy {
    children: Arc<[Arc<dyn OffloadPolicy>]>,
}

impl AllOfPolicy {
    /// Combines `children`.
    pub fn new(children: Vec<Arc<dyn OffloadPolicy>>) -> Self {
        Self {
            children: children.into(),
        }
    }
}

impl std::fmt::Debug for AllOfPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.children.iter().map(|c| c.name()))
            .finish()
    }
}

impl OffloadPolicy for AllOfPolicy {
    fn name(&self) -> &'static str {
        "all_of"
    }
    fn evaluate(&self, ctx: &EvalContext) -> PolicyFuture {
        match self.evaluate_batch(std::slice::from_ref(ctx)) {
            Either::Left(r) => Either::Left(ready(r.into_inner().map(|v| v[0]))),
            Either::Right(f) => async_result(async move { f.await.map(|v| v[0]) }),
        }
    }
    fn evaluate_batch(&self, ctxs: &[EvalContext]) -> PolicyBatchFuture {
        combine(Mode::All, self.children.clone(), ctxs)
    }
    fn release(&self, hashes: &[SequenceHash]) {
        for c in self.children.iter() {
            c.release(hashes);
        }
    }
}

/// Composite policy that requires ANY sub-policy to pass (OR logic).
///
/// Children are asked in order, each only about blocks no earlier child passed. An empty list
/// passes nothing.
#[derive(Clone)]
pub struct AnyOfPolicy {
    children: Arc<[Arc<dyn OffloadPolicy>]>,
}

impl AnyOfPolicy {
    /// Combines `children`.
    pub fn new(children: Vec<Arc<dyn OffloadPolicy>>) -> Self {
        Self {
            children: children.into(),
        }
    }
}

impl std::fmt::Debug for AnyOfPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.children.iter().map(|c| c.name()))
            .finish()
    }
}

impl OffloadPolicy for AnyOfPolicy {
    fn name(&self) -> &'static str {
        "any_of"
    }
    fn evaluate(&self, ctx: &EvalContext) -> PolicyFuture {
        match self.evaluate_batch(std::slice::from_ref(ctx)) {
            Either::Left(r) => Either::Left(ready(r.into_inner().map(|v| v[0]))),
            Either::Right(f) => async_result(async move { f.await.map(|v| v[0]) }),
        }
    }
    fn evaluate_batch(&self, ctxs: &[EvalContext]) -> PolicyBatchFuture {
        combine(Mode::Any, self.children.clone(), ctxs)
    }
    fn release(&self, hashes: &[SequenceHash]) {
        for c in self.children.iter() {
            c.release(hashes);
        }
    }
}

/// Create a composite policy from tier configuration.
///
/// An empty list gives [`PassAllPolicy`]; one entry gives that policy; several are combined
/// with [`AllOfPolicy`] in the order given.
pub fn create_policy_from_config(
    configs: &[PolicyConfig],
    registry: &BlockRegistry,
) -> Arc<dyn OffloadPolicy> {
    let mut built: Vec<Arc<dyn OffloadPolicy>> = configs
        .iter()
        .map(|c| -> Arc<dyn OffloadPolicy> {
            match c {
                PolicyConfig::PassAll => Arc::new(PassAllPolicy),
                PolicyConfig::Presence => Arc::new(PresenceFilter::new(registry.clone())),
                PolicyConfig::PresenceLfu { min_lfu_count } => {
                    Arc::new(PresenceAndLFUFilter::new(registry.clone(), *min_lfu_count))
                }
            }
        })
        .collect();
    match built.len() {
        0 => Arc::new(PassAllPolicy),
        1 => built.pop().expect("one policy"),
        _ => Arc::new(AllOfPolicy::new(built)),
    }
}
