//! Orphan-first: prefix awareness over any policy. A block whose parent was evicted is the next
//! victim.
//!
//! A prefix match stops at the first missing block, so once a parent leaves the tier its
//! cached descendants cannot be served (until the parent is registered again): they only hold
//! slots. The base policy does not know that; this wrapper does. It links every registered block
//! to its cached parent (found through the parent fragment and position carried in its
//! [`SequenceHash`](crate::SequenceHash), as [`lineage`](super::lineage) does) and, when a
//! block leaves (a victim, or removed by someone else), marks its cached children *orphans*.
//! Evictable orphans wait in an orphan FIFO that is evicted before the base's order, so a dead
//! subtree is consumed level by level (an evicted orphan's own children become orphans) before
//! the base gives up a live block. Everything else is the base's choice: the base sees every
//! call, and an orphan taken from the FIFO is [`remove`](super::Eviction::remove)d from it.
//!
//! ```text
//!   evict P ──▶ children of P: ORPHAN ──▶ evictable ones join the orphan FIFO
//!   pop_victim ──▶ orphan FIFO (first unprotected, removable) ──▶ else the base's victim
//!   orphan revived (a re-registration of its hash found it) ──▶ adopted again if its parent
//!                                                               is cached
//! ```
//!
//! A block registered while its parent is not cached is not an orphan (tiers may receive a
//! chain out of order); only a parent's departure makes one. Undo (`restore`) re-links the
//! parent's children and puts an orphan back at the front of the FIFO.
//!
//! Cost over the base: one map insert per registration and one map removal per eviction (the
//! `lineage_key` → slot index), plus a walk over the evicted block's direct children.

use hashbrown::{DefaultHashBuilder, HashMap};

use super::list::{Lists, NIL};
use super::{Eviction, EvictionCtx, SlotStatus};

/// Registered and not removed.
const REGISTERED: u8 = 1;
/// Released and not revived.
const INACTIVE: u8 = 2;
/// Its parent left the tier.
const ORPHAN: u8 = 4;
/// The key index pointed at this slot when it was removed.
const KEYED: u8 = 8;
/// It was in the orphan FIFO when removed.
const FROM_ORPHANS: u8 = 16;

#[derive(Copy, Clone, Debug)]
struct Node {
    parent: u32,
    first_child: u32,
    next_sibling: u32,
    prev_sibling: u32,
    flags: u8,
}

const EMPTY: Node = Node {
    parent: NIL,
    first_child: NIL,
    next_sibling: NIL,
    prev_sibling: NIL,
    flags: 0,
};

/// Orphans first, then the base policy's order.
#[derive(Debug)]
pub struct OrphanFirst<B> {
    base: B,
    orphans: Lists<1>,
    nodes: Vec<Node>,
    map: HashMap<u64, u32, DefaultHashBuilder>,
}

impl<B: Eviction> OrphanFirst<B> {
    /// Wraps `base` (for slots `0..capacity`).
    pub fn new(base: B, capacity: usize) -> Self {
        Self {
            base,
            orphans: Lists::new(capacity),
            nodes: vec![EMPTY; capacity],
            map: HashMap::with_capacity_and_hasher(capacity, DefaultHashBuilder::default()),
        }
    }

    /// The base policy.
    pub fn base(&self) -> &B {
        &self.base
    }

    /// Evictable orphans waiting to go first.
    pub fn orphan_len(&self) -> usize {
        self.orphans.len(0)
    }

    /// Whether `slot` is registered and its parent left the tier.
    pub fn is_orphan(&self, slot: u32) -> bool {
        let f = self.nodes[slot as usize].flags;
        f & REGISTERED != 0 && f & ORPHAN != 0
    }

    fn link_child(&mut self, p: u32, c: u32) {
        let head = self.nodes[p as usize].first_child;
        {
            let n = &mut self.nodes[c as usize];
            n.parent = p;
            n.prev_sibling = NIL;
            n.next_sibling = head;
        }
        if head != NIL {
            self.nodes[head as usize].prev_sibling = c;
        }
        self.nodes[p as usize].first_child = c;
    }

    /// Unlinks `c` from its parent's child list; `c.parent` is kept (for `restore`).
    fn unlink_child(&mut self, c: u32) {
        let Node {
            parent,
            prev_sibling,
            next_sibling,
            ..
        } = self.nodes[c as usize];
        if prev_sibling != NIL {
            self.nodes[prev_sibling as usize].next_sibling = next_sibling;
        } else {
            self.nodes[parent as usize].first_child = next_sibling;
        }
        if next_sibling != NIL {
            self.nodes[next_sibling as usize].prev_sibling = prev_sibling;
        }
    }

    /// The cached parent of `slot`'s hash, if any.
    fn find_parent(&self, slot: u32, ctx: &EvictionCtx<'_>) -> u32 {
        match ctx.hash(slot).parent_lineage_key() {
            Some(pk) => match self.map.get(&pk) {
                Some(&p) if p != slot => p,
                _ => NIL,
            },
            None => NIL,
        }
    }

    /// `s` leaves the tier: out of the FIFO and the index, off its parent, children orphaned.
    fn detach(&mut self, s: u32, ctx: &EvictionCtx<'_>) {
        let from_orphans = self.orphans.unlink(s).is_some();
        let key = ctx.hash(s).lineage_key();
        let keyed = self.map.get(&key) == Some(&s);
        if keyed {
            self.map.remove(&key);
        }
        if self.nodes[s as usize].parent != NIL {
            self.unlink_child(s);
        }
        let mut c = self.nodes[s as usize].first_child;
        while c != NIL {
            let n = &mut self.nodes[c as usize];
            n.parent = NIL;
            n.flags |= ORPHAN;
            let evictable = n.flags & INACTIVE != 0;
            let next = n.next_sibling;
            if evictable {
                self.orphans.push_back(c, 0);
            }
            c = next;
        }
        let n = &mut self.nodes[s as usize];
        n.flags &= !(REGISTERED | KEYED | FROM_ORPHANS);
        if keyed {
            n.flags |= KEYED;
        }
        if from_orphans {
            n.flags |= FROM_ORPHANS;
        }
    }
}

impl<B: Eviction> Eviction for OrphanFirst<B> {
    fn on_register(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        let parent = self.find_parent(slot, ctx);
        self.nodes[slot as usize] = Node {
            flags: REGISTERED,
            ..EMPTY
        };
        if parent != NIL {
            self.link_child(parent, slot);
        }
        self.map.insert(ctx.hash(slot).lineage_key(), slot);
        self.base.on_register(slot, ctx);
    }

    #[inline]
    fn on_release(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        let n = &mut self.nodes[slot as usize];
        n.flags |= INACTIVE;
        if n.flags & ORPHAN != 0 {
            self.orphans.push_back(slot, 0);
        }
        self.base.on_release(slot, ctx);
    }

    #[inline]
    fn on_acquire(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        let n = &mut self.nodes[slot as usize];
        n.flags &= !INACTIVE;
        if n.flags & ORPHAN != 0 {
            self.orphans.unlink(slot);
            // revived: its hash was asked for again; adopt it if its parent is back
            let parent = self.find_parent(slot, ctx);
            if parent != NIL {
                self.nodes[slot as usize].flags &= !ORPHAN;
                self.link_child(parent, slot);
            }
        }
        self.base.on_acquire(slot, ctx);
    }

    #[inline]
    fn on_hit(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        self.base.on_hit(slot, ctx);
    }

    fn on_touch(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        self.base.on_touch(slot, ctx);
    }

    fn on_hint(&mut self, slot: u32, next_use: u64, ctx: &EvictionCtx<'_>) {
        self.base.on_hint(slot, next_use, ctx);
    }

    fn can_remove(&self, slot: u32) -> bool {
        self.base.can_remove(slot)
    }

    #[inline]
    fn pop_victim(
        &mut self,
        ctx: &EvictionCtx<'_>,
        protected: &impl Fn(u32) -> bool,
    ) -> Option<u32> {
        if self.orphans.len(0) > 0 {
            let base = &self.base;
            if let Some(s) = self
                .orphans
                .first_unskipped(0, &|s| protected(s) || !base.can_remove(s))
            {
                self.base.remove(s, ctx);
                self.detach(s, ctx);
                return Some(s);
            }
        }
        let s = self.base.pop_victim(ctx, protected)?;
        self.detach(s, ctx);
        Some(s)
    }

    fn remove(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        self.base.remove(slot, ctx);
        self.detach(slot, ctx);
    }

    fn restore(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        // the children it orphaned: still chained from it (nothing ran in between)
        let mut c = self.nodes[slot as usize].first_child;
        while c != NIL {
            let n = &mut self.nodes[c as usize];
            n.parent = slot;
            n.flags &= !ORPHAN;
            let next = n.next_sibling;
            self.orphans.unlink(c);
            c = next;
        }
        let node = self.nodes[slot as usize];
        if node.parent != NIL {
            self.link_child(node.parent, slot);
        }
        if node.flags & KEYED != 0 {
            self.map.insert(ctx.hash(slot).lineage_key(), slot);
        }
        let n = &mut self.nodes[slot as usize];
        n.flags = (n.flags | REGISTERED) & !(KEYED | FROM_ORPHANS);
        if node.flags & FROM_ORPHANS != 0 {
            self.orphans.push_front(slot, 0);
        }
        self.base.restore(slot, ctx);
    }

    fn check(&self, status: &dyn Fn(u32) -> SlotStatus) -> Result<(), String> {
        self.orphans.check()?;
        let mut linked = vec![0u32; self.nodes.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            let s = i as u32;
            let st = status(s);
            let registered = n.flags & REGISTERED != 0;
            if registered != (st != SlotStatus::Unregistered) {
                return Err(format!("orphan-first slot {s}: registered flag vs {st:?}"));
            }
            let listed = self.orphans.is_listed(s);
            if !registered {
                if listed {
                    return Err(format!("orphan-first slot {s} listed while unregistered"));
                }
                continue;
            }
            if (n.flags & INACTIVE != 0) != (st == SlotStatus::Evictable) {
                return Err(format!("orphan-first slot {s}: inactive flag vs {st:?}"));
            }
            if listed != (n.flags & ORPHAN != 0 && n.flags & INACTIVE != 0) {
                return Err(format!(
                    "orphan-first slot {s}: listed {listed}, flags {:#x}",
                    n.flags
                ));
            }
            if n.flags & ORPHAN != 0 && n.parent != NIL {
                return Err(format!("orphan-first slot {s}: an orphan with a parent"));
            }
            if n.parent != NIL {
                let p = &self.nodes[n.parent as usize];
                if p.flags & REGISTERED == 0 {
                    return Err(format!(
                        "orphan-first slot {s}: parent {} not registered",
                        n.parent
                    ));
                }
                linked[i] += 1;
            }
        }
        // every registered child is chained from its parent exactly once
        for (i, n) in self.nodes.iter().enumerate() {
            if n.flags & REGISTERED == 0 {
                continue;
            }
            let mut c = n.first_child;
            let mut prev = NIL;
            while c != NIL {
                let cn = &self.nodes[c as usize];
                if cn.parent != i as u32 || cn.prev_sibling != prev {
                    return Err(format!("orphan-first slot {i}: bad child chain at {c}"));
                }
                if linked[c as usize] == 0 {
                    return Err(format!("orphan-first slot {c} chained twice"));
                }
                linked[c as usize] -= 1;
                prev = c;
                c = cn.next_sibling;
            }
        }
        if let Some(s) = linked.iter().position(|&l| l != 0) {
            return Err(format!("orphan-first slot {s} not in its parent's chain"));
        }
        self.base.check(status)
    }
}
