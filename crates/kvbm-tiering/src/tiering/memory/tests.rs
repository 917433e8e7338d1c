//! The in-memory tier's key set ([`Held`]): a set, whatever the order and repetition of keys,
//! through its table's growth.

use super::*;

fn key(i: u64) -> OffloadKey {
    OffloadKey::from_u64(i)
}

#[test]
fn holds_each_key_once_and_only_the_keys_given() {
    let mut h = Held::default();
    for i in 0..10_000u64 {
        h.insert(key(i * 3));
        // a key given again (the same store twice, or two stores sharing a prefix)
        h.insert(key(i * 3));
    }
    assert_eq!(h.len(), 10_000);
    for i in 0..30_000u64 {
        assert_eq!(h.contains(&key(i)), i % 3 == 0, "key {i}");
    }
}

#[test]
fn keys_of_every_length_are_told_apart() {
    // Keys equal in their first bytes and differing only in length or group suffix.
    let mut h = Held::default();
    let a = OffloadKey::from_bytes(&[7, 7, 7, 7]).unwrap();
    let b = OffloadKey::from_bytes(&[7, 7, 7, 7, 0]).unwrap();
    let c = make_key(&[1; 32], 0);
    let d = make_key(&[1; 32], 1);
    h.insert(a);
    h.insert(c);
    assert!(h.contains(&a) && h.contains(&c));
    assert!(!h.contains(&b) && !h.contains(&d));
}

fn make_key(hash: &[u8], group: u32) -> OffloadKey {
    crate::key::make_offload_key(hash, group).unwrap()
}

#[test]
fn the_tier_answers_from_its_set() {
    let mut t = InMemoryTier::new(64);
    let ctx = ReqContext::new("r");
    t.insert(key(1));
    assert!(t.contains(&key(1)));
    assert_eq!(t.len(), 1);
    assert_eq!(t.lookup(&key(1), &ctx), LookupResult::Hit);
    assert_eq!(t.lookup(&key(2), &ctx), LookupResult::Miss);
    assert!(InMemoryTier::new(64).is_empty());
}
