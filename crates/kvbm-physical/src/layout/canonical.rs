//! The canonical (parallelism-free) page mapping of seed 002.
//!
//! A worker under tensor parallelism holds only some heads of each token. A
//! [`CanonicalPageMapping`] says, as a list of strided [`CopyRun`]s, where each byte of the
//! worker's page lives in the canonical page (all heads), so a block stored under one TP layout
//! can be read under another. When several ranks hold identical bytes (KV heads replicated
//! because `tp > num_kv_heads`), they take turns storing them: [`CanonicalPageMapping::is_writer`]
//! rotates by block id.
//!
//! Invariant (tested): the runs of a mapping cover the local page exactly once and stay inside
//! the canonical page.
//!
//! # Page order decides the fragment size
//!
//! How big each copied fragment is depends on where the heads sit in a page ([`PageOrder`],
//! vLLM's `kv_cache_layout`). Token-major pages (`NHD`) interleave the heads of every token, so
//! a rank's part is one small fragment per token (its heads of that token, e.g. 4 heads × 256 B
//! = 1 KiB) at the canonical token stride. Head-major pages (`HND`) keep each head's tokens
//! together, so a rank's part is one fragment per K/V half (all its heads' tokens, 16 KiB in the
//! same example): canonical conversion is then nearly a plain copy.
//!
//! ```text
//!  NHD  canonical [tok0: h0 h1 h2 h3 | tok1: h0 h1 h2 h3 | …]   rank 0 of TP=2: h0 h1 of each token
//!                  ^^^^^            ^^^^^                       tokens × small fragments
//!  HND  canonical [h0: tok0..15 | h1: tok0..15 | h2 … | h3 …]   rank 0 of TP=2: h0 h1, all tokens
//!                  ^^^^^^^^^^^^^^^^^^^^^^^^^^^                  one large fragment
//! ```

use crate::error::{PhysicalError, Result};

/// A strided byte correspondence between a worker's page and the canonical page: fragment `i`
/// spans `[local_offset + i*local_stride, +fragment_size)` locally and
/// `[canonical_offset + i*canonical_stride, +fragment_size)` canonically.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CopyRun {
    /// First local byte.
    pub local_offset: usize,
    /// First canonical byte.
    pub canonical_offset: usize,
    /// Bytes per fragment.
    pub fragment_size: usize,
    /// Number of fragments.
    pub num_fragments: usize,
    /// Local distance between fragments.
    pub local_stride: usize,
    /// Canonical distance between fragments.
    pub canonical_stride: usize,
}

/// Where the heads sit in a KV page (vLLM's `kv_cache_layout`): see the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PageOrder {
    /// `[outer, tokens, heads, head_bytes]`: vLLM's `NHD` (its default, FlashAttention's).
    Nhd,
    /// `[outer, heads, tokens, head_bytes]`: vLLM's `HND` (FlashInfer's).
    Hnd,
}

/// How a worker's page maps into the canonical page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CanonicalPageMapping {
    /// Canonical page size in bytes.
    pub canonical_page_size_bytes: usize,
    /// This worker's (un-padded) page size in bytes.
    pub local_page_size_bytes: usize,
    /// The byte correspondences.
    pub runs: Vec<CopyRun>,
    /// Ranks holding these exact bytes.
    pub num_writers: usize,
    /// This worker's index among them.
    pub writer_index: usize,
    /// The canonical bytes are identical under any parallel config with this block span.
    pub parallelism_agnostic: bool,
}

impl CanonicalPageMapping {
    /// Identity mapping for a worker holding the whole page.
    pub fn identity(page_bytes: usize) -> Self {
        CanonicalPageMapping {
            canonical_page_size_bytes: page_bytes,
            local_page_size_bytes: page_bytes,
            runs: vec![CopyRun {
                local_offset: 0,
                canonical_offset: 0,
                fragment_size: page_bytes,
                num_fragments: 1,
                local_stride: page_bytes,
                canonical_stride: page_bytes,
            }],
            num_writers: 1,
            writer_index: 0,
            parallelism_agnostic: true,
        }
    }

    /// Head-sharded tensor parallelism over a token-major page shaped
    /// `[outer, tokens, heads, head_bytes]` (canonically all `num_kv_heads`; locally
    /// `max(1, num_kv_heads / tp_size)` heads): [`tensor_parallel_in`](Self::tensor_parallel_in)
    /// with [`PageOrder::Nhd`].
    pub fn tensor_parallel(
        outer_dim: usize,
        tokens: usize,
        num_kv_heads: usize,
        head_bytes: usize,
        tp_size: usize,
        tp_rank: usize,
    ) -> Result<Self> {
        Self::tensor_parallel_in(
            PageOrder::Nhd,
            outer_dim,
            tokens,
            num_kv_heads,
            head_bytes,
            tp_size,
            tp_rank,
        )
    }

    /// Head-sharded tensor parallelism over a page in `order` (canonically all
    /// `num_kv_heads`; locally `max(1, num_kv_heads / tp_size)` heads, in the same order). With
    /// `tp_size > num_kv_heads` the heads are replicated and the ranks holding one head take
    /// turns storing it ([`is_writer`](Self::is_writer)).
    ///
    /// # Errors
    /// [`PhysicalError::InvalidArgument`] for a zero dimension, `tp_rank >= tp_size`, or heads
    /// and TP size that do not divide one another.
    pub fn tensor_parallel_in(
        order: PageOrder,
        outer_dim: usize,
        tokens: usize,
        num_kv_heads: usize,
        head_bytes: usize,
        tp_size: usize,
        tp_rank: usize,
    ) -> Result<Self> {
        if [outer_dim, tokens, num_kv_heads, head_bytes, tp_size].contains(&0) || tp_rank >= tp_size
        {
            return Err(PhysicalError::InvalidArgument(
                "tensor_parallel: zero dimension or rank >= tp_size".into(),
            ));
        }
        let (local_heads, first_head, num_writers, writer_index) = if tp_size <= num_kv_heads {
            if !num_kv_heads.is_multiple_of(tp_size) {
                return Err(PhysicalError::InvalidArgument(format!(
                    "{num_kv_heads} kv heads do not split over tp {tp_size}"
                )));
            }
            let h = num_kv_heads / tp_size;
            (h, tp_rank * h, 1, 0)
        } else {
            if !tp_size.is_multiple_of(num_kv_heads) {
                return Err(PhysicalError::InvalidArgument(format!(
                    "tp {tp_size} is not a multiple of {num_kv_heads} kv heads"
                )));
            }
            let replicas = tp_size / num_kv_heads;
            (1, tp_rank / replicas, replicas, tp_rank % replicas)
        };
        let (local_half, canonical_half) = (
            tokens * local_heads * head_bytes,
            tokens * num_kv_heads * head_bytes,
        );
        let runs = match order {
            // Per outer half: one fragment per token (this rank's heads of it).
            PageOrder::Nhd => {
                let frag = local_heads * head_bytes;
                (0..outer_dim)
                    .map(|o| CopyRun {
                        local_offset: o * local_half,
                        canonical_offset: o * canonical_half + first_head * head_bytes,
                        fragment_size: frag,
                        num_fragments: tokens,
                        local_stride: frag,
                        canonical_stride: num_kv_heads * head_bytes,
                    })
                    .collect()
            }
            // One fragment per outer half: this rank's heads, every token of each.
            PageOrder::Hnd => vec![CopyRun {
                local_offset: 0,
                canonical_offset: first_head * tokens * head_bytes,
                fragment_size: local_half,
                num_fragments: outer_dim,
                local_stride: local_half,
                canonical_stride: canonical_half,
            }],
        };
        Ok(CanonicalPageMapping {
            canonical_page_size_bytes: outer_dim * canonical_half,
            local_page_size_bytes: outer_dim * local_half,
            runs,
            num_writers,
            writer_index,
            parallelism_agnostic: true,
        })
    }

    /// Whether this worker stores the canonical page of `block_id` (rotation among the ranks
    /// holding identical bytes).
    pub fn is_writer(&self, block_id: usize) -> bool {
        block_id % self.num_writers == self.writer_index
    }

    /// Copies the local page into its place in the canonical page.
    pub fn to_canonical(&self, local: &[u8], canonical: &mut [u8]) {
        for r in &self.runs {
            for i in 0..r.num_fragments {
                let l = r.local_offset + i * r.local_stride;
                let c = r.canonical_offset + i * r.canonical_stride;
                canonical[c..c + r.fragment_size].copy_from_slice(&local[l..l + r.fragment_size]);
            }
        }
    }

    /// Copies this worker's part of the canonical page into the local page.
    pub fn from_canonical(&self, canonical: &[u8], local: &mut [u8]) {
        for r in &self.runs {
            for i in 0..r.num_fragments {
                let l = r.local_offset + i * r.local_stride;
                let c = r.canonical_offset + i * r.canonical_stride;
                local[l..l + r.fragment_size].copy_from_slice(&canonical[c..c + r.fragment_size]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cover(m: &CanonicalPageMapping) -> (Vec<u8>, bool) {
        let mut seen = vec![0u8; m.local_page_size_bytes];
        let mut in_bounds = true;
        for r in &m.runs {
            for i in 0..r.num_fragments {
                let l = r.local_offset + i * r.local_stride;
                let c = r.canonical_offset + i * r.canonical_stride;
                in_bounds &= c + r.fragment_size <= m.canonical_page_size_bytes;
                for b in &mut seen[l..l + r.fragment_size] {
                    *b += 1;
                }
            }
        }
        (seen, in_bounds)
    }

    /// The reference model: byte `b` of head `h`, token `t`, outer half `o` of a page holding
    /// `heads` heads, at its offset in `order`.
    fn offset(
        order: PageOrder,
        dims: (usize, usize, usize),
        at: (usize, usize, usize, usize),
    ) -> usize {
        let (tokens, heads, head_bytes) = dims;
        let (o, t, h, b) = at;
        match order {
            PageOrder::Nhd => ((o * tokens + t) * heads + h) * head_bytes + b,
            PageOrder::Hnd => ((o * heads + h) * tokens + t) * head_bytes + b,
        }
    }

    fn order() -> impl Strategy<Value = PageOrder> {
        prop_oneof![Just(PageOrder::Nhd), Just(PageOrder::Hnd)]
    }

    proptest! {
        /// Each rank's page, read from a canonical page, is exactly the heads TP gives it (head
        /// `tp_rank * local` on, or the one replicated head), in the page's own order.
        #[test]
        fn a_ranks_page_holds_its_heads_in_its_order(
            order in order(), outer in 1usize..3, tokens in 1usize..5, heads_pow in 0u32..4,
            head_bytes in 1usize..5, tp_pow in 0u32..5,
        ) {
            let (heads, tp) = (1usize << heads_pow, 1usize << tp_pow);
            let canon_len = outer * tokens * heads * head_bytes;
            let canonical: Vec<u8> = (0..canon_len).map(|i| (i * 131 + 7) as u8).collect();
            for rank in 0..tp {
                let m = CanonicalPageMapping::tensor_parallel_in(
                    order, outer, tokens, heads, head_bytes, tp, rank,
                ).unwrap();
                let (local_heads, first) = if tp <= heads {
                    (heads / tp, rank * (heads / tp))
                } else {
                    (1, rank / (tp / heads))
                };
                prop_assert_eq!(m.canonical_page_size_bytes, canon_len);
                prop_assert_eq!(m.local_page_size_bytes, outer * tokens * local_heads * head_bytes);
                let mut local = vec![0u8; m.local_page_size_bytes];
                m.from_canonical(&canonical, &mut local);
                for o in 0..outer { for t in 0..tokens { for h in 0..local_heads { for b in 0..head_bytes {
                    let want = canonical[offset(order, (tokens, heads, head_bytes), (o, t, first + h, b))];
                    let got = local[offset(order, (tokens, local_heads, head_bytes), (o, t, h, b))];
                    prop_assert_eq!(got, want, "rank {} o {} t {} h {} b {}", rank, o, t, h, b);
                }}}}
            }
        }

        #[test]
        fn tp_mappings_cover_local_page_once_and_reshard(
            order in order(), outer in 1usize..3, tokens in 1usize..5, heads_pow in 0u32..4,
            head_bytes in 1usize..5, tp_a_pow in 0u32..5, tp_b_pow in 0u32..5,
        ) {
            let heads = 1usize << heads_pow;
            let canon_len = outer * tokens * heads * head_bytes;
            let canonical: Vec<u8> = (0..canon_len).map(|i| (i * 7 + 3) as u8).collect();
            // Ranks of config A write their pages (writers only) into a fresh canonical page…
            let tp_a = 1usize << tp_a_pow;
            let mut rebuilt = vec![0u8; canon_len];
            for block in 0..3usize {
                rebuilt.iter_mut().for_each(|b| *b = 0);
                let mut writers_per_byte = vec![0u32; canon_len];
                for rank in 0..tp_a {
                    let m = CanonicalPageMapping::tensor_parallel_in(order, outer, tokens, heads, head_bytes, tp_a, rank).unwrap();
                    let (seen, in_bounds) = cover(&m);
                    prop_assert!(in_bounds);
                    prop_assert!(seen.iter().all(|c| *c == 1));
                    let mut local = vec![0u8; m.local_page_size_bytes];
                    m.from_canonical(&canonical, &mut local);
                    if m.is_writer(block) {
                        m.to_canonical(&local, &mut rebuilt);
                        for r in &m.runs { for i in 0..r.num_fragments {
                            let c = r.canonical_offset + i * r.canonical_stride;
                            for w in &mut writers_per_byte[c..c + r.fragment_size] { *w += 1; }
                        }}
                    }
                }
                // …exactly one writer per canonical byte, and config B reads its pages back.
                prop_assert!(writers_per_byte.iter().all(|w| *w == 1));
                prop_assert_eq!(&rebuilt, &canonical);
                let tp_b = 1usize << tp_b_pow;
                for rank in 0..tp_b {
                    let m = CanonicalPageMapping::tensor_parallel_in(order, outer, tokens, heads, head_bytes, tp_b, rank).unwrap();
                    let mut from_rebuilt = vec![0u8; m.local_page_size_bytes];
                    let mut from_orig = vec![0u8; m.local_page_size_bytes];
                    m.from_canonical(&rebuilt, &mut from_rebuilt);
                    m.from_canonical(&canonical, &mut from_orig);
                    prop_assert_eq!(from_rebuilt, from_orig);
                }
            }
        }
    }

    #[test]
    fn identity_is_writer_always() {
        let m = CanonicalPageMapping::identity(64);
        assert!((0..10).all(|b| m.is_writer(b)));
    }
}
