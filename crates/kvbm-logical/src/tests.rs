//! Cross-module tests: proptest state machine and multi-threaded stress.
