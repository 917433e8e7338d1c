//! Tests of sequence hashing.
