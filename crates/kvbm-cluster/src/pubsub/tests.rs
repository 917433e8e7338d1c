//! Tests of the event path: bounded never-blocking publishing with counted drops, and two
//! instances' block managers feeding one cross-instance index through the in-process bus.

use std::sync::Arc;

use kvbm_logical::{
    BlockEvent, BlockEventKind, BlockManager, EventBatchConfig, G2, Salt, TierId,
    TokenBlockSequence,
};

use super::*;
use kvbm_engine::runtime::{EventSource, KvbmRuntime};
use kvbm_tests::wait::eventually;

fn event(i: u8) -> BlockEvent {
    let seq = TokenBlockSequence::from_tokens(&[u32::from(i); 4], 4, Salt::NONE).unwrap();
    BlockEvent {
        kind: BlockEventKind::Stored,
        tier: TierId::G2,
        hash: seq.hashes()[0],
    }
}

#[test]
fn a_full_queue_drops_and_counts_never_blocks() {
    let (publisher, mut rx) = EventPublisher::with_queue(InstanceId(7), 2);
    for i in 0..5 {
        publisher.publish(vec![event(i)]);
    }
    assert_eq!(publisher.published_batches(), 2);
    assert_eq!(publisher.dropped_batches(), 3);
    let first = rx.try_recv().unwrap();
    assert_eq!(first.instance, InstanceId(7));
    assert_eq!(&*first.events, &[event(0)]);
    assert_eq!(&*rx.try_recv().unwrap().events, &[event(1)]);
    assert!(rx.try_recv().is_err(), "the dropped batches are gone");
    // Room again: publishing resumes.
    publisher.publish(vec![event(9)]);
    assert_eq!(publisher.published_batches(), 3);
}

fn instance_manager(
    runtime: &kvbm_engine::RuntimeHandle,
    id: u64,
    bus: &Arc<InProcessBus>,
) -> (Arc<BlockManager<G2>>, Arc<EventPublisher>) {
    let publisher = EventPublisher::spawn(runtime, InstanceId(id), bus.clone()).unwrap();
    let manager = Arc::new(
        BlockManager::<G2>::builder()
            .block_count(8)
            .block_size(4)
            .event_sink(publisher.clone())
            .event_batching(EventBatchConfig {
                max_batch: 256,
                max_delay_ms: 1,
            })
            .build()
            .unwrap(),
    );
    let source: Arc<dyn EventSource> = manager.clone();
    runtime.register_event_source(&source);
    (manager, publisher)
}

fn store(m: &BlockManager<G2>, seq: &TokenBlockSequence, n: usize) {
    let complete = m
        .allocate_blocks(n)
        .unwrap()
        .into_iter()
        .zip(seq.blocks())
        .map(|(b, tb)| b.complete_token_block(tb).unwrap())
        .collect();
    drop(m.register_blocks(complete));
}

#[test]
fn two_instances_feed_one_index() {
    let runtime = KvbmRuntime::builder()
        .set("events.idle_tick_ms", 1)
        .build()
        .unwrap();
    let handle = runtime.handle();
    let bus = Arc::new(InProcessBus::new(256));
    let index = Arc::new(CrossInstanceIndex::new());
    CrossInstanceIndex::follow(index.clone(), &handle, bus.as_ref()).unwrap();
    let (a, _pa) = instance_manager(&handle, 1, &bus);
    let (b, pb) = instance_manager(&handle, 2, &bus);

    let seq =
        TokenBlockSequence::from_tokens(&(0..24).collect::<Vec<u32>>(), 4, Salt::NONE).unwrap();
    let hashes = seq.hashes();
    store(&a, &seq, 4);
    store(&b, &seq, 2);
    eventually(
        "instance 1 holds 4 of the prefix, instance 2 holds 2",
        || index.prefix_by_instance(&hashes, None) == vec![(InstanceId(1), 4), (InstanceId(2), 2)],
    );
    assert_eq!(
        index.prefix_by_instance(&hashes, Some(InstanceId(1))),
        vec![(InstanceId(2), 2)]
    );
    assert_eq!(
        index.locations(hashes[0]),
        vec![(InstanceId(1), TierId::G2), (InstanceId(2), TierId::G2)]
    );

    // B evicts: its Removed events take it out of the index.
    assert_eq!(b.reset_inactive_pool(), 2);
    eventually("instance 1 alone holds 4 of the prefix", || {
        index.prefix_by_instance(&hashes, None) == vec![(InstanceId(1), 4)]
    });
    assert_eq!(pb.dropped_batches(), 0);
    runtime.shutdown();
}

#[test]
fn a_leader_built_from_the_runtime_publishes_its_tiers_events() {
    let runtime = KvbmRuntime::builder()
        .set("events.idle_tick_ms", 1)
        .set("logical.block_size", 4)
        .set("logical.events.max_delay_ms", 1)
        .set("tiers.g2_blocks", 8)
        .build()
        .unwrap();
    let handle = runtime.handle();
    let bus = Arc::new(InProcessBus::new(64));
    let index = Arc::new(CrossInstanceIndex::new());
    CrossInstanceIndex::follow(index.clone(), &handle, bus.as_ref()).unwrap();
    let publisher = EventPublisher::spawn(&handle, InstanceId(3), bus.clone()).unwrap();
    let leader =
        kvbm_engine::InstanceLeader::from_runtime_with_sink(&handle, Some(publisher)).unwrap();
    let seq =
        TokenBlockSequence::from_tokens(&(0..12).collect::<Vec<u32>>(), 4, Salt::NONE).unwrap();
    store(leader.g2().unwrap(), &seq, 3);
    // Nothing else touches the tier: only the runtime's timer can flush the partial batch.
    eventually("instance 3 holds 3 of the sequence", || {
        index.prefix_by_instance(&seq.hashes(), None) == vec![(InstanceId(3), 3)]
    });
    runtime.shutdown();
}

#[test]
fn an_instance_can_be_listed_replaced_and_removed_without_touching_others() {
    let index = CrossInstanceIndex::new();
    let (a, b) = (InstanceId(0xa), InstanceId(0xb));
    let (e0, e1, e2) = (event(0), event(1), event(2));
    index.apply_events(a, &[e0, e1]);
    index.apply_events(b, &[e1]);
    assert_eq!(index.instances(), vec![a, b]);
    let mut want = vec![(e0.hash, TierId::G2), (e1.hash, TierId::G2)];
    want.sort();
    assert_eq!(index.entries_of(a), want);
    // A snapshot of a replaces everything a had: e0 and e1 gone, e2 (in G4) in.
    index.replace_instance(a, &[(e2.hash, TierId::G4)]);
    assert_eq!(index.entries_of(a), vec![(e2.hash, TierId::G4)]);
    assert!(index.locations(e0.hash).is_empty());
    assert_eq!(index.locations(e1.hash), vec![(b, TierId::G2)]);
    assert_eq!(index.remove_instance(a), 1);
    assert_eq!(index.instances(), vec![b]);
    assert_eq!(index.remove_instance(a), 0);
    assert_eq!(index.len(), 1);
}
