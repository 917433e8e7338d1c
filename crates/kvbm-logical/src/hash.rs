//! Sequence hashes: the identity of a full block of tokens at its place in a sequence.
//!
//! Tokens are cut into blocks of `block_size` tokens. Each full block gets a [`SequenceHash`]
//! chained from its parent's hash, its own tokens and a namespace [`Salt`] (model, tenant,
//! adapter):
//!
//! ```text
//!   seed(0)   = xxh3_64(salt bytes, seed = DOMAIN)               (the salt's root seed)
//!   current(i) = xxh3_64(tokens of block i as u32 LE, seed = current(i-1) or seed(0))
//! ```
//!
//! Equal prefixes under equal salts give equal hashes; a different salt changes every hash of
//! the sequence. The 128-bit value packs, from the most significant bit down:
//!
//! ```text
//!   | current: 64 | parent fragment: 40 | position: 20 | log2(block_size): 4 |
//! ```
//!
//! so a hash can be checked against its place in a sequence ([`SequenceHash::position`]) and
//! against its parent ([`SequenceHash::is_child_of`]). The values are stable across processes,
//! platforms and releases (a golden-value test pins them); changing the scheme is a breaking
//! change of every persisted key.
//!
//! # Cryptographic identity ([`HashAlgorithm::Blake3`])
//!
//! `xxh3_64` is fast but not collision resistant: a tenant who knows the salt can craft a
//! block whose 64-bit chain value collides with another tenant's prefix. For tiers shared
//! across processes or tenants (G3 files, G4 objects), build sequences with
//! [`HashAlgorithm::Blake3`]: every block then also carries a 256-bit [`BlockDigest`],
//!
//! ```text
//!   digest(i) = BLAKE3(DOMAIN_TAG | salt | position | block_size | digest(i-1) or 0^32 | tokens LE)
//! ```
//!
//! chained over the full 256 bits, and its [`SequenceHash`] takes `current` from the
//! digest's first 8 bytes (so indexing, lineage and prefix matching work unchanged). A block
//! completed with its digest ([`MutableBlock::complete_with_digest`](crate::MutableBlock::complete_with_digest),
//! or `complete_token_block`) carries it once registered
//! ([`ImmutableBlock::digest`](crate::ImmutableBlock::digest)), and `kvbm-offload` writes and
//! verifies the full 256 bits as the header identity of blocks that leave the process, so two
//! blocks whose 64-bit chain values collide are told apart there. It is the default algorithm
//! ([`HashAlgorithm`]); it costs more per block than xxh3 (see the logical bench).

use std::fmt;
use std::hash::{BuildHasher, Hash, Hasher};

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::error::LogicalError;

/// One token id.
pub type Token = u32;

/// Domain-separation seed for the salt's root hash ("kvbm-seq" in ASCII).
const DOMAIN: u64 = 0x6b76_626d_2d73_6571;

const LOG2_BITS: u32 = 4;
const POSITION_BITS: u32 = 20;
const FRAGMENT_BITS: u32 = 40;
const POSITION_SHIFT: u32 = LOG2_BITS;
const FRAGMENT_SHIFT: u32 = LOG2_BITS + POSITION_BITS;

/// The largest block position a [`SequenceHash`] can carry (2^20 - 1).
pub const MAX_POSITION: u32 = (1 << POSITION_BITS) - 1;
/// The smallest allowed block size, in tokens.
pub const MIN_BLOCK_SIZE: u32 = 1;
/// The largest allowed block size, in tokens.
pub const MAX_BLOCK_SIZE: u32 = 1024;
/// The default block size, in tokens.
pub const DEFAULT_BLOCK_SIZE: u32 = 16;

/// Domain tag of BLAKE3 block digests (version 1 of the scheme).
const BLAKE3_TAG: &[u8; 16] = b"kvbm-seq-blake3\x01";

/// Which function chains block identities.
///
/// The default is [`Blake3`](Self::Blake3): a sequence's identity is chosen once, when its
/// blocks are hashed, and travels with the blocks into every tier, so the default has to be the
/// one that is safe for tiers shared across processes or tenants (G3 files, G4 objects). Choose
/// [`Xxh3`](Self::Xxh3) only when every tier is private to one process and the inputs are
/// trusted.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HashAlgorithm {
    /// `xxh3_64` chain (64-bit, not collision resistant): for tiers private to one process
    /// and trusted inputs.
    Xxh3,
    /// BLAKE3 chain over 256-bit digests: the default, required for tiers shared across
    /// processes or tenants (G3, G4), where a crafted 64-bit collision could otherwise serve
    /// one tenant another's KV. Blocks carry the digest
    /// ([`MutableBlock::complete_with_digest`](crate::MutableBlock::complete_with_digest)) and
    /// the tiers that leave the process bind it as the block's identity.
    #[default]
    Blake3,
}

/// A 256-bit BLAKE3 block identity (see the [module docs](self)).
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockDigest(pub [u8; 32]);

impl BlockDigest {
    /// The digest's first 16 bytes as a big-endian `u128` (a 128-bit identity).
    pub fn as_u128(&self) -> u128 {
        u128::from_be_bytes(self.0[..16].try_into().expect("16 bytes"))
    }

    /// The digest bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for BlockDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockDigest({self})")
    }
}

impl fmt::Display for BlockDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

fn blake3_digest(
    salt: Salt,
    position: u32,
    parent: Option<&BlockDigest>,
    tokens: &[Token],
) -> BlockDigest {
    let mut hasher = blake3::Hasher::new();
    hasher.update(BLAKE3_TAG);
    hasher.update(&salt.value().to_le_bytes());
    hasher.update(&position.to_le_bytes());
    hasher.update(&(tokens.len() as u32).to_le_bytes());
    hasher.update(parent.map_or(&[0u8; 32], |p| &p.0));
    #[cfg(target_endian = "little")]
    {
        // SAFETY: `u32` has no padding and every byte pattern is a valid `u8`; the slice covers
        // exactly the tokens' memory, which lives as long as `tokens`.
        let bytes = unsafe {
            std::slice::from_raw_parts(tokens.as_ptr().cast::<u8>(), std::mem::size_of_val(tokens))
        };
        hasher.update(bytes);
    }
    #[cfg(not(target_endian = "little"))]
    for t in tokens {
        hasher.update(&t.to_le_bytes());
    }
    BlockDigest(*hasher.finalize().as_bytes())
}

/// Checks that `block_size` is a power of two in `1..=1024`.
///
/// # Errors
/// [`LogicalError::InvalidBlockSize`] otherwise.
pub fn validate_block_size(block_size: u32) -> Result<(), LogicalError> {
    if block_size.is_power_of_two() && (MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&block_size) {
        Ok(())
    } else {
        Err(LogicalError::InvalidBlockSize { block_size })
    }
}

/// A namespace salt (model, tenant, adapter, ...): sequences under different salts never share
/// hashes in practice.
#[derive(Copy, Clone, Eq, PartialEq, Hash, Debug)]
pub struct Salt(u64);

impl Salt {
    /// The empty salt (no namespace).
    pub const NONE: Salt = Salt(DOMAIN);

    /// A salt from arbitrary bytes (e.g. a model name followed by an adapter id).
    pub fn new(bytes: impl AsRef<[u8]>) -> Self {
        Salt(xxh3_64_with_seed(bytes.as_ref(), DOMAIN))
    }

    /// The salt's 64-bit root seed.
    pub fn value(self) -> u64 {
        self.0
    }
}

impl Default for Salt {
    fn default() -> Self {
        Salt::NONE
    }
}

/// The identity of a full block at its position in a token sequence (128 bits, position-aware).
///
/// See the [module docs](self) for the layout. `Ord` orders by the raw 128-bit value, which is
/// arbitrary but stable.
#[derive(Copy, Clone, Eq, PartialEq, Ord, PartialOrd, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct SequenceHash(u128);

impl SequenceHash {
    /// The hash of the first block (position 0) of a sequence.
    ///
    /// # Panics
    /// If `tokens.len()` is not a valid block size (a power of two in `1..=1024`).
    pub fn root(salt: Salt, tokens: &[Token]) -> Self {
        Self::compute(salt.value(), 0, 0, tokens)
    }

    /// The hash of the block following `self`, holding `tokens`.
    ///
    /// # Panics
    /// If `tokens.len()` differs from `self`'s block size, or the position would exceed
    /// [`MAX_POSITION`].
    pub fn child(&self, tokens: &[Token]) -> Self {
        assert_eq!(
            tokens.len(),
            self.block_size() as usize,
            "a child block must have its parent's block size"
        );
        let position = self.position() + 1;
        assert!(position <= MAX_POSITION, "sequence position overflow");
        Self::compute(self.current(), fragment(self.current()), position, tokens)
    }

    /// The BLAKE3 identity of the first block (position 0): its digest and hash.
    ///
    /// # Panics
    /// If `tokens.len()` is not a valid block size.
    pub fn root_blake3(salt: Salt, tokens: &[Token]) -> (Self, BlockDigest) {
        let digest = blake3_digest(salt, 0, None, tokens);
        (Self::pack(digest_current(&digest), 0, 0, tokens), digest)
    }

    /// The BLAKE3 identity of the block following `self` (whose digest is `parent`).
    ///
    /// # Panics
    /// As [`child`](Self::child).
    pub fn child_blake3(
        &self,
        salt: Salt,
        parent: &BlockDigest,
        tokens: &[Token],
    ) -> (Self, BlockDigest) {
        assert_eq!(
            tokens.len(),
            self.block_size() as usize,
            "a child block must have its parent's block size"
        );
        let position = self.position() + 1;
        assert!(position <= MAX_POSITION, "sequence position overflow");
        let digest = blake3_digest(salt, position, Some(parent), tokens);
        let hash = Self::pack(
            digest_current(&digest),
            fragment(self.current()),
            position,
            tokens,
        );
        (hash, digest)
    }

    fn compute(seed: u64, parent_fragment: u64, position: u32, tokens: &[Token]) -> Self {
        Self::pack(hash_tokens(tokens, seed), parent_fragment, position, tokens)
    }

    fn pack(current: u64, parent_fragment: u64, position: u32, tokens: &[Token]) -> Self {
        let block_size = tokens.len() as u32;
        validate_block_size(block_size).expect("tokens.len() must be a valid block size");
        let raw = ((current as u128) << 64)
            | ((parent_fragment as u128) << FRAGMENT_SHIFT)
            | ((position as u128) << POSITION_SHIFT)
            | block_size.trailing_zeros() as u128;
        SequenceHash(raw)
    }

    /// The block's position in its sequence (0 for the first block).
    pub fn position(&self) -> u32 {
        ((self.0 >> POSITION_SHIFT) as u32) & MAX_POSITION
    }

    /// The raw 128-bit value (stable; suitable as an object key).
    pub fn as_u128(&self) -> u128 {
        self.0
    }

    /// Rebuilds a hash from [`as_u128`](Self::as_u128).
    pub fn from_u128(raw: u128) -> Self {
        SequenceHash(raw)
    }

    /// The chained 64-bit hash of this block (identity without position metadata).
    pub fn current(&self) -> u64 {
        (self.0 >> 64) as u64
    }

    /// The block size (tokens per block) this hash was computed for.
    pub fn block_size(&self) -> u32 {
        1 << ((self.0 as u32) & ((1 << LOG2_BITS) - 1))
    }

    /// The top 40 bits of the parent's [`current`](Self::current) (0 for a root block).
    pub fn parent_fragment(&self) -> u64 {
        ((self.0 >> FRAGMENT_SHIFT) as u64) & ((1 << FRAGMENT_BITS) - 1)
    }

    /// Whether `self` is (up to the 40-bit fragment) the block right after `parent`.
    pub fn is_child_of(&self, parent: &SequenceHash) -> bool {
        self.position() == parent.position() + 1
            && self.block_size() == parent.block_size()
            && self.parent_fragment() == fragment(parent.current())
    }

    /// Key under which this block can be found by its children (`fragment | position`).
    pub(crate) fn lineage_key(&self) -> u64 {
        (fragment(self.current()) << 24) | self.position() as u64
    }

    /// Key of this block's parent, as its [`lineage_key`](Self::lineage_key); `None` at
    /// position 0.
    pub(crate) fn parent_lineage_key(&self) -> Option<u64> {
        let position = self.position();
        (position > 0).then(|| (self.parent_fragment() << 24) | (position - 1) as u64)
    }
}

fn digest_current(d: &BlockDigest) -> u64 {
    u64::from_be_bytes(d.0[..8].try_into().expect("8 bytes"))
}

fn fragment(current: u64) -> u64 {
    current >> (64 - FRAGMENT_BITS)
}

fn hash_tokens(tokens: &[Token], seed: u64) -> u64 {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: `u32` has no padding and every byte pattern is a valid `u8`; the slice covers
        // exactly the tokens' memory, which lives as long as `tokens`.
        let bytes = unsafe {
            std::slice::from_raw_parts(tokens.as_ptr().cast::<u8>(), std::mem::size_of_val(tokens))
        };
        xxh3_64_with_seed(bytes, seed)
    }
    #[cfg(not(target_endian = "little"))]
    {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        xxh3_64_with_seed(&bytes, seed)
    }
}

impl Hash for SequenceHash {
    #[inline]
    fn hash<H: Hasher>(&self, state: &mut H) {
        // `current` is already a well-mixed 64-bit hash.
        state.write_u64(self.current() ^ (self.0 as u64));
    }
}

impl fmt::Debug for SequenceHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "SequenceHash({:016x}@{})",
            self.current(),
            self.position()
        )
    }
}

impl fmt::Display for SequenceHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// A `BuildHasher` for keys that are already hashes: passes `write_u64` through unchanged.
#[derive(Copy, Clone, Default, Debug)]
pub(crate) struct PassThroughHash;

impl BuildHasher for PassThroughHash {
    type Hasher = PassThroughHasher;
    #[inline]
    fn build_hasher(&self) -> PassThroughHasher {
        PassThroughHasher(0)
    }
}

/// The hasher of [`PassThroughHash`].
#[derive(Default, Debug)]
pub(crate) struct PassThroughHasher(u64);

impl Hasher for PassThroughHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        // Not used by our keys; fold bytes in for completeness.
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    #[inline]
    fn write_u64(&mut self, v: u64) {
        self.0 ^= v;
    }
}

/// A full block of tokens and its hash.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenBlock {
    tokens: Vec<Token>,
    hash: SequenceHash,
    digest: Option<BlockDigest>,
}

impl TokenBlock {
    /// The block's tokens (`block_size` of them).
    pub fn tokens(&self) -> &[Token] {
        &self.tokens
    }

    /// The block's sequence hash.
    pub fn sequence_hash(&self) -> SequenceHash {
        self.hash
    }

    /// The block's position in its sequence.
    pub fn position(&self) -> u32 {
        self.hash.position()
    }

    /// The 256-bit BLAKE3 identity, for sequences built with [`HashAlgorithm::Blake3`].
    pub fn digest(&self) -> Option<BlockDigest> {
        self.digest
    }
}

/// Turns a growing token stream into complete [`TokenBlock`]s plus a partial tail.
#[derive(Clone, Debug)]
pub struct TokenBlockSequence {
    block_size: u32,
    salt: Salt,
    algorithm: HashAlgorithm,
    blocks: Vec<TokenBlock>,
    tail: Vec<Token>,
}

impl TokenBlockSequence {
    /// An empty sequence.
    ///
    /// # Errors
    /// [`LogicalError::InvalidBlockSize`] unless `block_size` is a power of two in `1..=1024`.
    pub fn new(block_size: u32, salt: Salt) -> Result<Self, LogicalError> {
        Self::with_algorithm(block_size, salt, HashAlgorithm::Xxh3)
    }

    /// An empty sequence whose block identities use `algorithm`.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn with_algorithm(
        block_size: u32,
        salt: Salt,
        algorithm: HashAlgorithm,
    ) -> Result<Self, LogicalError> {
        validate_block_size(block_size)?;
        Ok(Self {
            block_size,
            salt,
            algorithm,
            blocks: Vec::new(),
            tail: Vec::with_capacity(block_size as usize),
        })
    }

    /// A sequence holding `tokens`.
    ///
    /// # Errors
    /// As [`new`](Self::new), and [`LogicalError::SequenceTooLong`] past
    /// [`MAX_POSITION`]` + 1` blocks.
    pub fn from_tokens(
        tokens: &[Token],
        block_size: u32,
        salt: Salt,
    ) -> Result<Self, LogicalError> {
        Self::from_tokens_with(tokens, block_size, salt, HashAlgorithm::Xxh3)
    }

    /// A sequence holding `tokens`, with block identities from `algorithm`.
    ///
    /// # Errors
    /// As [`from_tokens`](Self::from_tokens).
    pub fn from_tokens_with(
        tokens: &[Token],
        block_size: u32,
        salt: Salt,
        algorithm: HashAlgorithm,
    ) -> Result<Self, LogicalError> {
        let mut seq = Self::with_algorithm(block_size, salt, algorithm)?;
        seq.extend(tokens)?;
        Ok(seq)
    }

    /// Appends tokens; returns how many blocks were completed by this call.
    ///
    /// # Errors
    /// [`LogicalError::SequenceTooLong`] if the tokens would complete a block past position
    /// [`MAX_POSITION`]; the sequence is then unchanged.
    pub fn extend(&mut self, tokens: &[Token]) -> Result<usize, LogicalError> {
        let before = self.blocks.len();
        let bs = self.block_size as usize;
        let completed = (self.tail.len() + tokens.len()) / bs;
        let max_blocks = MAX_POSITION as usize + 1;
        if before + completed > max_blocks {
            return Err(LogicalError::SequenceTooLong {
                blocks: before + completed,
                max_blocks,
            });
        }
        let mut rest = tokens;
        while !rest.is_empty() {
            let take = (bs - self.tail.len()).min(rest.len());
            self.tail.extend_from_slice(&rest[..take]);
            rest = &rest[take..];
            if self.tail.len() == bs {
                let tokens = std::mem::replace(&mut self.tail, Vec::with_capacity(bs));
                let (hash, digest) = match (self.algorithm, self.blocks.last()) {
                    (HashAlgorithm::Xxh3, Some(parent)) => (parent.hash.child(&tokens), None),
                    (HashAlgorithm::Xxh3, None) => (SequenceHash::root(self.salt, &tokens), None),
                    (HashAlgorithm::Blake3, Some(parent)) => {
                        let pd = parent.digest.expect("blake3 blocks carry digests");
                        let (h, d) = parent.hash.child_blake3(self.salt, &pd, &tokens);
                        (h, Some(d))
                    }
                    (HashAlgorithm::Blake3, None) => {
                        let (h, d) = SequenceHash::root_blake3(self.salt, &tokens);
                        (h, Some(d))
                    }
                };
                self.blocks.push(TokenBlock {
                    tokens,
                    hash,
                    digest,
                });
            }
        }
        Ok(self.blocks.len() - before)
    }

    /// Appends one token; returns `true` when it completed a block.
    ///
    /// # Errors
    /// As [`extend`](Self::extend).
    pub fn push(&mut self, token: Token) -> Result<bool, LogicalError> {
        Ok(self.extend(&[token])? == 1)
    }

    /// The algorithm of this sequence's block identities.
    pub fn algorithm(&self) -> HashAlgorithm {
        self.algorithm
    }

    /// The complete blocks so far.
    pub fn blocks(&self) -> &[TokenBlock] {
        &self.blocks
    }

    /// The tokens of the partial (not yet full) tail block.
    pub fn tail(&self) -> &[Token] {
        &self.tail
    }

    /// The hashes of the complete blocks, in order.
    pub fn hashes(&self) -> Vec<SequenceHash> {
        self.blocks.iter().map(|b| b.hash).collect()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The namespace salt.
    pub fn salt(&self) -> Salt {
        self.salt
    }

    /// Total tokens (complete blocks and tail).
    pub fn total_tokens(&self) -> usize {
        self.blocks.len() * self.block_size as usize + self.tail.len()
    }
}

#[cfg(test)]
mod tests;
