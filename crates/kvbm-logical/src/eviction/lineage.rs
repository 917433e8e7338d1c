//! Lineage (prefix-aware, leaf-first): never evict a block whose child is still cached.
//!
//! A prefix match stops at the first missing block, so a block is worth nothing once its
//! parent is gone, and evicting a parent before its children wastes them. Each registered
//! block is linked to its cached parent (found through the parent fragment and position
//! carried in its [`SequenceHash`](crate::SequenceHash)); only evictable blocks with no cached
//! child are listed, least recently released first. Evicting a parent's last child queues the
//! parent (if evictable) as the next victim, so stale chains are consumed tail first.
//!
//! An evictable parent of an active block is never evicted, so fewer blocks may be evictable
//! than are inactive; allocation then fails cleanly (and restores what it took).

use hashbrown::{DefaultHashBuilder, HashMap};

use super::list::{Lists, NIL};
use super::{Eviction, EvictionCtx, SlotStatus};

#[derive(Copy, Clone, Debug)]
struct Node {
    parent: u32,
    children: u32,
    /// Released and not revived (as far as this policy was told).
    inactive: bool,
    /// Registered and not removed.
    registered: bool,
    /// The lineage map pointed at this slot when it was removed (restore puts it back).
    keyed: bool,
}

/// Leaves first, least recently released leaf first.
#[derive(Clone, Debug)]
pub struct Lineage {
    lists: Lists<1>,
    nodes: Vec<Node>,
    map: HashMap<u64, u32, DefaultHashBuilder>,
}

impl Lineage {
    /// An empty order for slots `0..capacity`.
    pub fn new(capacity: usize) -> Self {
        Self {
            lists: Lists::new(capacity),
            nodes: vec![
                Node {
                    parent: NIL,
                    children: 0,
                    inactive: false,
                    registered: false,
                    keyed: false,
                };
                capacity
            ],
            map: HashMap::with_capacity_and_hasher(capacity, DefaultHashBuilder::default()),
        }
    }

    /// The slot's cached children (for tests).
    pub fn children(&self, slot: u32) -> u32 {
        self.nodes[slot as usize].children
    }

    fn detach(&mut self, s: u32, ctx: &EvictionCtx<'_>) {
        self.lists.unlink(s);
        let key = ctx.hash(s).lineage_key();
        let keyed = self.map.get(&key) == Some(&s);
        if keyed {
            self.map.remove(&key);
        }
        let node = &mut self.nodes[s as usize];
        node.keyed = keyed;
        node.registered = false;
        let parent = node.parent;
        if parent != NIL {
            let p = &mut self.nodes[parent as usize];
            p.children -= 1;
            if p.children == 0 && p.inactive && p.registered {
                // the freed parent is the next victim: stale chains go tail first
                self.lists.push_front(parent, 0);
            }
        }
    }
}

impl Eviction for Lineage {
    fn on_register(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        let hash = ctx.hash(slot);
        let mut parent = NIL;
        if let Some(pk) = hash.parent_lineage_key()
            && let Some(&p) = self.map.get(&pk)
            && p != slot
        {
            parent = p;
            let ps = &mut self.nodes[p as usize];
            ps.children += 1;
            if ps.children == 1 {
                // no longer a leaf
                self.lists.unlink(p);
            }
        }
        self.nodes[slot as usize] = Node {
            parent,
            children: 0,
            inactive: false,
            registered: true,
            keyed: false,
        };
        self.map.insert(hash.lineage_key(), slot);
    }

    #[inline]
    fn on_release(&mut self, slot: u32, _ctx: &EvictionCtx<'_>) {
        let node = &mut self.nodes[slot as usize];
        node.inactive = true;
        if node.children == 0 {
            self.lists.push_back(slot, 0);
        }
    }

    #[inline]
    fn on_acquire(&mut self, slot: u32, _ctx: &EvictionCtx<'_>) {
        self.nodes[slot as usize].inactive = false;
        self.lists.unlink(slot);
    }

    fn on_touch(&mut self, slot: u32, _ctx: &EvictionCtx<'_>) {
        if self.lists.unlink(slot).is_some() {
            self.lists.push_back(slot, 0);
        }
    }

    #[inline]
    fn can_remove(&self, slot: u32) -> bool {
        self.nodes[slot as usize].children == 0
    }

    #[inline]
    fn pop_victim(
        &mut self,
        ctx: &EvictionCtx<'_>,
        protected: &impl Fn(u32) -> bool,
    ) -> Option<u32> {
        let s = self.lists.first_unskipped(0, protected)?;
        self.detach(s, ctx);
        Some(s)
    }

    fn remove(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        self.detach(slot, ctx);
    }

    fn restore(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        let node = self.nodes[slot as usize];
        if node.keyed {
            self.map.insert(ctx.hash(slot).lineage_key(), slot);
        }
        if node.parent != NIL {
            let p = &mut self.nodes[node.parent as usize];
            p.children += 1;
            if p.children == 1 {
                self.lists.unlink(node.parent);
            }
        }
        let n = &mut self.nodes[slot as usize];
        n.registered = true;
        if n.inactive && n.children == 0 {
            self.lists.push_front(slot, 0);
        }
    }

    fn check(&self, status: &dyn Fn(u32) -> SlotStatus) -> Result<(), String> {
        self.lists.check()?;
        let mut children = vec![0u32; self.nodes.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            if n.registered && n.parent != NIL {
                children[n.parent as usize] += 1;
            }
            let _ = i;
        }
        for (i, n) in self.nodes.iter().enumerate() {
            let s = i as u32;
            let st = status(s);
            if n.registered != (st != SlotStatus::Unregistered) {
                return Err(format!("lineage slot {s}: registered flag vs {st:?}"));
            }
            if !n.registered {
                if self.lists.is_listed(s) {
                    return Err(format!("lineage slot {s} listed while unregistered"));
                }
                continue;
            }
            if n.children != children[i] {
                return Err(format!(
                    "lineage slot {s}: {} children counted, {} linked",
                    n.children, children[i]
                ));
            }
            if n.inactive && st != SlotStatus::Evictable {
                return Err(format!("lineage slot {s} inactive while {st:?}"));
            }
            let should_list = n.inactive && n.children == 0;
            if should_list != self.lists.is_listed(s) {
                return Err(format!(
                    "lineage slot {s}: {} children, inactive {}, listed {}",
                    n.children,
                    n.inactive,
                    self.lists.is_listed(s)
                ));
            }
        }
        Ok(())
    }
}
