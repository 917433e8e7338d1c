//! Allocation-free ordered containers for the cache policies.
//!
//! * [`Links`] + [`List`]: intrusive doubly-linked lists over slot indices (`u32`); a slot is in
//!   at most one list of a `Links` at a time. O(1) push, unlink, move-to-back.
//! * [`LinkedKeySet`]: an insertion-ordered key set with a `u32` value per key (Python's
//!   `OrderedDict` as used for ARC ghost lists and the store-threshold tracker): O(1)
//!   insert-at-back, move-to-back, remove, pop-front, over a slab whose freed nodes are reused.

use hashbrown::HashMap;

use crate::key::OffloadKey;

/// "No slot".
pub(crate) const NIL: u32 = u32::MAX;

#[derive(Clone, Copy)]
struct Link {
    prev: u32,
    next: u32,
}

/// Per-slot links shared by several lists.
pub(crate) struct Links {
    links: Vec<Link>,
}

/// One list's ends and length.
#[derive(Clone, Copy, Debug)]
pub(crate) struct List {
    /// First (least recent) slot.
    pub head: u32,
    /// Last (most recent) slot.
    pub tail: u32,
    /// Number of slots.
    pub len: u32,
}

impl Default for List {
    fn default() -> Self {
        Self {
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }
}

impl Links {
    /// Links for `n` slots.
    pub(crate) fn new(n: usize) -> Self {
        Self {
            links: vec![
                Link {
                    prev: NIL,
                    next: NIL
                };
                n
            ],
        }
    }

    /// Room for slots `0..n` (new slots are in no list); never shrinks.
    pub(crate) fn grow_to(&mut self, n: usize) {
        if n > self.links.len() {
            self.links.resize(
                n,
                Link {
                    prev: NIL,
                    next: NIL,
                },
            );
        }
    }

    /// Appends `i` (not in any list) at the back.
    #[inline]
    pub(crate) fn push_back(&mut self, l: &mut List, i: u32) {
        self.links[i as usize] = Link {
            prev: l.tail,
            next: NIL,
        };
        if l.tail == NIL {
            l.head = i;
        } else {
            self.links[l.tail as usize].next = i;
        }
        l.tail = i;
        l.len += 1;
    }

    /// Inserts `i` (not in any list) before `at` (`NIL` = at the back).
    #[inline]
    pub(crate) fn insert_before(&mut self, l: &mut List, i: u32, at: u32) {
        if at == NIL {
            return self.push_back(l, i);
        }
        let prev = self.links[at as usize].prev;
        self.links[i as usize] = Link { prev, next: at };
        self.links[at as usize].prev = i;
        if prev == NIL {
            l.head = i;
        } else {
            self.links[prev as usize].next = i;
        }
        l.len += 1;
    }

    /// Removes `i` from `l`.
    #[inline]
    pub(crate) fn unlink(&mut self, l: &mut List, i: u32) {
        let Link { prev, next } = self.links[i as usize];
        if prev == NIL {
            l.head = next;
        } else {
            self.links[prev as usize].next = next;
        }
        if next == NIL {
            l.tail = prev;
        } else {
            self.links[next as usize].prev = prev;
        }
        self.links[i as usize] = Link {
            prev: NIL,
            next: NIL,
        };
        l.len -= 1;
    }

    /// Moves `i` (in `l`) to the back.
    #[inline]
    pub(crate) fn move_to_back(&mut self, l: &mut List, i: u32) {
        if l.tail == i {
            return;
        }
        self.unlink(l, i);
        self.push_back(l, i);
    }

    /// The slot after `i`.
    #[inline]
    pub(crate) fn next(&self, i: u32) -> u32 {
        self.links[i as usize].next
    }

    /// The slot before `i`.
    #[inline]
    pub(crate) fn prev(&self, i: u32) -> u32 {
        self.links[i as usize].prev
    }
}

struct Node {
    key: OffloadKey,
    value: u32,
    prev: u32,
    next: u32,
}

/// An insertion-ordered set of keys with a `u32` value each.
#[derive(Default)]
pub(crate) struct LinkedKeySet {
    map: HashMap<OffloadKey, u32>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    head: u32,
    tail: u32,
}

impl LinkedKeySet {
    /// Empty set.
    pub(crate) fn new() -> Self {
        Self {
            map: HashMap::new(),
            nodes: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
        }
    }

    /// Number of keys.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the key is present.
    #[inline]
    pub(crate) fn contains(&self, k: &OffloadKey) -> bool {
        self.map.contains_key(k)
    }

    /// The value of a key.
    #[inline]
    pub(crate) fn get(&self, k: &OffloadKey) -> Option<u32> {
        self.map.get(k).map(|&n| self.nodes[n as usize].value)
    }

    /// Sets the value of a present key.
    #[inline]
    pub(crate) fn set(&mut self, k: &OffloadKey, v: u32) {
        if let Some(&n) = self.map.get(k) {
            self.nodes[n as usize].value = v;
        }
    }

    fn link_back(&mut self, n: u32) {
        self.nodes[n as usize].prev = self.tail;
        self.nodes[n as usize].next = NIL;
        if self.tail == NIL {
            self.head = n;
        } else {
            self.nodes[self.tail as usize].next = n;
        }
        self.tail = n;
    }

    fn unlink(&mut self, n: u32) {
        let (prev, next) = (self.nodes[n as usize].prev, self.nodes[n as usize].next);
        if prev == NIL {
            self.head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.nodes[next as usize].prev = prev;
        }
    }

    /// Inserts at the back; a present key keeps its place and gets the new value
    /// (`OrderedDict[key] = value`).
    pub(crate) fn insert(&mut self, k: OffloadKey, v: u32) {
        if let Some(&n) = self.map.get(&k) {
            self.nodes[n as usize].value = v;
            return;
        }
        let node = Node {
            key: k,
            value: v,
            prev: NIL,
            next: NIL,
        };
        let n = match self.free.pop() {
            Some(n) => {
                self.nodes[n as usize] = node;
                n
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.map.insert(k, n);
        self.link_back(n);
    }

    /// Moves a present key to the back; returns whether it was present.
    pub(crate) fn move_to_back(&mut self, k: &OffloadKey) -> bool {
        let Some(&n) = self.map.get(k) else {
            return false;
        };
        if self.tail != n {
            self.unlink(n);
            self.link_back(n);
        }
        true
    }

    /// Removes a key; returns its value.
    pub(crate) fn remove(&mut self, k: &OffloadKey) -> Option<u32> {
        let n = self.map.remove(k)?;
        self.unlink(n);
        self.free.push(n);
        Some(self.nodes[n as usize].value)
    }

    /// Removes and returns the front key.
    pub(crate) fn pop_front(&mut self) -> Option<(OffloadKey, u32)> {
        if self.head == NIL {
            return None;
        }
        let n = self.head;
        let key = self.nodes[n as usize].key;
        let v = self.nodes[n as usize].value;
        self.map.remove(&key);
        self.unlink(n);
        self.free.push(n);
        Some((key, v))
    }

    /// Keys front (oldest) to back.
    pub(crate) fn iter(&self) -> impl Iterator<Item = OffloadKey> + '_ {
        let mut n = self.head;
        std::iter::from_fn(move || {
            if n == NIL {
                return None;
            }
            let node = &self.nodes[n as usize];
            n = node.next;
            Some(node.key)
        })
    }

    /// Empties the set.
    pub(crate) fn clear(&mut self) {
        self.map.clear();
        self.nodes.clear();
        self.free.clear();
        self.head = NIL;
        self.tail = NIL;
    }
}
