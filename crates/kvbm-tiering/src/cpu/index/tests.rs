//! [`SlotIndex`] against a `HashMap` model: random inserts, removals, lookups and clears over a
//! slot table whose removed slots are reused with other keys (stale `keys[s]` never matches).

use std::collections::HashMap;

use proptest::prelude::*;

use super::SlotIndex;
use crate::key::OffloadKey;

#[derive(Debug, Clone)]
enum Op {
    Insert(u64),
    Remove(u64),
    /// Removes a resident key by its slot (an eviction's victim), if it is resident.
    RemoveSlot(u64),
    Get(u64),
    Clear,
}

fn op() -> impl Strategy<Value = Op> {
    // A small key space, so inserts meet resident keys and removals meet absent ones.
    prop_oneof![
        6 => (0u64..48).prop_map(Op::Insert),
        3 => (0u64..48).prop_map(Op::Remove),
        3 => (0u64..48).prop_map(Op::RemoveSlot),
        4 => (0u64..64).prop_map(Op::Get),
        1 => Just(Op::Clear),
    ]
}

proptest! {
    #[test]
    fn behaves_as_a_map_over_the_slot_table(ops in proptest::collection::vec(op(), 1..400)) {
        const SLOTS: usize = 32;
        let mut keys = vec![OffloadKey::from_u64(u64::MAX); SLOTS];
        let mut free: Vec<u32> = (0..SLOTS as u32).rev().collect();
        let mut index = SlotIndex::with_capacity(SLOTS);
        let mut model: HashMap<OffloadKey, u32> = HashMap::new();
        for op in ops {
            match op {
                Op::Insert(n) => {
                    let k = OffloadKey::from_u64(n);
                    if model.contains_key(&k) {
                        continue;
                    }
                    let Some(s) = free.pop() else { continue };
                    keys[s as usize] = k;
                    index.insert(&keys, &k, s);
                    model.insert(k, s);
                }
                Op::Remove(n) => {
                    let k = OffloadKey::from_u64(n);
                    let got = index.remove(&keys, &k);
                    prop_assert_eq!(got, model.remove(&k));
                    // The slot goes back with its stale key left in `keys`.
                    free.extend(got);
                }
                Op::RemoveSlot(n) => {
                    let k = OffloadKey::from_u64(n);
                    if let Some(s) = model.remove(&k) {
                        index.remove_slot(&keys, s);
                        free.push(s);
                    }
                }
                Op::Get(n) => {
                    let k = OffloadKey::from_u64(n);
                    prop_assert_eq!(index.get(&keys, &k), model.get(&k).copied());
                    prop_assert_eq!(index.contains(&keys, &k), model.contains_key(&k));
                }
                Op::Clear => {
                    index.clear();
                    model.clear();
                    free = (0..SLOTS as u32).rev().collect();
                }
            }
            prop_assert_eq!(index.len(), model.len());
            prop_assert_eq!(index.is_empty(), model.is_empty());
            let mut slots: Vec<u32> = index.slots().collect();
            let mut want: Vec<u32> = model.values().copied().collect();
            slots.sort_unstable();
            want.sort_unstable();
            prop_assert_eq!(slots, want);
        }
    }
}

#[test]
fn long_keys_of_equal_prefix_are_told_apart() {
    // Keys longer than 16 bytes that differ only in their last byte.
    let a = OffloadKey::from_bytes(&[7u8; 39]).unwrap();
    let mut b_bytes = [7u8; 39];
    b_bytes[38] = 8;
    let b = OffloadKey::from_bytes(&b_bytes).unwrap();
    let keys = vec![a, b];
    let mut index = SlotIndex::with_capacity(2);
    index.insert(&keys, &a, 0);
    assert_eq!(index.get(&keys, &a), Some(0));
    assert_eq!(index.get(&keys, &b), None);
    index.insert(&keys, &b, 1);
    assert_eq!(index.get(&keys, &b), Some(1));
    assert_eq!(index.remove(&keys, &a), Some(0));
    assert_eq!(index.get(&keys, &a), None);
    assert_eq!(index.get(&keys, &b), Some(1));
}
