//! What a stored block claims to be: its [`BlockIdentity`] and the binding of where it was
//! written.
//!
//! A block leaving the process is only served back if it proves it is the block asked for. Its
//! header (see [`crate::checksum`]) carries two values besides the checksum:
//!
//! * the **block identity**: opaque bytes chosen by the caller, normally the block's sequence
//!   hash (this crate does not depend on `kvbm-logical`, so it never interprets them). A read
//!   names the identity it expects; a slot or object holding another block is an
//!   [`IdentityMismatch`](crate::PhysicalError::IdentityMismatch), even when its checksum is
//!   valid. Transfers that give no identities use [`BlockIdentity::ANONYMOUS`] on both sides, so
//!   an anonymous read never accepts a block written with an identity;
//! * the **binding**: for a disk slot, the per-file id drawn when the file was opened (a slot
//!   written by another file instance, or before a restart, is foreign); for an object, a
//!   digest of the namespace, the key, the tensor-parallel rank and world size and the
//!   [`ModelFingerprint`] when there is one ([`ObjectBinding`]), so an object copied to
//!   another key, under another namespace or fingerprint, or read by another rank is foreign. An object header also records its layout geometry
//!   ([`geometry_digest`], in the header's slot field), so a block written as 2 layers × 2048
//!   never reads back as 4 × 1024.

use crate::fingerprint::ModelFingerprint;
use crate::layout::LayoutConfig;

/// Encoded length of a [`BlockIdentity`].
pub const IDENTITY_LEN: usize = 32;

/// The caller's name for a block's content (a sequence hash, up to 256 bits), stored in its
/// header and checked on every read.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct BlockIdentity([u8; IDENTITY_LEN]);

impl BlockIdentity {
    /// The identity of transfers that give none (all zero bytes).
    pub const ANONYMOUS: BlockIdentity = BlockIdentity([0; IDENTITY_LEN]);

    /// An identity from 32 bytes (e.g. a BLAKE3 sequence hash).
    pub const fn from_bytes(bytes: [u8; IDENTITY_LEN]) -> Self {
        BlockIdentity(bytes)
    }

    /// An identity from a 128-bit hash (little-endian, zero-extended).
    pub fn from_u128(v: u128) -> Self {
        let mut b = [0u8; IDENTITY_LEN];
        b[..16].copy_from_slice(&v.to_le_bytes());
        BlockIdentity(b)
    }

    /// An identity from up to 32 bytes (zero-extended). `None` when `bytes` is longer.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        if bytes.len() > IDENTITY_LEN {
            return None;
        }
        let mut b = [0u8; IDENTITY_LEN];
        b[..bytes.len()].copy_from_slice(bytes);
        Some(BlockIdentity(b))
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8; IDENTITY_LEN] {
        &self.0
    }

    /// Lowercase hex of the bytes (for errors and logs).
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl From<u128> for BlockIdentity {
    fn from(v: u128) -> Self {
        BlockIdentity::from_u128(v)
    }
}

impl std::fmt::Debug for BlockIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BlockIdentity({})", self.to_hex())
    }
}

/// A 64-bit digest of a block geometry (every field but the block count), never zero.
pub fn geometry_digest(g: &LayoutConfig) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(b"kvbm-geometry-v1");
    for v in [
        g.num_layers,
        g.outer_dim,
        g.page_size,
        g.inner_dim,
        g.dtype_bytes,
    ] {
        h.update(&(v as u64).to_le_bytes());
    }
    h.digest().max(1)
}

/// [`geometry_digest`] scoped by `scope`, the 64-bit form of a model fingerprint
/// ([`ModelFingerprint::short`]; 0: unscoped, the plain geometry digest). Peers that compare
/// geometry values (the data plane's requests and frames) then also refuse one another's
/// blocks when their fingerprints differ. Never zero.
pub fn scoped_geometry_digest(g: &LayoutConfig, scope: u64) -> u64 {
    let plain = geometry_digest(g);
    if scope == 0 {
        return plain;
    }
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(b"kvbm-geometry-scope-v1");
    h.update(&plain.to_le_bytes());
    h.update(&scope.to_le_bytes());
    h.digest().max(1)
}

/// Where an object is, besides its identity: namespace, key, tensor-parallel rank, and the
/// fingerprint of the model it belongs to.
#[derive(Debug, Clone, Copy)]
pub struct ObjectBinding<'a> {
    /// The storage's namespace (key prefix).
    pub namespace: &'a str,
    /// The object key (without namespace).
    pub key: &'a str,
    /// Tensor-parallel rank of the writer.
    pub rank: usize,
    /// Tensor-parallel world size.
    pub world_size: usize,
    /// The storage's model fingerprint (none: an unscoped storage; its digest is then the
    /// one before fingerprints).
    pub fingerprint: Option<&'a ModelFingerprint>,
}

impl ObjectBinding<'_> {
    /// The 128-bit digest stored in the header: xxh3-128 over a length-prefixed encoding of
    /// every field (not a MAC: it detects misplaced objects, not forged ones).
    pub fn digest(&self) -> u128 {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(b"kvbm-object-binding-v1");
        for s in [self.namespace, self.key] {
            h.update(&(s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        }
        for v in [self.rank, self.world_size] {
            h.update(&(v as u64).to_le_bytes());
        }
        if let Some(fp) = self.fingerprint {
            h.update(b"fp");
            h.update(fp.as_bytes());
        }
        h.digest128()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry(layers: usize, inner: usize) -> LayoutConfig {
        LayoutConfig {
            num_blocks: 1,
            num_layers: layers,
            outer_dim: 2,
            page_size: 16,
            inner_dim: inner,
            dtype_bytes: 2,
        }
    }

    #[test]
    fn binding_digest_separates_every_field() {
        let g = geometry(2, 2048);
        let g2 = geometry(4, 1024);
        assert_eq!(g.block_bytes(), g2.block_bytes());
        assert_ne!(geometry_digest(&g), geometry_digest(&g2));
        assert_eq!(
            geometry_digest(&g),
            geometry_digest(&LayoutConfig { num_blocks: 9, ..g })
        );
        assert_eq!(scoped_geometry_digest(&g, 0), geometry_digest(&g));
        assert_ne!(scoped_geometry_digest(&g, 1), geometry_digest(&g));
        assert_ne!(scoped_geometry_digest(&g, 1), scoped_geometry_digest(&g, 2));
        assert_ne!(
            scoped_geometry_digest(&g, 1),
            scoped_geometry_digest(&g2, 1)
        );
        let base = ObjectBinding {
            namespace: "ns",
            key: "k",
            rank: 0,
            world_size: 1,
            fingerprint: None,
        };
        let d = base.digest();
        let fp = |model: &str| {
            ModelFingerprint::builder()
                .model(model)
                .dtype("bfloat16")
                .kv_layout("NHD")
                .geometry(g)
                .parallelism(crate::fingerprint::Parallelism::Rank { rank: 0, world: 1 })
                .build()
                .unwrap()
        };
        let (fa, fb) = (fp("a"), fp("b"));
        let variants = [
            ObjectBinding {
                namespace: "ns2",
                ..base
            },
            ObjectBinding { key: "k2", ..base },
            ObjectBinding {
                fingerprint: Some(&fa),
                ..base
            },
            ObjectBinding {
                rank: 1,
                world_size: 2,
                ..base
            },
            ObjectBinding {
                world_size: 2,
                ..base
            },
            // Field boundaries are length-prefixed: "n"+"sk" differs from "ns"+"k".
            ObjectBinding {
                namespace: "n",
                key: "sk",
                ..base
            },
        ];
        for v in variants {
            assert_ne!(v.digest(), d, "{v:?}");
        }
        let scoped = |f| ObjectBinding {
            fingerprint: Some(f),
            ..base
        };
        assert_ne!(scoped(&fa).digest(), scoped(&fb).digest());
        assert_eq!(scoped(&fa).digest(), scoped(&fp("a")).digest());
        assert_eq!(base.digest(), d);
    }

    #[test]
    fn identity_encodings() {
        assert_eq!(BlockIdentity::from_u128(0), BlockIdentity::ANONYMOUS);
        let a = BlockIdentity::from_u128(0xabc);
        assert_eq!(BlockIdentity::from_slice(&0xabcu128.to_le_bytes()), Some(a));
        assert!(BlockIdentity::from_slice(&[0u8; 33]).is_none());
        assert!(a.to_hex().starts_with("bc0a"));
    }
}
