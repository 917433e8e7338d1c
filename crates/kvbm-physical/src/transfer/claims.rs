//! Who may touch which block: process-wide layout reservations and per-manager block claims.
//!
//! See the parent module's "Why a safe call cannot race" for the argument; this file is the
//! bookkeeping.
//!
//! * [`Reservation`]: the address ranges (host and device memory share one space: device
//!   addresses are unified virtual addresses, and the host stand-in uses host addresses) and
//!   the disk storage of a registered layout, in one global table. Reserving a range that
//!   overlaps a live reservation fails. Dropped when the manager forgets the layout and the
//!   last transfer using it ended.
//! * [`Claims`]: per manager, `(layout, block) → readers | writer`. A job claims all its blocks
//!   at once or none; its [`JobGuard`] releases them on drop.
//!
//! Locks: the global table and each manager's claim map are leaf `parking_lot::Mutex`es held
//! for a scan or an insert only.

use hashbrown::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::{BlockId, LayoutHandle};
use crate::error::{PhysicalError, Result};
use crate::physical::{Backing, PhysicalLayout};

/// Address spaces of reservations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Space {
    /// Host and (unified) device addresses.
    Memory,
    /// `Arc<DiskStorage>` identities (one storage per file, enforced by its `flock`).
    Disk,
}

/// `(space, start, end, owner)` of every live reservation.
static RESERVED: Mutex<Vec<(Space, usize, usize, u64)>> = Mutex::new(Vec::new());
static NEXT_OWNER: AtomicU64 = AtomicU64::new(1);

/// The memory of one registered layout, reserved until dropped.
///
/// It keeps the layout alive: its `Drop` removes the table entry before the layout (and so the
/// memory) can be freed. Were the memory freed first, the allocator could hand the same
/// addresses to a new layout in another thread, whose registration would then clash with this
/// stale entry.
#[derive(Debug)]
pub(crate) struct Reservation {
    owner: u64,
    _layout: Arc<PhysicalLayout>,
}

impl Reservation {
    /// Reserves `layout`'s memory, or says which registered layout's memory it overlaps.
    pub(crate) fn reserve(layout: &Arc<PhysicalLayout>) -> Result<Self> {
        let ranges: Vec<(Space, usize, usize)> = match layout.backing() {
            Backing::Host(a) => a
                .iter()
                .map(|h| {
                    (
                        Space::Memory,
                        h.as_ptr() as usize,
                        h.as_ptr() as usize + h.len(),
                    )
                })
                .collect(),
            Backing::Device(a) => a
                .iter()
                .map(|d| {
                    let start = d.device_addr() as usize;
                    (Space::Memory, start, start + d.size_bytes())
                })
                .collect(),
            Backing::Disk(d) => {
                let p = Arc::as_ptr(d) as usize;
                vec![(Space::Disk, p, p + 1)]
            }
            #[cfg(feature = "object")]
            Backing::Object(_) => Vec::new(),
        };
        let owner = NEXT_OWNER.fetch_add(1, Ordering::Relaxed);
        let mut table = RESERVED.lock();
        for (i, &(space, start, end)) in ranges.iter().enumerate() {
            let clash = table
                .iter()
                .any(|&(s, a, b, _)| s == space && start < b && a < end)
                || ranges[..i]
                    .iter()
                    .any(|&(s, a, b)| s == space && start < b && a < end);
            if clash && start < end {
                return Err(PhysicalError::AliasedLayout(match space {
                    Space::Memory => format!(
                        "memory {start:#x}..{end:#x} overlaps a registered layout (a clone, or a second layout over the same allocation)"
                    ),
                    Space::Disk => "the disk storage backs a registered layout".into(),
                }));
            }
        }
        table.extend(ranges.into_iter().map(|(s, a, b)| (s, a, b, owner)));
        Ok(Reservation {
            owner,
            _layout: Arc::clone(layout),
        })
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        RESERVED.lock().retain(|e| e.3 != self.owner);
    }
}

/// Per-manager claims: `> 0` readers, `-1` one writer. (hashbrown's hasher, not std's SipHash:
/// the keys are our own layout handles and block ids, claimed and released once per block of
/// every transfer.)
#[derive(Debug, Default)]
pub(crate) struct Claims {
    map: Mutex<HashMap<(u64, BlockId), i64>>,
}

/// One claimed block: `(layout, block)` and whether it is a write.
type Claimed = ((u64, BlockId), bool);

impl Claims {
    /// Claims every block of the given sides (`(layout, ids, write, skip)`; object sides are
    /// skipped), all or nothing.
    pub(crate) fn claim(
        self: &Arc<Self>,
        sides: [(LayoutHandle, &[BlockId], bool, bool); 2],
    ) -> Result<(Arc<Claims>, Vec<Claimed>)> {
        let mut map = self.map.lock();
        let mut taken: Vec<Claimed> = Vec::with_capacity(
            sides
                .iter()
                .map(|(_, ids, _, skip)| if *skip { 0 } else { ids.len() })
                .sum(),
        );
        for (h, ids, write, skip) in sides {
            if skip {
                continue;
            }
            for &id in ids {
                let e = map.entry((h.as_u64(), id)).or_insert(0);
                let free = if write { *e == 0 } else { *e >= 0 };
                if !free {
                    Self::release_locked(&mut map, &taken);
                    return Err(PhysicalError::BlockBusy {
                        layout: h,
                        block_id: id,
                    });
                }
                *e = if write { -1 } else { *e + 1 };
                taken.push(((h.as_u64(), id), write));
            }
        }
        Ok((Arc::clone(self), taken))
    }

    fn release_locked(map: &mut HashMap<(u64, BlockId), i64>, taken: &[Claimed]) {
        for (k, write) in taken {
            if let Some(e) = map.get_mut(k) {
                if *write || *e <= 1 {
                    map.remove(k);
                } else {
                    *e -= 1;
                }
            }
        }
    }
}

/// What a running job holds: its block claims and the reservations of its two layouts.
#[derive(Debug)]
pub(crate) struct JobGuard {
    claims: Arc<Claims>,
    taken: Vec<Claimed>,
    _layouts: [Arc<Reservation>; 2],
}

impl JobGuard {
    pub(crate) fn new(
        (claims, taken): (Arc<Claims>, Vec<Claimed>),
        layouts: [Arc<Reservation>; 2],
    ) -> Self {
        JobGuard {
            claims,
            taken,
            _layouts: layouts,
        }
    }
}

impl Drop for JobGuard {
    fn drop(&mut self) {
        Claims::release_locked(&mut self.claims.map.lock(), &self.taken);
    }
}
