//! Collectives across ranks (feature `collectives`): **a documented stub; nothing is built.**
//!
//! Seed 003 describes workers that exchange KV blocks between GPU ranks with NCCL-style
//! collectives (all-gather of a block's head slices when tensor-parallel layouts differ
//! between instances). That needs CUDA device memory and a collective library, neither of
//! which this crate links yet, so:
//!
//! * without the `cuda` feature, enabling `collectives` fails the build (`compile_error!` in
//!   the crate root), so nobody can believe they have collectives on a CPU build;
//! * with `cuda`, this module exists and holds no items: every transfer still goes rank by
//!   rank through [`ParallelWorkers`](crate::worker::ParallelWorkers).
