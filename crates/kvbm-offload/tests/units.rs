//! Stage pieces in isolation: queue and sweeper, policies and their composition, configuration.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::hash;
use either::Either;
use kvbm_logical::{BlockManager, BlockRegistry, G2, G3, TierId};
use kvbm_offload::config::{DEFAULT_OBJECT_POLICY_TIMEOUT, PolicyConfig};
use kvbm_offload::engine::OffloadEngine;
use kvbm_offload::executor::NoopExecutor;
use kvbm_offload::object::DEFAULT_LOCK_TTL;
use kvbm_offload::pending::PendingTracker;
use kvbm_offload::policy::{
    AnyOfPolicy, EvalContext, PassAllPolicy, PolicyBatchFuture, PolicyFuture, PresenceAndLFUFilter,
    async_result, sync_result,
};
use kvbm_offload::settlement::SettlementToken;
use kvbm_offload::*;

fn ctx(i: u32, dst: TierId) -> EvalContext {
    EvalContext {
        sequence_hash: hash(i),
        digest: None,
        block_id: Some(i as usize),
        source: TierId::G2,
        destination: dst,
    }
}

fn now(f: PolicyBatchFuture) -> Vec<bool> {
    match f {
        Either::Left(r) => r.into_inner().unwrap(),
        Either::Right(_) => panic!("expected a synchronous result"),
    }
}

#[test]
fn sync_results_are_not_boxed() {
    assert!(matches!(sync_result(true), Either::Left(_)));
    assert!(matches!(
        PassAllPolicy.evaluate(&ctx(0, TierId::G3)),
        Either::Left(_)
    ));
    assert!(matches!(async_result(async { Ok(true) }), Either::Right(_)));
}

#[test]
fn presence_and_lfu_filters_read_the_registry() {
    let registry = BlockRegistry::new();
    let g3 = BlockManager::<G3>::builder()
        .block_count(4)
        .block_size(4)
        .registry(registry.clone())
        .build()
        .unwrap();
    let _present = common::registered(&g3, 0, 1);
    for _ in 0..3 {
        registry.touch(hash(1));
    }
    let ctxs = [ctx(0, TierId::G3), ctx(1, TierId::G3), ctx(2, TierId::G3)];
    assert_eq!(
        now(PresenceFilter::new(registry.clone()).evaluate_batch(&ctxs)),
        vec![false, true, true]
    );
    let lfu = PresenceAndLFUFilter::new(registry.clone(), 2);
    assert_eq!(
        now(lfu.evaluate_batch(&ctxs)),
        vec![false, true, false],
        "0 present, 2 too rare"
    );
    assert_eq!(
        PresenceAndLFUFilter::with_default_threshold(registry).min_lfu_count(),
        1
    );
}

struct Fixed(Vec<u32>, Arc<parking_lot::Mutex<Vec<u32>>>);
impl OffloadPolicy for Fixed {
    fn name(&self) -> &'static str {
        "fixed"
    }
    fn evaluate(&self, c: &EvalContext) -> PolicyFuture {
        let i = c.block_id.unwrap() as u32;
        self.1.lock().push(i);
        sync_result(self.0.contains(&i))
    }
}

#[test]
fn all_of_and_any_of_ask_later_children_only_about_undecided_blocks() {
    let asked = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let a: Arc<dyn OffloadPolicy> = Arc::new(Fixed(vec![0, 1], Arc::default()));
    let b: Arc<dyn OffloadPolicy> = Arc::new(Fixed(vec![1, 2], asked.clone()));
    let ctxs = [ctx(0, TierId::G3), ctx(1, TierId::G3), ctx(2, TierId::G3)];
    let all = AllOfPolicy::new(vec![a.clone(), b.clone()]);
    assert_eq!(now(all.evaluate_batch(&ctxs)), vec![false, true, false]);
    assert_eq!(*asked.lock(), vec![0, 1], "AND: b only sees what a passed");
    asked.lock().clear();
    let any = AnyOfPolicy::new(vec![a, b]);
    assert_eq!(now(any.evaluate_batch(&ctxs)), vec![true, true, true]);
    assert_eq!(
        *asked.lock(),
        vec![2],
        "OR: b only sees what a did not pass"
    );
    assert_eq!(
        now(AllOfPolicy::new(vec![]).evaluate_batch(&ctxs)),
        vec![true; 3]
    );
    assert_eq!(
        now(AnyOfPolicy::new(vec![]).evaluate_batch(&ctxs)),
        vec![false; 3]
    );
}

#[tokio::test]
async fn composition_goes_async_only_when_a_child_does() {
    let gated = common::GatedPolicy::default();
    gated.gate.add_permits(10);
    let all = AllOfPolicy::new(vec![Arc::new(PassAllPolicy), Arc::new(gated)]);
    match all.evaluate_batch(&[ctx(0, TierId::G3), ctx(1, TierId::G3)]) {
        Either::Right(f) => assert_eq!(f.await.unwrap(), vec![true, true]),
        Either::Left(_) => panic!("an async child makes the result async"),
    }
}

#[test]
fn create_policy_from_config_builds_the_listed_policies() {
    let registry = BlockRegistry::new();
    assert_eq!(create_policy_from_config(&[], &registry).name(), "pass_all");
    assert_eq!(
        create_policy_from_config(&[PolicyConfig::Presence], &registry).name(),
        "presence"
    );
    let both = create_policy_from_config(
        &[
            PolicyConfig::Presence,
            PolicyConfig::PresenceLfu { min_lfu_count: 2 },
        ],
        &registry,
    );
    assert_eq!(both.name(), "all_of");
}

#[test]
fn pipeline_config_defaults_match_the_spec_and_every_key_is_settable() {
    let d = PipelineConfig::default();
    assert_eq!(d.batch_config.max_batch_size, 64);
    assert_eq!(d.batch_config.min_batch_size, 8);
    assert_eq!(d.batch_config.flush_interval, Duration::from_millis(10));
    assert_eq!(d.policy_timeout, Duration::from_millis(100));
    assert_eq!(d.sweep_interval, Duration::from_millis(10));
    assert_eq!(d.max_concurrent_transfers, 1);
    let json = serde_json::json!({
        "batch_config": {"max_batch_size": 16, "min_batch_size": 2, "flush_interval_ms": 5},
        "policy_timeout_ms": 50, "sweep_interval_ms": 1, "max_concurrent_transfers": 4,
        "queue_capacity": 8, "max_concurrent_evaluations": 2, "record_timing": false,
        "sweep_on_cancel": false,
        "policies": [{"kind": "presence"}, {"kind": "presence_lfu", "min_lfu_count": 3}]
    });
    let c: PipelineConfig = serde_json::from_value(json).unwrap();
    assert_eq!(c.batch_config.flush_interval, Duration::from_millis(5));
    assert_eq!(c.max_concurrent_transfers, 4);
    assert_eq!(
        c.policies[1],
        PolicyConfig::PresenceLfu { min_lfu_count: 3 }
    );
    let back: PipelineConfig = serde_json::from_value(serde_json::to_value(&c).unwrap()).unwrap();
    assert_eq!(back, c);
    assert!(serde_json::from_value::<PipelineConfig>(serde_json::json!({"bogus": 1})).is_err());
    let bad = PipelineConfig {
        max_concurrent_transfers: 0,
        ..Default::default()
    };
    assert!(bad.validate().is_err());
    let obj = ObjectPipelineConfig::default();
    assert!(obj.use_locks);
    assert_eq!(obj.pipeline.policy_timeout, DEFAULT_OBJECT_POLICY_TIMEOUT);
}

#[test]
fn pending_tracker_suppresses_duplicates_until_the_guard_drops() {
    let t = PendingTracker::new();
    let g = t.try_insert(hash(1)).unwrap();
    assert!(t.try_insert(hash(1)).is_none());
    let batch = t.try_insert_batch([hash(1), hash(2), hash(2)]);
    assert_eq!(
        batch.iter().map(Option::is_some).collect::<Vec<_>>(),
        vec![false, true, false]
    );
    drop(g);
    drop(batch);
    assert!(t.is_empty());
}

#[test]
fn public_types_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<OffloadHandle>();
    check::<CancellationToken>();
    check::<Pipeline<G2>>();
    check::<Pipeline<G3, kvbm_logical::MutableBlock<G2>>>();
    check::<OffloadEngine>();
    check::<ObjectPipeline>();
    check::<SettlementToken>();
    check::<PendingTracker>();
}

#[test]
fn object_config_lock_ttl_is_read_and_validated() {
    let obj = ObjectPipelineConfig::default();
    assert_eq!(obj.lock_ttl, DEFAULT_LOCK_TTL);
    obj.validate().unwrap();
    let json = serde_json::json!({"lock_ttl_ms": 5000, "lock_verify_delay_ms": 10});
    let c: ObjectPipelineConfig = serde_json::from_value(json).unwrap();
    assert_eq!(c.lock_ttl, Duration::from_millis(5000));
    let back: ObjectPipelineConfig =
        serde_json::from_value(serde_json::to_value(&c).unwrap()).unwrap();
    assert_eq!(back, c);
    // Not longer than the verify delay, or than the policy timeout: rejected.
    let short = ObjectPipelineConfig {
        lock_ttl: Duration::from_millis(20),
        ..Default::default()
    };
    assert!(short.validate().is_err());
    let short = ObjectPipelineConfig {
        lock_ttl: DEFAULT_OBJECT_POLICY_TIMEOUT,
        ..Default::default()
    };
    let err = short.validate().unwrap_err();
    assert!(err.to_string().contains("policy_timeout"), "{err}");
    // The object pipeline refuses to start with it.
    let storage = Arc::new(kvbm_physical::ObjectStorage::in_memory(Default::default()));
    let spawned = ObjectPipelineBuilder::new(storage)
        .config(short)
        .spawn(NoopExecutor);
    assert!(matches!(spawned, Err(OffloadError::InvalidConfig(_))));
}
