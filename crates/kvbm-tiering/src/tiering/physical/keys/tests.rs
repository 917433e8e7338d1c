//! `TierKeys` against a plain model: a list of (key, block, readers) whose Ready entries keep
//! their eviction order in a second list.

use proptest::prelude::*;

use super::TierKeys;
use crate::key::OffloadKey;

fn key(i: u8) -> OffloadKey {
    let mut b = [0u8; 36];
    b[0] = i;
    b[35] = i % 3;
    OffloadKey::from_bytes(&b).unwrap()
}

#[derive(Debug, Clone)]
enum Op {
    /// Insert key i (when absent), Ready with block v or Writing.
    Insert(u8, Option<u32>),
    /// Writing or Ready key i gets block v (Ready, newest).
    SetReady(u8, u32),
    Remove(u8),
    Touch(u8),
    Read(u8),
    Unread(u8),
    Clear,
}

fn op() -> impl Strategy<Value = Op> {
    let k = 0u8..12;
    prop_oneof![
        4 => (k.clone(), proptest::option::of(0u32..100)).prop_map(|(k, v)| Op::Insert(k, v)),
        2 => (k.clone(), 0u32..100).prop_map(|(k, v)| Op::SetReady(k, v)),
        2 => k.clone().prop_map(Op::Remove),
        2 => k.clone().prop_map(Op::Touch),
        1 => k.clone().prop_map(Op::Read),
        1 => k.prop_map(Op::Unread),
        1 => Just(Op::Clear),
    ]
}

#[derive(Default)]
struct Model {
    /// (key, block, readers)
    entries: Vec<(u8, Option<u32>, u32)>,
    /// Ready keys, oldest first.
    order: Vec<u8>,
}

impl Model {
    fn pos(&self, k: u8) -> Option<usize> {
        self.entries.iter().position(|e| e.0 == k)
    }
    fn move_to_back(&mut self, k: u8) {
        self.order.retain(|&o| o != k);
        self.order.push(k);
    }
}

proptest! {
    #[test]
    fn tier_keys_match_the_model(ops in proptest::collection::vec(op(), 1..120)) {
        let mut t: TierKeys<u32> = TierKeys::with_capacity(4);
        let mut m = Model::default();
        for op in ops {
            match op {
                Op::Insert(k, v) => {
                    if m.pos(k).is_none() {
                        let n = t.insert(key(k), v);
                        prop_assert_eq!(t.key(n), &key(k));
                        m.entries.push((k, v, 0));
                        if v.is_some() {
                            m.order.push(k);
                        }
                    }
                }
                Op::SetReady(k, v) => {
                    if let Some(p) = m.pos(k) {
                        let n = t.find(&key(k)).unwrap();
                        t.set_ready(n, v);
                        if m.entries[p].1.is_none() {
                            m.order.push(k);
                        }
                        m.entries[p].1 = Some(v);
                    }
                }
                Op::Remove(k) => {
                    if let Some(p) = m.pos(k) {
                        let n = t.find(&key(k)).unwrap();
                        let node = t.remove(n);
                        let (_, block, readers) = m.entries.remove(p);
                        prop_assert_eq!(node.block, block);
                        prop_assert_eq!(node.readers, readers);
                        m.order.retain(|&o| o != k);
                    }
                }
                Op::Touch(k) => {
                    if let Some(p) = m.pos(k) {
                        t.touch(t.find(&key(k)).unwrap());
                        if m.entries[p].1.is_some() {
                            m.move_to_back(k);
                        }
                    }
                }
                Op::Read(k) => {
                    if let Some(p) = m.pos(k) {
                        let n = t.find(&key(k)).unwrap();
                        t.node_mut(n).readers += 1;
                        m.entries[p].2 += 1;
                    }
                }
                Op::Unread(k) => {
                    if let Some(p) = m.pos(k).filter(|&p| m.entries[p].2 > 0) {
                        let n = t.find(&key(k)).unwrap();
                        t.node_mut(n).readers -= 1;
                        m.entries[p].2 -= 1;
                    }
                }
                Op::Clear => {
                    t.clear();
                    m = Model::default();
                }
            }
            // Every key the model knows is found with its state; no other is.
            for i in 0..12u8 {
                match (m.pos(i), t.find(&key(i))) {
                    (Some(p), Some(n)) => {
                        prop_assert_eq!(t.key(n), &key(i));
                        prop_assert_eq!(t.node(n).block, m.entries[p].1);
                        prop_assert_eq!(t.node(n).readers, m.entries[p].2);
                    }
                    (None, None) => {}
                    (want, got) => prop_assert!(false, "key {i}: model {want:?}, tier keys {got:?}"),
                }
            }
            let order: Vec<OffloadKey> = t.ready_order().into_iter().map(|n| *t.key(n)).collect();
            let want: Vec<OffloadKey> = m.order.iter().map(|&k| key(k)).collect();
            prop_assert_eq!(order, want);
            prop_assert_eq!(t.num_ready(), m.order.len());
            let oldest = t.oldest_unread().map(|n| *t.key(n));
            let want = m
                .order
                .iter()
                .find(|&&k| m.entries[m.pos(k).unwrap()].2 == 0)
                .map(|&k| key(k));
            prop_assert_eq!(oldest, want);
        }
    }
}
