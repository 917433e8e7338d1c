//! The seed's offload names are importable where the seed put them (issue 46), and each is
//! the type the glossary now names.

use std::any::TypeId;

use kvbm_offload::handle::{
    OffloadId, OffloadProgressCounts, OffloadProgressCursor, OffloadProgressDelta, OffloadStatus,
};
use kvbm_offload::{
    OffloadHandle, OffloadResult, TransferHandle, TransferId, TransferProgressCounts,
    TransferProgressCursor, TransferProgressDelta, TransferResult, TransferStatus,
};

#[test]
fn each_seed_name_is_the_type_it_is_now_called() {
    assert_eq!(
        TypeId::of::<TransferHandle>(),
        TypeId::of::<OffloadHandle>()
    );
    assert_eq!(TypeId::of::<TransferId>(), TypeId::of::<OffloadId>());
    assert_eq!(
        TypeId::of::<TransferStatus>(),
        TypeId::of::<OffloadStatus>()
    );
    assert_eq!(
        TypeId::of::<TransferResult>(),
        TypeId::of::<OffloadResult>()
    );
    assert_eq!(
        TypeId::of::<TransferProgressCounts>(),
        TypeId::of::<OffloadProgressCounts>()
    );
    assert_eq!(
        TypeId::of::<TransferProgressCursor>(),
        TypeId::of::<OffloadProgressCursor>()
    );
    assert_eq!(
        TypeId::of::<TransferProgressDelta>(),
        TypeId::of::<OffloadProgressDelta>()
    );
}

/// The seed's `TransferExecutor` is the executor trait: a type implementing `MoveExecutor`
/// implements it under the seed's name.
#[test]
fn the_seed_executor_is_the_move_executor_trait() {
    fn takes_seed_executor<E: kvbm_offload::TransferExecutor<kvbm_logical::G2>>() {}
    takes_seed_executor::<kvbm_offload::executor::NoopExecutor>();
}
