//! Block checksums and the small header stored with every block that leaves the process.
//!
//! A block written to disk or to an object store carries a [`BlockHeader`]: a magic number, a
//! format version, the payload length, the slot index (disk), the xxh3-128 checksum of the
//! payload, the block's [`BlockIdentity`] and a 128-bit binding (the disk file's id, or the
//! object's [`ObjectBinding`](crate::ObjectBinding) digest; see [`crate::identity`]). Readers
//! check every field ([`BlockHeader::expect_bound`]) and then the checksum; anything off is that
//! block's error, never silently accepted.
//!
//! Encoding (little-endian), [`HEADER_LEN`] bytes:
//!
//! ```text
//!  0 magic "KVBMBLK1" | 8 version (2) | 12 reserved | 16 len | 24 slot | 32 checksum (16)
//! 48 identity (32)    | 80 binding (16)
//! ```
//!
//! * disk: the header sits in the 4 KiB sector right after the (4 KiB-rounded) payload, so one
//!   vectored O_DIRECT write stores both;
//! * objects: the header is the first [`HEADER_LEN`] bytes of the body, so a truncated object
//!   shows up as a short read.
//!
//! # The checksum
//!
//! Every payload checksum in the workspace (disk and object headers, the G3 journal, the data
//! plane's frames, the tiering manager's tiers) is xxh3-128 computed here, by [`checksum`],
//! [`checksum_slices`] or a streaming [`Checksummer`]: one function, so a checksum written by
//! one path verifies on every other. It is computed with the SIMD the CPU has, chosen at run
//! time (AVX2 on x86-64 where present): on the data plane it is the largest cost after the
//! kernel's copies, and a build for the baseline x86-64 target would use SSE2 only. The value
//! is the standard xxh3-128 (the tests cross-check it against a second implementation), so
//! headers written before this choice still verify.

use crate::error::{PhysicalError, Result};
use crate::identity::{BlockIdentity, IDENTITY_LEN};

/// Encoded header length in bytes.
pub const HEADER_LEN: usize = 96;
const MAGIC: u64 = u64::from_le_bytes(*b"KVBMBLK1");
const VERSION: u32 = 2;

/// The metadata stored with each block outside the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHeader {
    /// Payload length in bytes.
    pub len: u64,
    /// Slot (disk) or position tag; 0 for objects.
    pub slot: u64,
    /// xxh3-128 of the payload.
    pub checksum: u128,
    /// The block's identity ([`BlockIdentity::ANONYMOUS`] when the writer gave none).
    pub identity: BlockIdentity,
    /// Where it was written: the disk file id, or the object binding digest.
    pub binding: u128,
}

impl BlockHeader {
    /// Encodes into `out` (at least [`HEADER_LEN`] bytes).
    pub fn encode(&self, out: &mut [u8]) {
        out[0..8].copy_from_slice(&MAGIC.to_le_bytes());
        out[8..12].copy_from_slice(&VERSION.to_le_bytes());
        out[12..16].copy_from_slice(&0u32.to_le_bytes());
        out[16..24].copy_from_slice(&self.len.to_le_bytes());
        out[24..32].copy_from_slice(&self.slot.to_le_bytes());
        out[32..48].copy_from_slice(&self.checksum.to_le_bytes());
        out[48..48 + IDENTITY_LEN].copy_from_slice(self.identity.as_bytes());
        out[80..96].copy_from_slice(&self.binding.to_le_bytes());
    }

    /// Encodes into a fresh array.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        self.encode(&mut out);
        out
    }

    /// Decodes and validates magic, version and the zero reserved field, so a header decodes
    /// only from the exact bytes [`encode`](Self::encode) writes for it. An all-zero header (a
    /// slot never written) is [`PhysicalError::NotFound`].
    pub fn decode(bytes: &[u8], location: &dyn Fn() -> String) -> Result<Self> {
        if bytes.len() < HEADER_LEN {
            return Err(PhysicalError::ShortRead {
                location: location(),
                expected: HEADER_LEN,
                actual: bytes.len(),
            });
        }
        let u64_at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
        let magic = u64_at(0);
        if magic == 0 && bytes[..HEADER_LEN].iter().all(|b| *b == 0) {
            return Err(PhysicalError::NotFound {
                location: location(),
            });
        }
        if magic != MAGIC {
            return Err(PhysicalError::CorruptHeader {
                location: location(),
                reason: format!("bad magic {magic:#018x}"),
            });
        }
        let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
        if version != VERSION {
            return Err(PhysicalError::CorruptHeader {
                location: location(),
                reason: format!("unknown version {version}"),
            });
        }
        let reserved = u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes"));
        if reserved != 0 {
            // Every writer stores zero here: anything else is damage (or a format this reader
            // does not know), and decoding must not accept two byte strings as one header.
            return Err(PhysicalError::CorruptHeader {
                location: location(),
                reason: format!("reserved field {reserved:#010x} is not zero"),
            });
        }
        Ok(BlockHeader {
            len: u64_at(16),
            slot: u64_at(24),
            checksum: u128::from_le_bytes(bytes[32..48].try_into().expect("16 bytes")),
            identity: BlockIdentity::from_bytes(
                bytes[48..48 + IDENTITY_LEN].try_into().expect("32 bytes"),
            ),
            binding: u128::from_le_bytes(bytes[80..96].try_into().expect("16 bytes")),
        })
    }

    /// Checks length, slot, binding and identity against what the reader expects: a wrong
    /// length or slot is [`PhysicalError::CorruptHeader`], a wrong binding (`what` names it)
    /// or identity [`PhysicalError::IdentityMismatch`].
    pub fn expect_bound(
        &self,
        len: usize,
        slot: u64,
        binding: (&'static str, u128),
        identity: &BlockIdentity,
        location: &dyn Fn() -> String,
    ) -> Result<()> {
        self.expect(len, slot, location)?;
        if self.binding != binding.1 {
            return Err(PhysicalError::IdentityMismatch {
                location: location(),
                what: binding.0,
                expected: format!("{:032x}", binding.1),
                found: format!("{:032x}", self.binding),
            });
        }
        if self.identity != *identity {
            return Err(PhysicalError::IdentityMismatch {
                location: location(),
                what: "block identity",
                expected: identity.to_hex(),
                found: self.identity.to_hex(),
            });
        }
        Ok(())
    }

    /// Checks length and slot against what the reader expects.
    pub fn expect(&self, len: usize, slot: u64, location: &dyn Fn() -> String) -> Result<()> {
        if self.len != len as u64 || self.slot != slot {
            return Err(PhysicalError::CorruptHeader {
                location: location(),
                reason: format!(
                    "header says len {} slot {}, expected len {len} slot {slot}",
                    self.len, self.slot
                ),
            });
        }
        Ok(())
    }

    /// Compares the stored checksum with `actual`.
    pub fn verify(&self, actual: u128, location: &dyn Fn() -> String) -> Result<()> {
        if self.checksum != actual {
            return Err(PhysicalError::ChecksumMismatch {
                location: location(),
                expected: self.checksum,
                actual,
            });
        }
        Ok(())
    }
}

/// A streaming xxh3-128 over a payload given in parts.
#[derive(Clone, Default)]
pub struct Checksummer(twox_hash::XxHash3_128);

impl Checksummer {
    /// An empty checksum state.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the next part of the payload.
    #[inline]
    pub fn update(&mut self, part: &[u8]) {
        self.0.write(part);
    }

    /// The checksum of everything added so far.
    pub fn finish(&self) -> u128 {
        self.0.finish_128()
    }
}

impl std::fmt::Debug for Checksummer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Checksummer")
    }
}

/// xxh3-128 of one contiguous payload.
#[inline]
pub fn checksum(bytes: &[u8]) -> u128 {
    twox_hash::XxHash3_128::oneshot(bytes)
}

/// xxh3-128 over a block given as consecutive slices.
pub fn checksum_slices<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u128 {
    let mut h = Checksummer::new();
    for p in parts {
        h.update(p);
    }
    h.finish()
}

/// xxh3-128 over a block given as raw host regions.
///
/// # Safety
/// Every `(ptr, len)` must be readable host memory for the duration of the call.
pub(crate) unsafe fn checksum_regions(regions: &[(usize, usize)]) -> u128 {
    checksum_slices(regions.iter().map(|&(ptr, len)| {
        // SAFETY: the caller guarantees the region is readable.
        unsafe { std::slice::from_raw_parts(ptr as *const u8, len) }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The checksum is the standard xxh3-128 (xxhash-rust's, a second implementation), however
        /// the payload is split, across the sizes where xxh3 changes path (≤16, ≤128, ≤240, long,
        /// several stripes and blocks).
        #[test]
        fn checksum_is_standard_xxh3_128_however_split(
            bytes in proptest::collection::vec(any::<u8>(), 0..5000),
            cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..6),
        ) {
            let expected = xxhash_rust::xxh3::xxh3_128(&bytes);
            prop_assert_eq!(checksum(&bytes), expected);
            let mut at: Vec<usize> = cuts.iter().map(|i| i.index(bytes.len() + 1)).collect();
            at.sort_unstable();
            let mut parts = Vec::new();
            let mut from = 0;
            for &c in &at {
                parts.push(&bytes[from..c]);
                from = c;
            }
            parts.push(&bytes[from..]);
            prop_assert_eq!(checksum_slices(parts.iter().copied()), expected);
        }
    }

    #[test]
    fn checksum_of_a_block_sized_payload_is_standard() {
        let bytes: Vec<u8> = (0..256 * 1024u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let expected = xxhash_rust::xxh3::xxh3_128(&bytes);
        assert_eq!(checksum(&bytes), expected);
        assert_eq!(checksum_slices(bytes.chunks(32 * 1024)), expected);
    }

    #[test]
    fn header_round_trip_and_checks() {
        let h = BlockHeader {
            len: 4096,
            slot: 7,
            checksum: checksum_slices([&b"abc"[..], b"def"]),
            identity: BlockIdentity::from_u128(42),
            binding: 9,
        };
        assert_eq!(h.checksum, checksum_slices([&b"abcdef"[..]]));
        let bytes = h.to_bytes();
        let loc = || "t".to_string();
        let back = BlockHeader::decode(&bytes, &loc).unwrap();
        assert_eq!(back, h);
        back.expect(4096, 7, &loc).unwrap();
        let id = BlockIdentity::from_u128(42);
        back.expect_bound(4096, 7, ("file id", 9), &id, &loc)
            .unwrap();
        assert!(matches!(
            back.expect_bound(4096, 7, ("file id", 8), &id, &loc),
            Err(PhysicalError::IdentityMismatch {
                what: "file id",
                ..
            })
        ));
        assert!(matches!(
            back.expect_bound(4096, 7, ("file id", 9), &BlockIdentity::ANONYMOUS, &loc),
            Err(PhysicalError::IdentityMismatch {
                what: "block identity",
                ..
            })
        ));
        assert!(matches!(
            back.expect(4096, 8, &loc),
            Err(PhysicalError::CorruptHeader { .. })
        ));
        assert!(matches!(
            back.verify(1, &loc),
            Err(PhysicalError::ChecksumMismatch { .. })
        ));
        assert!(matches!(
            BlockHeader::decode(&[0u8; HEADER_LEN], &loc),
            Err(PhysicalError::NotFound { .. })
        ));
        let mut bad = bytes;
        bad[0] ^= 1;
        assert!(matches!(
            BlockHeader::decode(&bad, &loc),
            Err(PhysicalError::CorruptHeader { .. })
        ));
        assert!(matches!(
            BlockHeader::decode(&bytes[..10], &loc),
            Err(PhysicalError::ShortRead { .. })
        ));
    }
}
