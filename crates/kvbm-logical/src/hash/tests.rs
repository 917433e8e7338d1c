//! Tests of sequence hashing.

use super::*;

fn seq(tokens: &[Token], bs: u32, salt: Salt) -> TokenBlockSequence {
    TokenBlockSequence::from_tokens(tokens, bs, salt).unwrap()
}

/// These values are persisted (object keys, events) and compared across processes: they must
/// never change. If this test fails, the hash scheme changed: that is a breaking change.
#[test]
fn golden_values_are_stable() {
    let tokens: Vec<Token> = (0..48).collect();
    let s = seq(&tokens, 16, Salt::new("model-a"));
    let got: Vec<String> = s.hashes().iter().map(|h| h.to_string()).collect();
    assert_eq!(
        got,
        [
            "c84ac2cf9d089cec0000000000000004",
            "638a1740a607cc76c84ac2cf9d000014",
            "8bc72b09b3c6719b638a1740a6000024",
        ]
    );
    assert_eq!(Salt::new("model-a").value(), 0x70913dc5ca09d8b0);
    assert_eq!(
        SequenceHash::root(Salt::NONE, &[7]).to_string(),
        "e3a87ccb76778f900000000000000000"
    );
}

#[test]
fn layout_fields_round_trip() {
    let tokens: Vec<Token> = (0..40).collect();
    let s = seq(&tokens, 8, Salt::NONE);
    let hashes = s.hashes();
    assert_eq!(hashes.len(), 5);
    for (i, h) in hashes.iter().enumerate() {
        assert_eq!(h.position(), i as u32);
        assert_eq!(h.block_size(), 8);
        assert_eq!(SequenceHash::from_u128(h.as_u128()), *h);
    }
    assert_eq!(hashes[0].parent_fragment(), 0);
    for w in hashes.windows(2) {
        assert!(w[1].is_child_of(&w[0]));
        assert!(!w[0].is_child_of(&w[1]));
        assert_eq!(w[1].parent_lineage_key(), Some(w[0].lineage_key()));
    }
    assert_eq!(hashes[0].parent_lineage_key(), None);
    assert!(!hashes[2].is_child_of(&hashes[0]));
}

#[test]
fn equal_prefixes_share_hashes_and_divergence_propagates() {
    let a: Vec<Token> = (0..64).collect();
    let mut b = a.clone();
    b[20] = 999; // inside block 1 (tokens 16..32)
    let ha = seq(&a, 16, Salt::NONE).hashes();
    let hb = seq(&b, 16, Salt::NONE).hashes();
    assert_eq!(ha[0], hb[0]);
    for i in 1..4 {
        assert_ne!(
            ha[i], hb[i],
            "block {i} must differ once the prefix differs"
        );
    }
}

#[test]
fn salts_separate_namespaces() {
    let t: Vec<Token> = (0..32).collect();
    let a = seq(&t, 16, Salt::new("model-a")).hashes();
    let b = seq(&t, 16, Salt::new("model-b")).hashes();
    let none = seq(&t, 16, Salt::NONE).hashes();
    for i in 0..2 {
        assert_ne!(a[i], b[i]);
        assert_ne!(a[i], none[i]);
    }
    assert_eq!(a, seq(&t, 16, Salt::new("model-a")).hashes());
}

#[test]
fn same_tokens_at_other_position_hash_differently() {
    // block [0..4) repeated: the second copy is chained from the first, so it differs
    let t: Vec<Token> = vec![1, 2, 3, 4, 1, 2, 3, 4];
    let h = seq(&t, 4, Salt::NONE).hashes();
    assert_ne!(h[0].current(), h[1].current());
    assert_eq!(h[1].position(), 1);
}

#[test]
fn streaming_equals_bulk() {
    let t: Vec<Token> = (100..(100 + 16 * 5 + 3)).collect();
    let bulk = seq(&t, 16, Salt::new("x"));
    let mut stream = TokenBlockSequence::new(16, Salt::new("x")).unwrap();
    let mut completed = 0;
    for chunk in t.chunks(7) {
        completed += stream.extend(chunk);
    }
    assert_eq!(completed, 5);
    assert_eq!(stream.blocks(), bulk.blocks());
    assert_eq!(stream.tail(), &t[80..]);
    assert_eq!(stream.total_tokens(), t.len());
    let mut one = TokenBlockSequence::new(16, Salt::new("x")).unwrap();
    let pushes: usize = t.iter().filter(|&&tok| one.push(tok)).count();
    assert_eq!(pushes, 5);
    assert_eq!(one.hashes(), bulk.hashes());
    assert_eq!(bulk.blocks()[2].tokens(), &t[32..48]);
    assert_eq!(bulk.blocks()[2].position(), 2);
}

#[test]
fn block_size_validation() {
    for ok in [1, 2, 16, 1024] {
        assert!(validate_block_size(ok).is_ok(), "{ok}");
        assert!(TokenBlockSequence::new(ok, Salt::NONE).is_ok());
    }
    for bad in [0, 3, 12, 2048] {
        assert_eq!(
            validate_block_size(bad),
            Err(LogicalError::InvalidBlockSize { block_size: bad })
        );
        assert!(TokenBlockSequence::new(bad, Salt::NONE).is_err());
    }
}

#[test]
#[should_panic(expected = "parent's block size")]
fn child_with_wrong_length_panics() {
    let root = SequenceHash::root(Salt::NONE, &[1, 2, 3, 4]);
    let _ = root.child(&[1, 2]);
}

#[test]
fn serde_round_trip() {
    let h = SequenceHash::root(Salt::new("s"), &[1, 2]);
    let json = serde_json::to_string(&h).unwrap();
    assert_eq!(serde_json::from_str::<SequenceHash>(&json).unwrap(), h);
}
