//! Deterministic block contents: the bytes a "computed" block holds, derived from its hash.
//!
//! The replay has no model, so "computing" a block means filling it with bytes that are a pure
//! function of the block's sequence hash. Every block that reaches G1 from a lower tier is
//! compared against these bytes, so a tier that returned the wrong block (or a damaged one) is
//! caught before the block is served.

use kvbm_engine::stack::Contents;
use kvbm_logical::SequenceHash;

/// The 64-bit seed of a block's contents.
#[inline]
pub(crate) fn seed(hash: SequenceHash) -> u64 {
    let v = hash.as_u128();
    (v as u64) ^ ((v >> 64) as u64).rotate_left(17)
}

#[inline(always)]
fn word(seed: u64, i: u64) -> u64 {
    // A cheap, well-mixed function of (seed, index): distinct blocks differ in every word.
    let mut x = seed ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^ (x >> 29)
}

/// Fills `out` (a multiple of 8 bytes) with the contents of the block with `seed`.
pub(crate) fn fill(seed: u64, out: &mut [u8]) {
    for (i, chunk) in out.chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&word(seed, i as u64).to_le_bytes());
    }
}

/// Whether `bytes` are exactly the contents of the block with `seed`.
pub(crate) fn verify(seed: u64, bytes: &[u8]) -> bool {
    if !bytes.len().is_multiple_of(8) {
        return false;
    }
    bytes
        .chunks_exact(8)
        .enumerate()
        .all(|(i, c)| c == word(seed, i as u64).to_le_bytes())
}

/// The replay's [`Contents`]: every block's bytes are [`fill`] of its hash's [`seed`].
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ReplayContents;

impl Contents for ReplayContents {
    fn fill(&self, hash: SequenceHash, out: &mut [u8]) {
        fill(seed(hash), out);
    }

    fn verify(&self, hash: SequenceHash, bytes: &[u8]) -> bool {
        verify(seed(hash), bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbm_logical::Salt;

    #[test]
    fn fill_then_verify_and_detect_one_flipped_byte() {
        let h = SequenceHash::root(Salt::NONE, &[7]);
        let mut b = vec![0u8; 4096];
        fill(seed(h), &mut b);
        assert!(verify(seed(h), &b));
        let other = SequenceHash::root(Salt::NONE, &[8]);
        assert!(
            !verify(seed(other), &b),
            "another block's bytes must not verify"
        );
        b[4095] ^= 1;
        assert!(!verify(seed(h), &b));
    }
}
