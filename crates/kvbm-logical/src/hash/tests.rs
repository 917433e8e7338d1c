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
        completed += stream.extend(chunk).unwrap();
    }
    assert_eq!(completed, 5);
    assert_eq!(stream.blocks(), bulk.blocks());
    assert_eq!(stream.tail(), &t[80..]);
    assert_eq!(stream.total_tokens(), t.len());
    let mut one = TokenBlockSequence::new(16, Salt::new("x")).unwrap();
    let pushes: usize = t.iter().filter(|&&tok| one.push(tok).unwrap()).count();
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

/// BLAKE3 identities are persisted like xxh3 ones: pinned here. If this fails, the scheme
/// changed: that is a breaking change of every G3/G4 key and header.
#[test]
fn blake3_golden_values_are_stable() {
    let tokens: Vec<Token> = (0..48).collect();
    let s = TokenBlockSequence::from_tokens_with(
        &tokens,
        16,
        Salt::new("model-a"),
        HashAlgorithm::Blake3,
    )
    .unwrap();
    let got: Vec<String> = s.hashes().iter().map(|h| h.to_string()).collect();
    let digests: Vec<String> = s
        .blocks()
        .iter()
        .map(|b| b.digest().unwrap().to_string())
        .collect();
    assert_eq!(got, BLAKE3_HASHES);
    assert_eq!(digests, BLAKE3_DIGESTS);
    // the layout fields work as for xxh3
    let h = s.hashes();
    assert_eq!(h[2].position(), 2);
    assert!(h[1].is_child_of(&h[0]));
    assert_eq!(
        s.blocks()[0].digest().unwrap().as_u128() >> 64,
        h[0].current() as u128
    );
    // xxh3 sequences carry no digest, and the two algorithms never agree
    let x = seq(&tokens, 16, Salt::new("model-a"));
    assert!(x.blocks()[0].digest().is_none());
    assert_ne!(x.hashes(), s.hashes());
}

const BLAKE3_HASHES: [&str; 3] = [
    "feace31cd19d41390000000000000004",
    "1d1d651ba8e7cd1afeace31cd1000014",
    "b0f6267741195dfe1d1d651ba8000024",
];
const BLAKE3_DIGESTS: [&str; 3] = [
    "feace31cd19d41391ecbf14cb05ed21e5d565954d0391f8a02b87e46b80fd244",
    "1d1d651ba8e7cd1a69192b69c0f077e599342d02fdccf035ae8603cc28622e11",
    "b0f6267741195dfe2e4fb1c7ac3de84d559afc54907455d6174b56be56020614",
];

#[test]
fn blake3_chains_over_the_full_digest_and_the_salt() {
    let a: Vec<Token> = (0..64).collect();
    let mut b = a.clone();
    b[20] = 999;
    let alg = HashAlgorithm::Blake3;
    let sa = TokenBlockSequence::from_tokens_with(&a, 16, Salt::NONE, alg).unwrap();
    let sb = TokenBlockSequence::from_tokens_with(&b, 16, Salt::NONE, alg).unwrap();
    assert_eq!(sa.blocks()[0].digest(), sb.blocks()[0].digest());
    for i in 1..4 {
        assert_ne!(
            sa.blocks()[i].digest(),
            sb.blocks()[i].digest(),
            "block {i}"
        );
    }
    let salted = TokenBlockSequence::from_tokens_with(&a, 16, Salt::new("tenant-b"), alg).unwrap();
    assert_ne!(salted.blocks()[0].digest(), sa.blocks()[0].digest());
    // streaming gives the same identities
    let mut st = TokenBlockSequence::with_algorithm(16, Salt::NONE, alg).unwrap();
    for chunk in a.chunks(7) {
        st.extend(chunk).unwrap();
    }
    assert_eq!(st.hashes(), sa.hashes());
    assert_eq!(st.algorithm(), alg);
}

#[test]
fn fail_closed_extend_past_max_position() {
    // block size 1: one block per token; fill to the last position, then one more
    let max_blocks = MAX_POSITION as usize + 1;
    let mut s = TokenBlockSequence::new(1, Salt::NONE).unwrap();
    let tokens: Vec<Token> = (0..max_blocks as u32).collect();
    assert_eq!(s.extend(&tokens).unwrap(), max_blocks);
    let before = s.hashes().len();
    let err = s.extend(&[1, 2]).unwrap_err();
    assert_eq!(
        err,
        LogicalError::SequenceTooLong {
            blocks: max_blocks + 2,
            max_blocks
        }
    );
    assert_eq!(s.hashes().len(), before, "a failed extend changes nothing");
    assert!(s.tail().is_empty());
    assert!(s.push(7).is_err());
    // a partial tail past the end is still fine with a larger block size
    let mut s = TokenBlockSequence::new(2, Salt::NONE).unwrap();
    let tokens: Vec<Token> = vec![0; 2 * max_blocks];
    assert_eq!(s.extend(&tokens).unwrap(), max_blocks);
    assert_eq!(
        s.extend(&[5]).unwrap(),
        0,
        "an incomplete block needs no position"
    );
    assert!(s.extend(&[6]).is_err());
    assert_eq!(s.tail(), &[5], "unchanged after the error");
    assert!(TokenBlockSequence::from_tokens(&vec![0; max_blocks + 1], 1, Salt::NONE).is_err());
}
