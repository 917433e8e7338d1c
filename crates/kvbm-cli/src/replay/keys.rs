//! The replay's blocks as scheduler keys (`--scheduler tiering`).
//!
//! A vLLM scheduler names a block by an [`OffloadKey`]: its block hash (which already chains
//! the prefix) plus the KV-cache group index. The replay's block hash is the chained sequence
//! hash of the request's `hash_ids` ([`super::workload::sequence_hashes`]), so a block's key
//! is those 16 bytes and group 0. From the key, as in every engine tier:
//!
//! ```text
//!  hash_ids ──chain──► SequenceHash s ──► OffloadKey(s bytes ‖ group 0)
//!                                            │
//!                                            ├─► key_digest: 256-bit BLAKE3 ── the block's identity
//!                                            └─► digest_hash(digest): the hash every tier registers it under
//! ```
//!
//! The digest is the identity a block's disk header and object carry once the scheduler stored
//! it (the engine's `complete_store` registers it with the digest, and the lanes write it).
//! A block G4 knows only by name (listed at a warm start, or adopted from another instance's
//! events) is registered without it; the replay then expects the identity its own workload
//! gives the hash ([`identities_of_workload`]), so such a read is still checked against the full digest.

use kvbm_engine::stack::Identities;
use kvbm_logical::{BlockDigest, SequenceHash};
use kvbm_tiering::OffloadKey;
use kvbm_tiering::tiering::{digest_hash, key_digest};

use super::workload::HASH_BLOCK_SIZE;

/// The key of the block whose chained sequence hash is `s`.
pub(crate) fn key_of(s: SequenceHash) -> OffloadKey {
    let mut raw = [0u8; 20];
    raw[..16].copy_from_slice(&s.as_u128().to_le_bytes());
    OffloadKey::from_bytes(&raw).expect("20 bytes is a valid key length")
}

/// A block's key, identity and the hash every tier registers it under.
pub(crate) fn keyed(s: SequenceHash) -> (OffloadKey, BlockDigest, SequenceHash) {
    let key = key_of(s);
    let digest = key_digest(&key);
    let hash = digest_hash(&digest, HASH_BLOCK_SIZE);
    (key, digest, hash)
}

/// Maps a request's chained sequence hashes to keys and tier hashes (`keys` and `hashes` are
/// cleared first).
pub(crate) fn key_request(
    chained: &[SequenceHash],
    keys: &mut Vec<OffloadKey>,
    hashes: &mut Vec<SequenceHash>,
) {
    keys.clear();
    hashes.clear();
    for s in chained {
        let (k, _, h) = keyed(*s);
        keys.push(k);
        hashes.push(h);
    }
}

/// The identity (digest) of every block of `requests` (their `hash_ids`, chained with `salt`),
/// by tier hash: what the stack checks a read of a block registered without its digest
/// against (see [`Identities`]).
pub(crate) fn identities_of_workload<'a>(
    salt: kvbm_logical::Salt,
    requests: impl IntoIterator<Item = &'a [u64]>,
) -> Identities {
    let mut blocks = Vec::new();
    let mut chained = Vec::new();
    for ids in requests {
        super::workload::sequence_hashes(salt, ids, &mut chained);
        blocks.extend(chained.iter().map(|s| {
            let (_, d, h) = keyed(*s);
            (h, d)
        }));
    }
    Identities::new(blocks)
}

#[cfg(test)]
mod tests {
    use kvbm_logical::Salt;
    use kvbm_tiering::tiering::key_hash;

    use super::*;

    #[test]
    fn a_blocks_tier_hash_is_its_keys_hash_and_its_digest_is_recorded() {
        let salt = Salt::new("t");
        let ids: &[u64] = &[1, 2, 3];
        let d = identities_of_workload(salt, [ids]);
        let mut chained = Vec::new();
        super::super::workload::sequence_hashes(salt, ids, &mut chained);
        let (mut keys, mut hashes) = (Vec::new(), Vec::new());
        key_request(&chained, &mut keys, &mut hashes);
        for ((k, h), s) in keys.iter().zip(&hashes).zip(&chained) {
            assert_eq!(*h, key_hash(k, HASH_BLOCK_SIZE), "the engine's key_hash");
            assert_eq!(d.get(*h), Some(key_digest(k)));
            assert_ne!(*h, *s, "tier hashes are not the chained hashes");
        }
        // Distinct prefixes give distinct keys (the chain is in the key).
        assert_eq!(
            hashes
                .iter()
                .collect::<std::collections::HashSet<_>>()
                .len(),
            3
        );
        assert_eq!(
            d.get(chained[0]),
            None,
            "a hash outside the workload has none"
        );
        let other = BlockDigest([7; 32]);
        assert_eq!(d.expected(hashes[0], Some(other)), Some(other));
    }
}
