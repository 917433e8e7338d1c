//! The index's per-instance counts and cap against a model: whatever sequence of stored and
//! removed events, snapshots and departures, `count_of` is the number of locations
//! `entries_of` lists, no instance holds more than the cap, and every location refused was
//! counted.

use std::collections::BTreeSet;

use kvbm_logical::{BlockEvent, BlockEventKind, Salt, SequenceHash, TierId};
use proptest::prelude::*;

use super::*;

#[derive(Debug, Clone)]
enum Op {
    Stored(u8, u8, bool),
    Removed(u8, u8, bool),
    Replace(u8, Vec<u8>),
    Leave(u8),
}

fn hash(i: u8) -> SequenceHash {
    SequenceHash::root(Salt::NONE, &[u32::from(i), 1, 2, 3])
}

fn tier(g4: bool) -> TierId {
    if g4 { TierId::G4 } else { TierId::G2 }
}

fn event(kind: BlockEventKind, h: u8, g4: bool) -> BlockEvent {
    BlockEvent {
        kind,
        tier: tier(g4),
        hash: hash(h),
    }
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..3, 0u8..12, any::<bool>()).prop_map(|(i, h, t)| Op::Stored(i, h, t)),
        2 => (0u8..3, 0u8..12, any::<bool>()).prop_map(|(i, h, t)| Op::Removed(i, h, t)),
        1 => (0u8..3, proptest::collection::vec(0u8..12, 0..10))
            .prop_map(|(i, v)| Op::Replace(i, v)),
        1 => (0u8..3).prop_map(Op::Leave),
    ]
}

/// Adds `(h, g4)` to an instance's model set as the index would: refused past `cap`.
fn model_store(m: &mut BTreeSet<(u8, bool)>, cap: usize, h: u8, g4: bool) -> bool {
    if m.contains(&(h, g4)) {
        return true;
    }
    if m.len() >= cap {
        return false;
    }
    m.insert((h, g4));
    true
}

proptest! {
    #[test]
    fn counts_and_cap_follow_the_model(ops in proptest::collection::vec(op(), 1..80)) {
        const CAP: usize = 5;
        let index = CrossInstanceIndex::with_cap(CAP);
        let mut model: Vec<BTreeSet<(u8, bool)>> = vec![BTreeSet::new(); 3];
        let mut refused = 0u64;
        for op in ops {
            match op {
                Op::Stored(i, h, g4) => {
                    if !model_store(&mut model[i as usize], CAP, h, g4) {
                        refused += 1;
                    }
                    index.apply_events(
                        InstanceId(u64::from(i)),
                        &[event(BlockEventKind::Stored, h, g4)],
                    );
                }
                Op::Removed(i, h, g4) => {
                    model[i as usize].remove(&(h, g4));
                    index.apply_events(
                        InstanceId(u64::from(i)),
                        &[event(BlockEventKind::Removed, h, g4)],
                    );
                }
                Op::Replace(i, hs) => {
                    let m = &mut model[i as usize];
                    m.clear();
                    for h in &hs {
                        if !model_store(m, CAP, *h, false) {
                            refused += 1;
                        }
                    }
                    let entries: Vec<(SequenceHash, TierId)> =
                        hs.iter().map(|h| (hash(*h), TierId::G2)).collect();
                    index.replace_instance(InstanceId(u64::from(i)), &entries);
                }
                Op::Leave(i) => {
                    model[i as usize].clear();
                    index.remove_instance(InstanceId(u64::from(i)));
                }
            }
            for (i, m) in model.iter().enumerate() {
                let id = InstanceId(i as u64);
                prop_assert_eq!(index.count_of(id), m.len());
                prop_assert_eq!(index.entries_of(id).len(), m.len());
                prop_assert!(index.count_of(id) <= CAP);
            }
            let live: Vec<InstanceId> = (0..3u64)
                .filter(|i| !model[*i as usize].is_empty())
                .map(InstanceId)
                .collect();
            prop_assert_eq!(index.instances(), live);
            prop_assert_eq!(index.over_cap(), refused);
        }
    }
}
