//! Tests of the block manager.
