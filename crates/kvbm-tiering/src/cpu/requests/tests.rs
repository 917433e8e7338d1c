//! [`Requests`] against a model keyed by request id (what the manager kept before): random
//! accesses, finishes and resets over a few request ids and several contexts per id, in any
//! interleaving. The remembered last record and the recycled records must never change what a
//! context sees.

use std::collections::HashMap as StdHashMap;

use proptest::prelude::*;

use super::*;

/// The model: per request id, the uid of the context that owns the record and its keys.
#[derive(Default)]
struct Model {
    by_id: StdHashMap<String, (u64, Vec<OffloadKey>)>,
}

impl Model {
    fn access(&mut self, ctx: &ReqContext) -> &mut Vec<OffloadKey> {
        let e = self
            .by_id
            .entry(ctx.req_id().to_string())
            .or_insert((ctx.uid(), Vec::new()));
        if e.0 != ctx.uid() {
            *e = (ctx.uid(), Vec::new());
        }
        &mut e.1
    }

    fn take(&mut self, ctx: &ReqContext) -> Option<Vec<OffloadKey>> {
        match self.by_id.get(ctx.req_id()) {
            Some((uid, _)) if *uid == ctx.uid() => self.by_id.remove(ctx.req_id()).map(|e| e.1),
            _ => None,
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// Context `c` records key `k` (and flags it).
    Access(usize, u64),
    /// Context `c` reads its record.
    Get(usize),
    /// Context `c` finishes; the record is recycled.
    Finish(usize),
    /// A new context replaces context `c` (same request id, new uid).
    Renew(usize),
    /// `reset_cache`.
    Clear,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..6usize, 0..8u64).prop_map(|(c, k)| Op::Access(c, k)),
        3 => (0..6usize).prop_map(Op::Get),
        2 => (0..6usize).prop_map(Op::Finish),
        1 => (0..6usize).prop_map(Op::Renew),
        1 => Just(Op::Clear),
    ]
}

proptest! {
    #[test]
    fn requests_answer_as_a_map_by_request_id(ops in prop::collection::vec(op(), 1..200)) {
        // Six contexts over three request ids: two contexts share each id.
        let mut ctxs: Vec<ReqContext> =
            (0..6).map(|i| ReqContext::new(format!("r{}", i % 3))).collect();
        let mut t = Requests::default();
        let mut m = Model::default();
        for op in ops {
            match op {
                Op::Access(c, k) => {
                    let key = OffloadKey::from_u64(k);
                    let r = t.access(&ctxs[c]);
                    prop_assert_eq!(r.ctx_uid, ctxs[c].uid());
                    if r.flags_of(&key) == 0 {
                        r.set(key, 1);
                        r.order.push(key);
                    }
                    let keys = m.access(&ctxs[c]);
                    if !keys.contains(&key) {
                        keys.push(key);
                    }
                }
                Op::Get(c) => {
                    let ours = t.get(&ctxs[c]).map(|r| r.order.clone());
                    let theirs = match m.by_id.get(ctxs[c].req_id()) {
                        Some((uid, keys)) if *uid == ctxs[c].uid() => Some(keys.clone()),
                        _ => None,
                    };
                    prop_assert_eq!(ours, theirs);
                }
                Op::Finish(c) => {
                    let ours = t.take(&ctxs[c]);
                    let theirs = m.take(&ctxs[c]);
                    prop_assert_eq!(ours.as_ref().map(|r| r.order.clone()), theirs);
                    if let Some(r) = ours {
                        prop_assert_eq!(r.num_flagged(), r.order.len());
                        t.recycle(r);
                    }
                }
                Op::Renew(c) => ctxs[c] = ReqContext::new(ctxs[c].req_id()),
                Op::Clear => {
                    t.clear();
                    m.by_id.clear();
                }
            }
            prop_assert_eq!(t.len(), m.by_id.len());
        }
    }
}

#[test]
fn a_recycled_record_starts_empty_and_keeps_its_capacity() {
    let mut t = Requests::default();
    let a = ReqContext::new("a");
    let r = t.access(&a);
    for k in 0..64 {
        r.set(OffloadKey::from_u64(k), 3);
        r.order.push(OffloadKey::from_u64(k));
    }
    r.req_rank = Some(7);
    let cap = r.flags.capacity();
    let done = t.take(&a).expect("a's record");
    t.recycle(done);
    let b = ReqContext::new("b");
    let r = t.access(&b);
    assert!(r.flags.is_empty() && r.order.is_empty() && r.req_rank.is_none());
    assert_eq!(r.ctx_uid, b.uid());
    assert_eq!(r.flags.capacity(), cap, "the spare record's map was reused");
    assert!(t.get(&a).is_none(), "a finished context has no record");
}

#[test]
fn a_large_record_is_not_kept() {
    let mut t = Requests::default();
    let a = ReqContext::new("a");
    let r = t.access(&a);
    for k in 0..(MAX_SPARE_KEYS as u64 + 1) {
        r.set(OffloadKey::from_u64(k), 1);
    }
    let done = t.take(&a).expect("a's record");
    t.recycle(done);
    let r = t.access(&ReqContext::new("b"));
    assert!(
        r.flags.capacity() < MAX_SPARE_KEYS,
        "a fresh map, not the large one"
    );
}

#[test]
fn a_freed_slot_reused_by_another_request_is_not_the_last_contexts() {
    let mut t = Requests::default();
    let a = ReqContext::new("a");
    t.access(&a).order.push(OffloadKey::from_u64(1));
    t.take(&a).expect("a's record");
    assert!(
        t.get(&a).is_none(),
        "the remembered (uid, slot) of a finished context"
    );
    // `b` takes a's slot; `a`'s remembered (uid, slot) must not reach b's record.
    let b = ReqContext::new("b");
    t.access(&b).order.push(OffloadKey::from_u64(2));
    assert!(t.get(&a).is_none());
    let r = t.access(&a);
    assert!(r.order.is_empty(), "a starts afresh");
    assert_eq!(
        t.get(&b).map(|r| r.order.clone()),
        Some(vec![OffloadKey::from_u64(2)])
    );
}

#[test]
fn a_keys_place_reaches_its_flags_while_the_table_has_room() {
    let mut t = Requests::default();
    let a = ReqContext::new("a");
    let r = t.access(&a);
    let keys: Vec<OffloadKey> = (0..100).map(OffloadKey::from_u64).collect();
    assert_eq!(r.flags_of(&keys[0]), 0, "a key without flags");
    r.reserve(keys.len());
    let places: Vec<usize> = keys.iter().map(|&k| r.place(k)).collect();
    for (i, &p) in places.iter().enumerate() {
        *r.at(p) |= (i % 8) as u8 + 1;
    }
    assert_eq!(r.place(keys[7]), places[7], "the same key, the same place");
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(r.flags_of(k), (i % 8) as u8 + 1, "each key's own flags");
    }
    assert_eq!(
        r.num_flagged(),
        keys.len(),
        "a key once, however often it is placed"
    );
    r.set(keys[3], 8);
    assert_eq!(r.flags_of(&keys[3]), 4 | 8);
    let done = t.take(&a).expect("a's record");
    t.recycle(done);
    let r = t.access(&ReqContext::new("b"));
    assert_eq!(r.flags_of(&keys[3]), 0, "a restarted record has no flags");
}
