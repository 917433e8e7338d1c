//! How a block is named in the object tier: its object key, its lock key and the identity its
//! header carries, all derived from the sequence hash.
//!
//! The namespace and, with tensor parallelism, the rank directory are added by
//! [`ObjectStorage`](kvbm_physical::ObjectStorage) to every request, so keys here are relative.

use kvbm_logical::SequenceHash;
use kvbm_physical::{BlockIdentity, ObjectKey};

/// The object key of a block: its sequence hash as 32 hex digits.
pub fn object_key(hash: SequenceHash) -> ObjectKey {
    ObjectKey::from_u128(hash.as_u128())
}

/// The key of a block's offload lock object.
pub fn lock_key(hash: SequenceHash) -> ObjectKey {
    ObjectKey::from(format!("{:032x}.lock", hash.as_u128()))
}

/// The identity written into (and required of) the header of a block's disk slot or object:
/// its sequence hash.
pub fn block_identity(hash: SequenceHash) -> BlockIdentity {
    BlockIdentity::from_u128(hash.as_u128())
}
