//! Cross-module tests: a proptest state machine against a reference model, and a
//! multi-threaded stress test.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use parking_lot::Mutex;
use proptest::prelude::*;
use rand::{Rng, SeedableRng, rngs::StdRng};

use crate::{
    BlockManager, DuplicationPolicy, EvictionBackend, EvictionPolicy, G2, ImmutableBlock,
    LogicalError, MutableBlock, Salt, SequenceHash, TierId, TokenBlockSequence, WeakBlock,
};

const BS: u32 = 2;
const SEQS: usize = 3;
const SEQ_LEN: usize = 6;

fn sequences() -> Vec<Vec<SequenceHash>> {
    (0..SEQS as u32)
        .map(|s| {
            let tokens: Vec<u32> = (0..(SEQ_LEN as u32 * BS)).map(|t| t + s * 1000).collect();
            TokenBlockSequence::from_tokens(&tokens, BS, Salt::new("prop"))
                .unwrap()
                .hashes()
        })
        .collect()
}

/// Every named policy (each backend, plain and behind TinyLFU).
fn policies() -> Vec<EvictionPolicy> {
    EvictionPolicy::all()
}

#[derive(Clone, Debug)]
enum Op {
    /// Allocate n mutable blocks and keep them.
    Allocate(usize),
    /// Drop a held mutable block.
    DropMutable(usize),
    /// Allocate, complete and register `seq[start..start+len]`, keeping the strong handles.
    Register {
        seq: usize,
        start: usize,
        len: usize,
    },
    /// Drop a held strong handle.
    DropImmutable(usize),
    /// Clone a held strong handle.
    Clone(usize),
    /// Downgrade a held strong handle and keep the weak one.
    Downgrade(usize),
    /// Upgrade a kept weak handle (keeping the strong one on success).
    Upgrade(usize),
    /// match_blocks on `seq[..len]`, keeping the result when `keep`.
    Match { seq: usize, len: usize, keep: bool },
    /// Evict every evictable inactive block.
    ResetInactive,
    /// `allocate_blocks_with(len, seq[start..start+len])`: a store that protects its own
    /// keys, then registers them; checks the reported evictions exactly.
    Store {
        seq: usize,
        start: usize,
        len: usize,
    },
    /// A recency touch of `seq[..len]`.
    Touch { seq: usize, len: usize },
    /// `discard_inactive(seq[start..start+len])`: drops exactly the inactive ones the policy
    /// can remove; held blocks stay registered.
    Discard {
        seq: usize,
        start: usize,
        len: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0usize..4).prop_map(Op::Allocate),
        any::<usize>().prop_map(Op::DropMutable),
        (0..SEQS, 0..SEQ_LEN, 1usize..4).prop_map(|(seq, start, len)| Op::Register {
            seq,
            start,
            len: len.min(SEQ_LEN - start)
        }),
        any::<usize>().prop_map(Op::DropImmutable),
        any::<usize>().prop_map(Op::DropImmutable),
        any::<usize>().prop_map(Op::Clone),
        any::<usize>().prop_map(Op::Downgrade),
        any::<usize>().prop_map(Op::Upgrade),
        (0..SEQS, 0..=SEQ_LEN, any::<bool>()).prop_map(|(seq, len, keep)| Op::Match {
            seq,
            len,
            keep
        }),
        Just(Op::ResetInactive),
        (0..SEQS, 0..SEQ_LEN, 1usize..5).prop_map(|(seq, start, len)| Op::Store {
            seq,
            start,
            len: len.min(SEQ_LEN - start)
        }),
        (0..SEQS, 0..=SEQ_LEN).prop_map(|(seq, len)| Op::Touch { seq, len }),
        (0..SEQS, 0..SEQ_LEN, 1usize..4).prop_map(|(seq, start, len)| Op::Discard {
            seq,
            start,
            len: len.min(SEQ_LEN - start)
        }),
    ]
}

/// The reference model: what the test holds, and which hashes were ever registered.
#[derive(Default)]
struct Model {
    mutables: Vec<MutableBlock<G2>>,
    strong: Vec<ImmutableBlock<G2>>,
    weak: Vec<WeakBlock<G2>>,
    ever_registered: HashSet<SequenceHash>,
}

impl Model {
    /// Distinct slots held by strong handles.
    fn active_slots(&self) -> usize {
        self.strong
            .iter()
            .map(|b| b.block_id())
            .collect::<HashSet<_>>()
            .len()
    }

    fn check(
        &self,
        m: &BlockManager<G2>,
        total: usize,
        dup: DuplicationPolicy,
    ) -> Result<(), TestCaseError> {
        let c = m.check_invariants().map_err(TestCaseError::fail)?;
        prop_assert_eq!(c.reset + c.held + c.active + c.inactive, total);
        prop_assert_eq!(c.held, self.mutables.len());
        prop_assert_eq!(c.active, self.active_slots());
        prop_assert_eq!(m.available_blocks(), total - c.held - c.active);
        // without duplicates, every hash we hold strongly is present (matchable) in the tier;
        // an allowed duplicate may outlive its evicted primary
        if dup == DuplicationPolicy::Reject {
            for b in &self.strong {
                prop_assert!(m.registry().is_present(b.sequence_hash(), TierId::G2));
            }
        }
        // strong handles to one slot agree on its hash
        let mut by_slot: HashMap<usize, SequenceHash> = HashMap::new();
        for b in &self.strong {
            let h = *by_slot.entry(b.block_id()).or_insert(b.sequence_hash());
            prop_assert_eq!(h, b.sequence_hash());
        }
        Ok(())
    }
}

/// The hashes registered (present) in the tier, of all the test's sequences.
fn present(m: &BlockManager<G2>, seqs: &[Vec<SequenceHash>]) -> HashSet<SequenceHash> {
    seqs.iter()
        .flatten()
        .copied()
        .filter(|h| m.registry().is_present(*h, TierId::G2))
        .collect()
}

fn run_ops(
    policy: EvictionPolicy,
    dup: DuplicationPolicy,
    total: usize,
    ops: Vec<Op>,
) -> Result<(), TestCaseError> {
    let seqs = sequences();
    let m = BlockManager::<G2>::builder()
        .block_count(total)
        .block_size(BS)
        .policy(policy)
        .duplication_policy(dup)
        .build()
        .unwrap();
    let backend = policy.backend;
    let mut model = Model::default();
    for op in ops {
        match op {
            Op::Allocate(n) => {
                let free_in_model = total - model.mutables.len() - model.active_slots();
                match m.allocate_blocks(n) {
                    Ok(blocks) => {
                        prop_assert_eq!(blocks.len(), n);
                        model.mutables.extend(blocks);
                    }
                    Err(LogicalError::InsufficientBlocks { requested, .. }) => {
                        prop_assert_eq!(requested, n);
                        if backend != EvictionBackend::Lineage {
                            prop_assert!(
                                free_in_model < n,
                                "allocation failed with {free_in_model} free"
                            );
                        }
                    }
                    Err(e) => return Err(TestCaseError::fail(e.to_string())),
                }
            }
            Op::Store { seq, start, len } => {
                let keys = &seqs[seq][start..start + len];
                let before = present(&m, &seqs);
                let counts = m.pool_counts();
                match m.allocate_blocks_with(len, keys) {
                    Ok(alloc) => {
                        prop_assert_eq!(alloc.blocks.len(), len);
                        let after = present(&m, &seqs);
                        let evicted: HashSet<SequenceHash> =
                            alloc.evicted.iter().copied().collect();
                        prop_assert_eq!(evicted.len(), alloc.evicted.len(), "duplicates");
                        let gone: HashSet<SequenceHash> =
                            before.difference(&after).copied().collect();
                        prop_assert_eq!(&evicted, &gone, "reported vs actually evicted");
                        for k in keys {
                            prop_assert!(!evicted.contains(k), "evicted a protected key");
                            if before.contains(k) {
                                prop_assert!(after.contains(k));
                            }
                        }
                        prop_assert_eq!(
                            alloc.evicted.len(),
                            len.saturating_sub(counts.reset),
                            "evicts only what the reset pool lacks"
                        );
                        let complete = alloc
                            .blocks
                            .into_iter()
                            .zip(keys)
                            .map(|(b, h)| b.complete(*h).unwrap())
                            .collect();
                        let regs = m.register_blocks(complete);
                        model.ever_registered.extend(keys.iter().copied());
                        model.strong.extend(regs);
                    }
                    Err(LogicalError::InsufficientBlocks { .. }) => {
                        // all or nothing: no eviction, no change
                        prop_assert_eq!(&present(&m, &seqs), &before);
                        prop_assert_eq!(m.pool_counts(), counts);
                        let protected_present = keys.iter().filter(|k| before.contains(k)).count();
                        if backend != EvictionBackend::Lineage {
                            prop_assert!(
                                counts.reset + counts.inactive < len + protected_present,
                                "failed with {counts:?}"
                            );
                        }
                    }
                    Err(e) => return Err(TestCaseError::fail(e.to_string())),
                }
            }
            Op::Touch { seq, len } => {
                let hashes = &seqs[seq][..len];
                let n = m.touch_blocks(hashes);
                let expect = hashes
                    .iter()
                    .filter(|h| m.registry().is_present(**h, TierId::G2))
                    .count();
                prop_assert_eq!(n, expect);
            }
            Op::DropMutable(i) => {
                if !model.mutables.is_empty() {
                    let i = i % model.mutables.len();
                    model.mutables.swap_remove(i);
                }
            }
            Op::Register { seq, start, len } => {
                let hashes = &seqs[seq][start..start + len];
                if let Ok(blocks) = m.allocate_blocks(len) {
                    let complete = blocks
                        .into_iter()
                        .zip(hashes)
                        .map(|(b, h)| b.complete(*h).unwrap())
                        .collect();
                    let regs = m.register_blocks(complete);
                    prop_assert_eq!(regs.len(), len);
                    for (r, h) in regs.iter().zip(hashes) {
                        prop_assert_eq!(r.sequence_hash(), *h);
                    }
                    model.ever_registered.extend(hashes.iter().copied());
                    model.strong.extend(regs);
                }
            }
            Op::DropImmutable(i) => {
                if !model.strong.is_empty() {
                    let i = i % model.strong.len();
                    model.strong.swap_remove(i);
                }
            }
            Op::Clone(i) => {
                if !model.strong.is_empty() {
                    let b = model.strong[i % model.strong.len()].clone();
                    model.strong.push(b);
                }
            }
            Op::Downgrade(i) => {
                if !model.strong.is_empty() {
                    let w = model.strong[i % model.strong.len()].downgrade();
                    model.weak.push(w);
                }
            }
            Op::Upgrade(i) => {
                if !model.weak.is_empty() {
                    let w = &model.weak[i % model.weak.len()];
                    let held = model
                        .strong
                        .iter()
                        .any(|b| b.sequence_hash() == w.sequence_hash());
                    match w.upgrade() {
                        Some(b) => {
                            prop_assert_eq!(b.sequence_hash(), w.sequence_hash());
                            model.strong.push(b);
                        }
                        None => {
                            // only fails once evicted; a held primary can never be evicted
                            let primary_held =
                                held && m.registry().is_present(w.sequence_hash(), TierId::G2);
                            prop_assert!(
                                !primary_held,
                                "upgrade failed while the block is registered and held"
                            );
                        }
                    }
                }
            }
            Op::Match { seq, len, keep } => {
                let hashes = &seqs[seq][..len];
                let got = m.match_blocks(hashes);
                prop_assert!(got.len() <= len);
                for (b, h) in got.iter().zip(hashes) {
                    prop_assert_eq!(b.sequence_hash(), *h);
                    prop_assert!(model.ever_registered.contains(h));
                }
                if got.len() < len {
                    prop_assert!(!m.registry().is_present(hashes[got.len()], TierId::G2));
                }
                if keep {
                    model.strong.extend(got);
                }
            }
            Op::Discard { seq, start, len } => {
                let hashes = &seqs[seq][start..start + len];
                let before = present(&m, &seqs);
                let counts = m.pool_counts();
                let held: HashSet<SequenceHash> =
                    model.strong.iter().map(|b| b.sequence_hash()).collect();
                let n = m.discard_inactive(hashes);
                let after = present(&m, &seqs);
                let gone: HashSet<SequenceHash> = before.difference(&after).copied().collect();
                prop_assert_eq!(gone.len(), n, "reported vs actually dropped");
                for h in &gone {
                    prop_assert!(hashes.contains(h), "dropped a hash it was not given");
                    // (with duplicates allowed, a held duplicate does not hold the primary)
                    if dup == DuplicationPolicy::Reject {
                        prop_assert!(!held.contains(h), "dropped a held block");
                    }
                }
                let after_counts = m.pool_counts();
                prop_assert_eq!(after_counts.reset, counts.reset + n);
                prop_assert_eq!(after_counts.inactive + n, counts.inactive);
                if backend != EvictionBackend::Lineage && dup == DuplicationPolicy::Reject {
                    // every inactive one is dropped
                    for h in hashes {
                        if before.contains(h) && !held.contains(h) {
                            prop_assert!(!after.contains(h), "an inactive block stayed");
                        }
                    }
                }
            }
            Op::ResetInactive => {
                let before = m.pool_counts();
                let n = m.reset_inactive_pool();
                let after = m.pool_counts();
                prop_assert_eq!(after.reset, before.reset + n);
                prop_assert_eq!(after.inactive + n, before.inactive);
                if backend != EvictionBackend::Lineage {
                    prop_assert_eq!(after.inactive, 0);
                }
            }
        }
        model.check(&m, total, dup)?;
    }
    // tear down: everything returns to a pool, nothing leaks
    model.mutables.clear();
    model.strong.clear();
    let c = m.check_invariants().map_err(TestCaseError::fail)?;
    prop_assert_eq!((c.held, c.active), (0, 0));
    prop_assert_eq!(c.reset + c.inactive, total);
    m.reset_inactive_pool();
    prop_assert_eq!(m.pool_counts().reset, total);
    prop_assert!(model.weak.iter().all(|w| w.upgrade().is_none()));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn state_machine_matches_model(
        policy in 0usize..14,
        reject in any::<bool>(),
        total in 4usize..12,
        ops in proptest::collection::vec(op(), 1..80),
    ) {
        let dup = if reject { DuplicationPolicy::Reject } else { DuplicationPolicy::Allow };
        run_ops(policies()[policy], dup, total, ops)?;
    }
}

/// Several threads, 100k+ mixed operations on one manager; at the end every block is back in
/// a pool and no slot leaked.
#[test]
fn multi_threaded_stress_leaks_nothing() {
    const THREADS: usize = 4;
    const OPS: usize = 30_000;
    const TOTAL: usize = 48;
    for backend in [EvictionBackend::Lru, EvictionBackend::Lineage] {
        let m = Arc::new(
            BlockManager::<G2>::builder()
                .block_count(TOTAL)
                .block_size(BS)
                .eviction(backend)
                .build()
                .unwrap(),
        );
        let seqs: Arc<Vec<Vec<SequenceHash>>> = Arc::new(
            (0..12u32)
                .map(|s| {
                    let tokens: Vec<u32> = (0..(8 * BS)).map(|t| t + s * 100).collect();
                    TokenBlockSequence::from_tokens(&tokens, BS, Salt::NONE)
                        .unwrap()
                        .hashes()
                })
                .collect(),
        );
        let shared_weak: Arc<Mutex<Vec<WeakBlock<G2>>>> = Arc::default();
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let (m, seqs, shared_weak) = (m.clone(), seqs.clone(), shared_weak.clone());
                std::thread::spawn(move || {
                    let mut rng = StdRng::seed_from_u64(t as u64 * 7919 + 1);
                    let mut held: Vec<ImmutableBlock<G2>> = Vec::new();
                    let mut matched_blocks = 0usize;
                    for _ in 0..OPS {
                        match rng.random_range(0..10) {
                            0..=3 => {
                                let seq = &seqs[rng.random_range(0..seqs.len())];
                                let len = rng.random_range(1..=seq.len());
                                let got = m.match_blocks(&seq[..len]);
                                matched_blocks += got.len();
                                for (b, h) in got.iter().zip(seq) {
                                    assert_eq!(b.sequence_hash(), *h);
                                }
                                if got.len() < len {
                                    let missing = &seq[got.len()..len];
                                    if let Ok(blocks) = m.allocate_blocks(missing.len()) {
                                        let complete = blocks
                                            .into_iter()
                                            .zip(missing)
                                            .map(|(b, h)| b.complete(*h).unwrap())
                                            .collect();
                                        let regs = m.register_blocks(complete);
                                        if held.len() < 6 {
                                            held.extend(regs);
                                        }
                                    }
                                }
                                if held.len() < 6 {
                                    held.extend(got);
                                }
                            }
                            4 | 5 => {
                                if !held.is_empty() {
                                    let i = rng.random_range(0..held.len());
                                    held.swap_remove(i);
                                }
                            }
                            6 => {
                                if let Some(b) = held.last() {
                                    let c = b.clone();
                                    assert_eq!(c.block_id(), b.block_id());
                                }
                            }
                            7 => {
                                if let Some(b) = held.first() {
                                    let mut w = shared_weak.lock();
                                    if w.len() < 64 {
                                        w.push(b.downgrade());
                                    }
                                }
                            }
                            8 => {
                                let w = {
                                    let mut w = shared_weak.lock();
                                    if w.is_empty() {
                                        None
                                    } else {
                                        let i = rng.random_range(0..w.len());
                                        Some(w.swap_remove(i))
                                    }
                                };
                                if let Some(w) = w
                                    && let Some(b) = w.upgrade()
                                {
                                    assert_eq!(b.sequence_hash(), w.sequence_hash());
                                }
                            }
                            _ => {
                                // allocate and drop unregistered blocks
                                if let Ok(b) = m.allocate_blocks(rng.random_range(1..4)) {
                                    drop(b);
                                }
                            }
                        }
                    }
                    drop(held);
                    matched_blocks
                })
            })
            .collect();
        let matched: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
        assert!(matched > 0, "the stress test must exercise hits");
        shared_weak.lock().clear();
        let c = m.check_invariants().unwrap();
        assert_eq!(
            (c.held, c.active),
            (0, 0),
            "{backend:?}: leaked handles: {c:?}"
        );
        assert_eq!(c.reset + c.inactive, TOTAL);
        m.reset_inactive_pool();
        assert_eq!(m.pool_counts().reset, TOTAL, "{backend:?}");
        assert!(m.registry().is_empty(), "{backend:?}: presence left behind");
    }
}
