//! [`TierKeys`]: what a physical tier knows of each key, and its ready keys' eviction order,
//! in one slab found by one index probe.
//!
//! # Why one slab
//!
//! A disk or object tier's bookkeeping runs on the scheduler thread, once per chunk stored:
//! a lookup, the store's admission, an eviction for room, the store's completion. With the
//! key's state in one map and the eviction order in another (a second map keyed by the same
//! 40-byte key), a chunk stored cost about eight probes of two tables of a full tier's size,
//! nearly all of them cache misses. Here a key is probed once per call that names it; the
//! node it finds holds the state, the eviction order is threaded through the nodes, and a job
//! keeps its keys' nodes, so its completion probes nothing. A Ready node's `B` is whatever the
//! tier keeps with a readable key (the tier's block and the key's digest, the identity every
//! move of the key carries, so a key is digested once, not again at each load):
//!
//! ```text
//!   key ─► SlotIndex (4-byte node ids) ─► keys[n] == key ?
//!                                          nodes[n] { block, readers }
//!                                          links[n] ─ ready order: oldest ◄──► newest
//! ```
//!
//! # Invariants
//!
//! - A node is live (in the index, not on the free list) from [`TierKeys::insert`] to
//!   [`TierKeys::remove`]; `keys[n]` is its key meanwhile.
//! - A node is in the ready order exactly while its block is `Some` (the key is Ready).
//! - The tier removes a Writing node (block `None`) only when its store settles or fails to
//!   start, and a node with readers only once they are gone: so the node ids a job keeps stay
//!   the job's keys' until the job is finished.

use crate::cpu::index::SlotIndex;
use crate::cpu::order::{Links, List, NIL};
use crate::key::OffloadKey;

/// A key's state in a physical tier.
pub(super) struct Node<B> {
    /// The registered block while the key is Ready; `None` while it is being written.
    pub block: Option<B>,
    /// Loads in flight reading the key's block (it is not evicted or dropped meanwhile).
    pub readers: u32,
}

/// The keys of a physical tier, each Ready one holding a block `B` (the tier's
/// `ImmutableBlock<T>`): see the [module docs](self).
pub(super) struct TierKeys<B> {
    index: SlotIndex,
    keys: Vec<OffloadKey>,
    nodes: Vec<Option<Node<B>>>,
    links: Links,
    ready: List,
    free: Vec<u32>,
}

impl<B> TierKeys<B> {
    /// Room for `n` keys before anything grows.
    pub(super) fn with_capacity(n: usize) -> Self {
        Self {
            index: SlotIndex::with_capacity(n),
            keys: Vec::with_capacity(n),
            nodes: Vec::with_capacity(n),
            links: Links::new(n),
            ready: List::default(),
            free: Vec::new(),
        }
    }

    /// The node of `k`, if the tier knows it.
    #[inline]
    pub(super) fn find(&self, k: &OffloadKey) -> Option<u32> {
        self.index.get(&self.keys, k)
    }

    /// Node `n`'s state.
    ///
    /// # Panics
    /// If `n` is not live.
    #[inline]
    pub(super) fn node(&self, n: u32) -> &Node<B> {
        self.nodes[n as usize].as_ref().expect("a live node")
    }

    /// Node `n`'s state, to change its readers.
    ///
    /// # Panics
    /// If `n` is not live.
    #[inline]
    pub(super) fn node_mut(&mut self, n: u32) -> &mut Node<B> {
        self.nodes[n as usize].as_mut().expect("a live node")
    }

    /// Node `n`'s key.
    #[inline]
    pub(super) fn key(&self, n: u32) -> &OffloadKey {
        &self.keys[n as usize]
    }

    /// Adds `k`, which the tier does not know: Writing when `block`
    /// is `None`, else Ready (the newest in the eviction order). Returns its node.
    pub(super) fn insert(&mut self, k: OffloadKey, block: Option<B>) -> u32 {
        debug_assert!(
            self.find(&k).is_none(),
            "a key is inserted only while absent"
        );
        let ready = block.is_some();
        let node = Node { block, readers: 0 };
        let n = match self.free.pop() {
            Some(n) => {
                self.keys[n as usize] = k;
                self.nodes[n as usize] = Some(node);
                n
            }
            None => {
                let n = u32::try_from(self.nodes.len()).expect("fewer than 2^32 keys");
                self.keys.push(k);
                self.nodes.push(Some(node));
                self.links.grow_to(self.nodes.len());
                n
            }
        };
        self.index.insert(&self.keys, &k, n);
        if ready {
            self.links.push_back(&mut self.ready, n);
        }
        n
    }

    /// Writing → Ready: node `n` holds `block` and becomes the newest in the eviction order.
    pub(super) fn set_ready(&mut self, n: u32, block: B) {
        let node = self.nodes[n as usize].as_mut().expect("a live node");
        let was_ready = node.block.replace(block).is_some();
        if !was_ready {
            self.links.push_back(&mut self.ready, n);
        }
    }

    /// Forgets node `n`'s key; returns its state (dropping it releases the block).
    pub(super) fn remove(&mut self, n: u32) -> Node<B> {
        let node = self.nodes[n as usize].take().expect("a live node");
        if node.block.is_some() {
            self.links.unlink(&mut self.ready, n);
        }
        let removed = self.index.remove(&self.keys, &self.keys[n as usize]);
        debug_assert_eq!(removed, Some(n));
        self.free.push(n);
        node
    }

    /// Makes Ready node `n` the newest in the eviction order (a Writing one has no place in it).
    pub(super) fn touch(&mut self, n: u32) {
        if self.node(n).block.is_some() {
            self.links.move_to_back(&mut self.ready, n);
        }
    }

    /// The oldest Ready node nobody is reading: the next to give way for room.
    pub(super) fn oldest_unread(&self) -> Option<u32> {
        let mut n = self.ready.head;
        while n != NIL {
            if self.node(n).readers == 0 {
                return Some(n);
            }
            n = self.links.next(n);
        }
        None
    }

    /// Keys the tier knows (Ready or Writing).
    pub(super) fn len(&self) -> usize {
        self.index.len()
    }

    /// Ready keys.
    pub(super) fn num_ready(&self) -> usize {
        self.ready.len as usize
    }

    /// Ready nodes, oldest first (at most one more than there are nodes: a broken list
    /// shows as a wrong order, not a walk that never ends).
    #[cfg(test)]
    pub(super) fn ready_order(&self) -> Vec<u32> {
        let mut out = Vec::new();
        let mut n = self.ready.head;
        while n != NIL && out.len() <= self.nodes.len() {
            out.push(n);
            n = self.links.next(n);
        }
        out
    }

    /// Forgets every key (their blocks are released); the capacity stays.
    pub(super) fn clear(&mut self) {
        self.index.clear();
        self.keys.clear();
        self.nodes.clear();
        self.free.clear();
        self.links = Links::new(self.nodes.capacity());
        self.ready = List::default();
    }
}

#[cfg(test)]
mod tests;
