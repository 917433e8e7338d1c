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

use xxhash_rust::xxh3::Xxh3;

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

/// xxh3-128 over a block given as consecutive slices.
pub fn checksum_slices<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u128 {
    let mut h = Xxh3::new();
    for p in parts {
        h.update(p);
    }
    h.digest128()
}

/// xxh3-128 over a block given as raw host regions.
///
/// # Safety
/// Every `(ptr, len)` must be readable host memory for the duration of the call.
pub(crate) unsafe fn checksum_regions(regions: &[(usize, usize)]) -> u128 {
    let mut h = Xxh3::new();
    for &(ptr, len) in regions {
        // SAFETY: the caller guarantees the region is readable.
        h.update(unsafe { std::slice::from_raw_parts(ptr as *const u8, len) });
    }
    h.digest128()
}

#[cfg(test)]
mod tests {
    use super::*;

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
