//! `OffloadKey`: a block hash plus its 4-byte big-endian KV-cache group index, stored inline.
//!
//! vLLM packs keys as `bytes` (`block_hash ++ group_idx.to_bytes(4, "big")`) to avoid tuple
//! garbage. Here the same bytes live inline in a `Copy` value of 40 bytes (one length byte,
//! up to [`OffloadKey::MAX_LEN`] key bytes), so lookups and map probes never allocate and never
//! chase a pointer. Equality and hashing cover exactly the used bytes, so two keys are equal
//! iff vLLM's `bytes` would be equal.

use std::fmt;
use std::hash::{Hash, Hasher};

/// Key bytes of an unsupported length (the key's own error, so this module needs nothing of
/// the crate's; [`TieringError::InvalidKey`](crate::TieringError::InvalidKey) carries it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("offload key of {len} bytes: keys are 4..={max} bytes (hash + 4-byte group index)")]
pub struct InvalidKey {
    /// Length given.
    pub len: usize,
    /// Longest supported key.
    pub max: usize,
}

/// Identifies an offloaded chunk: block-hash bytes followed by the 4-byte big-endian group index.
// 40 bytes, 8-aligned: equality compares five words (see `words`).
#[derive(Clone, Copy)]
#[repr(C, align(8))]
pub struct OffloadKey {
    bytes: [u8; OffloadKey::MAX_LEN],
    len: u8,
}

const _: () = assert!(std::mem::size_of::<OffloadKey>() == 40);

impl OffloadKey {
    /// Longest key in bytes (hash of up to 35 bytes plus the 4-byte group index).
    pub const MAX_LEN: usize = 39;

    /// The key of a slot that holds none: length 0, so never equal to a key (4 bytes at
    /// least), and it hashes and compares like any other.
    pub(crate) const VACANT: OffloadKey = OffloadKey {
        bytes: [0; Self::MAX_LEN],
        len: 0,
    };

    /// Wraps raw key bytes (already including the group suffix).
    ///
    /// Errors when `raw` is shorter than the 4-byte group suffix or longer than [`Self::MAX_LEN`].
    pub fn from_bytes(raw: &[u8]) -> Result<Self, InvalidKey> {
        if raw.len() < 4 || raw.len() > Self::MAX_LEN {
            return Err(InvalidKey {
                len: raw.len(),
                max: Self::MAX_LEN,
            });
        }
        let n = raw.len();
        let mut bytes = [0u8; Self::MAX_LEN];
        // Two fixed-width copies, the second ending at `n`, cover any length from the width
        // to twice it: constant-size moves where `copy_from_slice` of `n` bytes is a `memcpy`
        // call (a key is read per lookup). Bytes past `n` stay zero (`words`).
        fn two<const W: usize>(dst: &mut [u8; OffloadKey::MAX_LEN], src: &[u8]) {
            let n = src.len();
            dst[..W].copy_from_slice(&src[..W]);
            dst[n - W..n].copy_from_slice(&src[n - W..]);
        }
        match n {
            32.. => two::<32>(&mut bytes, raw),
            16.. => two::<16>(&mut bytes, raw),
            8.. => two::<8>(&mut bytes, raw),
            _ => two::<4>(&mut bytes, raw),
        }
        Ok(Self {
            len: n as u8,
            bytes,
        })
    }

    /// The key's bytes (hash then group index), as vLLM's `bytes` value.
    #[inline]
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }

    /// The whole value as five words (key bytes, zero padding, length).
    #[inline(always)]
    fn words(&self) -> &[u64; 5] {
        // SAFETY: `OffloadKey` is `repr(C, align(8))`, exactly 40 bytes (asserted above), made
        // only of `u8` fields that are always initialised, so it is a valid `[u64; 5]`.
        unsafe { &*(self as *const Self as *const [u64; 5]) }
    }

    /// A key made from a `u64` block-hash id (8-byte big-endian) in group 0, as the replay format does.
    #[inline]
    pub fn from_u64(id: u64) -> Self {
        let mut bytes = [0u8; Self::MAX_LEN];
        bytes[..8].copy_from_slice(&id.to_be_bytes());
        Self { len: 12, bytes }
    }
}

/// Packs a block hash and group index into an [`OffloadKey`] (vLLM `make_offload_key`).
pub fn make_offload_key(block_hash: &[u8], group_idx: u32) -> Result<OffloadKey, InvalidKey> {
    let len = block_hash.len() + 4;
    if len > OffloadKey::MAX_LEN {
        return Err(InvalidKey {
            len,
            max: OffloadKey::MAX_LEN,
        });
    }
    let mut bytes = [0u8; OffloadKey::MAX_LEN];
    bytes[..block_hash.len()].copy_from_slice(block_hash);
    bytes[block_hash.len()..len].copy_from_slice(&group_idx.to_be_bytes());
    Ok(OffloadKey {
        len: len as u8,
        bytes,
    })
}

/// The block hash of a key (vLLM `get_offload_block_hash`).
pub fn get_offload_block_hash(key: &OffloadKey) -> &[u8] {
    let b = key.as_bytes();
    &b[..b.len() - 4]
}

/// The group index of a key (vLLM `get_offload_group_idx`).
pub fn get_offload_group_idx(key: &OffloadKey) -> u32 {
    let b = key.as_bytes();
    let n = b.len();
    u32::from_be_bytes([b[n - 4], b[n - 3], b[n - 2], b[n - 1]])
}

impl PartialEq for OffloadKey {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        // Unused bytes are always zero, so comparing the five words (length included) is exact.
        // Written out: `[u64; 5] == [u64; 5]` compiles to a `memcmp` call.
        let (a, b) = (self.words(), other.words());
        ((a[0] ^ b[0]) | (a[1] ^ b[1]) | (a[2] ^ b[2]) | (a[3] ^ b[3]) | (a[4] ^ b[4])) == 0
    }
}
impl Eq for OffloadKey {}

impl Hash for OffloadKey {
    #[inline]
    fn hash<H: Hasher>(&self, state: &mut H) {
        // Unused bytes are always zero, so hashing whole words is equal-consistent; short keys
        // (≤ 16 bytes, e.g. u64 ids) hash two words plus the length word.
        let w = self.words();
        state.write_u64(w[0]);
        state.write_u64(w[1]);
        if self.len > 16 {
            state.write_u64(w[2]);
            state.write_u64(w[3]);
        }
        state.write_u64(w[4]);
    }
}

/// A seeded hash of whole keys for the CPU manager's per-key tables (its slot index, a
/// request's flags), which probe several times per chunk per step.
///
/// Four folded multiplies over the key's five words (unused bytes are zero, so equal keys hash
/// equal), inlined where the table probes: `Hash` through a general `Hasher` was a call and a
/// state machine per probe. The seeds are drawn from hashbrown's randomly seeded default
/// hasher when the table is made, so the hash is keyed per table, as foldhash's (on which this
/// is modelled) is: keys chosen to collide in one process do not in another.
#[derive(Clone)]
pub(crate) struct KeyHasher {
    seeds: [u64; 7],
}

impl Default for KeyHasher {
    fn default() -> Self {
        use std::hash::BuildHasher;
        let random = hashbrown::DefaultHashBuilder::default();
        Self {
            seeds: std::array::from_fn(|i| random.hash_one(i as u64) | 1),
        }
    }
}

impl KeyHasher {
    #[inline(always)]
    pub(crate) fn hash(&self, k: &OffloadKey) -> u64 {
        #[inline(always)]
        fn fold(a: u64, b: u64) -> u64 {
            let p = (a as u128).wrapping_mul(b as u128);
            (p as u64) ^ ((p >> 64) as u64)
        }
        let (w, s) = (k.words(), &self.seeds);
        let a = fold(w[0] ^ s[0], w[1] ^ s[1]);
        let b = fold(w[2] ^ s[2], w[3] ^ s[3]);
        let c = fold(w[4] ^ s[4], a ^ s[5]);
        fold(b ^ c, s[6])
    }
}

impl fmt::Debug for OffloadKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OffloadKey(")?;
        for b in self.as_bytes() {
            write!(f, "{b:02x}")?;
        }
        write!(f, ")")
    }
}

impl fmt::Display for OffloadKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.as_bytes();
        if b.len() == 12 && b[8..] == [0, 0, 0, 0] {
            let id = u64::from_be_bytes(b[..8].try_into().expect("8 bytes"));
            return write!(f, "{id}");
        }
        for x in b {
            write!(f, "{x:02x}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_and_unpack_like_vllm() {
        let k = make_offload_key(b"abcdefgh", 7).unwrap();
        assert_eq!(k.as_bytes(), b"abcdefgh\0\0\0\x07");
        assert_eq!(get_offload_block_hash(&k), b"abcdefgh");
        assert_eq!(get_offload_group_idx(&k), 7);
        assert_eq!(
            OffloadKey::from_u64(5),
            make_offload_key(&5u64.to_be_bytes(), 0).unwrap()
        );
        assert!(make_offload_key(&[0u8; 36], 0).is_err());
        assert!(OffloadKey::from_bytes(&[1, 2]).is_err());
        let a = OffloadKey::from_bytes(&[1, 2, 3, 4, 0]).unwrap();
        let b = OffloadKey::from_bytes(&[1, 2, 3, 4]).unwrap();
        assert_ne!(a, b);
    }

    #[test]
    fn from_bytes_reads_every_length_exactly() {
        // Each width's two copies, at both ends of its range: the bytes read back, nothing
        // past the length set (equal to the packed key), and one length too long refused.
        for n in 4..=OffloadKey::MAX_LEN {
            let raw: Vec<u8> = (1..=n as u8).collect();
            let k = OffloadKey::from_bytes(&raw).unwrap();
            assert_eq!(k.as_bytes(), &raw[..], "length {n}");
            let packed = make_offload_key(
                &raw[..n - 4],
                u32::from_be_bytes(raw[n - 4..].try_into().unwrap()),
            )
            .unwrap();
            assert_eq!(k, packed, "length {n}");
            assert!(k.bytes[n..].iter().all(|&b| b == 0), "length {n}");
        }
        assert!(OffloadKey::from_bytes(&[7; OffloadKey::MAX_LEN + 1]).is_err());
        assert!(OffloadKey::from_bytes(&[7; 3]).is_err());
    }

    #[test]
    fn key_hash_is_equal_for_equal_keys_and_spreads_near_ones() {
        let h = KeyHasher::default();
        let a = make_offload_key(b"block-1", 0).unwrap();
        assert_eq!(
            h.hash(&a),
            h.hash(&make_offload_key(b"block-1", 0).unwrap())
        );
        // Keys one bit apart, in every byte of every length class: their hashes differ, and
        // the top 7 bits (hashbrown's tag) and low bits (its bucket) both vary across them.
        let mut hashes = std::collections::HashSet::new();
        let (mut tags, mut lows) = (
            std::collections::HashSet::new(),
            std::collections::HashSet::new(),
        );
        for n in [4usize, 12, 20, 36, 39] {
            for byte in 0..n {
                for bit in 0..8 {
                    let mut raw = vec![0x5au8; n];
                    raw[byte] ^= 1 << bit;
                    let x = h.hash(&OffloadKey::from_bytes(&raw).unwrap());
                    assert!(
                        hashes.insert(x),
                        "length {n}, byte {byte}, bit {bit} collides"
                    );
                    tags.insert(x >> 57);
                    lows.insert(x & 0xff);
                }
            }
        }
        assert!(
            tags.len() > 100 && lows.len() > 200,
            "{} tags, {} low bytes",
            tags.len(),
            lows.len()
        );
        // Another table's hasher keys differently.
        assert_ne!(h.hash(&a), KeyHasher::default().hash(&a));
    }
}
