//! How a block is named in the tiers that leave the process: its object key and lock key
//! (derived from the sequence hash) and the identity its disk slot or object header carries
//! ([`identity_of`]: the block's 256-bit BLAKE3 digest when it has one, else its sequence hash).
//!
//! Keys stay derived from the 128-bit [`SequenceHash`], whose chain value is only 64 bits, so
//! two blocks may share a key; the header identity is what tells them apart: a read or presence
//! probe names the full digest it expects, and a slot or object written for another block is an
//! identity mismatch, never served (and, for objects, counted absent and rewritten).
//!
//! The namespace and, with tensor parallelism, the rank directory are added by
//! [`ObjectStorage`](kvbm_physical::ObjectStorage) to every request, so keys here are relative.

use kvbm_logical::{BlockDigest, SequenceHash};
use kvbm_physical::{BlockIdentity, ObjectKey};

/// The object key of a block: its sequence hash as 32 hex digits.
pub fn object_key(hash: SequenceHash) -> ObjectKey {
    ObjectKey::from_u128(hash.as_u128())
}

/// The key of a block's offload lock object.
pub fn lock_key(hash: SequenceHash) -> ObjectKey {
    ObjectKey::from(format!("{:032x}.lock", hash.as_u128()))
}

/// The identity of a block that has no digest (an `xxh3` sequence): its 128-bit sequence hash.
pub fn block_identity(hash: SequenceHash) -> BlockIdentity {
    BlockIdentity::from_u128(hash.as_u128())
}

/// The identity written into (and required of) the header of a block's disk slot or object:
/// the block's full 256-bit BLAKE3 digest when it has one
/// ([`HashAlgorithm::Blake3`](kvbm_logical::HashAlgorithm::Blake3)), else its sequence hash
/// ([`block_identity`]).
pub fn identity_of(hash: SequenceHash, digest: Option<BlockDigest>) -> BlockIdentity {
    match digest {
        Some(d) => BlockIdentity::from_bytes(d.0),
        None => block_identity(hash),
    }
}

/// What an object's header identity says of the block named `hash`: its digest (`Some(None)`:
/// the block has none, the identity is the hash itself), or `None` when the identity is not
/// `hash`'s — a 256-bit digest names `hash` only when its first 8 bytes are `hash`'s chain
/// value ([`SequenceHash::current`], how a BLAKE3 sequence derives its hashes).
///
/// A reader that knows a block only by name (adopted from another instance's event or a
/// presence check) registers it with what this returns, so the digest travels with the
/// block; it cannot tell two blocks whose 64-bit chain values collide (only a requester that
/// holds the digest can), which is no weaker than the name it was given.
pub fn digest_named(hash: SequenceHash, identity: &BlockIdentity) -> Option<Option<BlockDigest>> {
    if *identity == block_identity(hash) {
        return Some(None);
    }
    let bytes = *identity.as_bytes();
    let current = u64::from_be_bytes(bytes[..8].try_into().expect("8 bytes"));
    (current == hash.current()).then_some(Some(BlockDigest(bytes)))
}
