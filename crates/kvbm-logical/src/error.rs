//! The crate's error type, and [`BlockError`], which hands a block back on a failed transition.
//! At the bottom of the crate: it names no module above it but `tier` (ids).

use crate::tier::TierId;

/// Errors of `kvbm-logical`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LogicalError {
    /// `allocate_blocks(n)` could not be satisfied, even after evicting inactive blocks.
    /// Nothing was allocated.
    #[error(
        "tier {tier}: cannot allocate {requested} blocks: only {available} available \
         (reset + evictable inactive) of {total}"
    )]
    InsufficientBlocks {
        /// The tier of the manager.
        tier: TierId,
        /// Blocks asked for.
        requested: usize,
        /// Blocks that could be handed out.
        available: usize,
        /// The manager's capacity.
        total: usize,
    },
    /// The block size is not a power of two in `1..=1024`.
    #[error("invalid block size {block_size}: must be a power of two in 1..=1024")]
    InvalidBlockSize {
        /// The rejected size.
        block_size: u32,
    },
    /// The builder was given an invalid or missing setting.
    #[error("invalid block manager configuration: {0}")]
    InvalidConfig(String),
    /// A token sequence would exceed the positions a
    /// [`SequenceHash`](crate::hash::SequenceHash) can carry.
    #[error("token sequence too long: {blocks} blocks, at most {max_blocks} fit a sequence hash")]
    SequenceTooLong {
        /// Complete blocks the sequence would have held.
        blocks: usize,
        /// The most complete blocks a sequence can hold (2^20).
        max_blocks: usize,
    },
    /// A hash computed for another block size was offered to a manager.
    #[error("sequence hash {hash:032x} is for block size {actual}, the manager uses {expected}")]
    BlockSizeMismatch {
        /// The hash offered (`SequenceHash::as_u128`: the error module sits below the hash
        /// module and names no type of it).
        hash: u128,
        /// The manager's block size.
        expected: u32,
        /// The block size encoded in the hash.
        actual: u32,
    },
}

/// A failed block transition; the block is handed back, never leaked.
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct BlockError<B> {
    /// The block, unchanged.
    pub block: B,
    /// Why the transition failed.
    #[source]
    pub error: LogicalError,
}

impl<B> BlockError<B> {
    /// Takes the block back out of the error.
    pub fn into_block(self) -> B {
        self.block
    }
}
