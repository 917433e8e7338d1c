//! Index-based intrusive doubly-linked lists over slot ids, shared by the list policies.
//!
//! `K` lists live in one `Vec` of links (one per slot, allocated once): a slot is in at most
//! one list at a time. Every operation is O(1) and allocation-free.

pub(crate) const NIL: u32 = u32::MAX;
const UNLISTED: u8 = u8::MAX;

#[derive(Copy, Clone, Debug)]
struct Link {
    prev: u32,
    next: u32,
    list: u8,
}

/// `K` intrusive lists over slots `0..n`.
#[derive(Clone, Debug)]
pub(crate) struct Lists<const K: usize> {
    links: Vec<Link>,
    heads: [u32; K],
    tails: [u32; K],
    lens: [usize; K],
}

impl<const K: usize> Lists<K> {
    pub(crate) fn new(n: usize) -> Self {
        Self {
            links: vec![
                Link {
                    prev: NIL,
                    next: NIL,
                    list: UNLISTED,
                };
                n
            ],
            heads: [NIL; K],
            tails: [NIL; K],
            lens: [0; K],
        }
    }

    /// The list holding `s`, if any.
    #[inline]
    pub(crate) fn list_of(&self, s: u32) -> Option<usize> {
        let l = self.links[s as usize].list;
        (l != UNLISTED).then_some(l as usize)
    }

    #[inline]
    pub(crate) fn is_listed(&self, s: u32) -> bool {
        self.links[s as usize].list != UNLISTED
    }

    #[inline]
    pub(crate) fn head(&self, l: usize) -> u32 {
        self.heads[l]
    }

    #[inline]
    pub(crate) fn next(&self, s: u32) -> u32 {
        self.links[s as usize].next
    }

    #[inline]
    pub(crate) fn len(&self, l: usize) -> usize {
        self.lens[l]
    }

    #[inline]
    pub(crate) fn push_back(&mut self, s: u32, l: usize) {
        debug_assert!(!self.is_listed(s));
        let tail = self.tails[l];
        self.links[s as usize] = Link {
            prev: tail,
            next: NIL,
            list: l as u8,
        };
        if tail == NIL {
            self.heads[l] = s;
        } else {
            self.links[tail as usize].next = s;
        }
        self.tails[l] = s;
        self.lens[l] += 1;
    }

    #[inline]
    pub(crate) fn push_front(&mut self, s: u32, l: usize) {
        debug_assert!(!self.is_listed(s));
        let head = self.heads[l];
        self.links[s as usize] = Link {
            prev: NIL,
            next: head,
            list: l as u8,
        };
        if head == NIL {
            self.tails[l] = s;
        } else {
            self.links[head as usize].prev = s;
        }
        self.heads[l] = s;
        self.lens[l] += 1;
    }

    /// Inserts `s` right before `before` (which must be listed in `l`).
    pub(crate) fn insert_before(&mut self, s: u32, before: u32, l: usize) {
        let prev = self.links[before as usize].prev;
        self.links[s as usize] = Link {
            prev,
            next: before,
            list: l as u8,
        };
        self.links[before as usize].prev = s;
        if prev == NIL {
            self.heads[l] = s;
        } else {
            self.links[prev as usize].next = s;
        }
        self.lens[l] += 1;
    }

    /// Removes `s` from its list; returns the list it was in.
    #[inline]
    pub(crate) fn unlink(&mut self, s: u32) -> Option<usize> {
        let Link { prev, next, list } = self.links[s as usize];
        if list == UNLISTED {
            return None;
        }
        self.links[s as usize] = Link {
            prev: NIL,
            next: NIL,
            list: UNLISTED,
        };
        let l = list as usize;
        if prev == NIL {
            self.heads[l] = next;
        } else {
            self.links[prev as usize].next = next;
        }
        if next == NIL {
            self.tails[l] = prev;
        } else {
            self.links[next as usize].prev = prev;
        }
        self.lens[l] -= 1;
        Some(l)
    }

    /// The first slot of list `l`, from the head, for which `skip` is false.
    #[inline]
    pub(crate) fn first_unskipped(&self, l: usize, skip: &impl Fn(u32) -> bool) -> Option<u32> {
        let mut s = self.heads[l];
        while s != NIL {
            if !skip(s) {
                return Some(s);
            }
            s = self.links[s as usize].next;
        }
        None
    }

    /// Walks every list; checks links, lengths and list tags. Returns the number listed.
    pub(crate) fn check(&self) -> Result<usize, String> {
        let mut walked = 0;
        for l in 0..K {
            let mut s = self.heads[l];
            let mut prev = NIL;
            let mut n = 0;
            while s != NIL {
                let link = &self.links[s as usize];
                if link.prev != prev || link.list as usize != l {
                    return Err(format!("list {l} is corrupt at slot {s}"));
                }
                n += 1;
                if n > self.links.len() {
                    return Err(format!("list {l} has a cycle"));
                }
                prev = s;
                s = link.next;
            }
            if self.tails[l] != prev {
                return Err(format!("list {l} tail is wrong"));
            }
            if self.lens[l] != n {
                return Err(format!("list {l} length {} but {n} walked", self.lens[l]));
            }
            walked += n;
        }
        let flagged = self.links.iter().filter(|k| k.list != UNLISTED).count();
        if walked != flagged {
            return Err(format!("walked {walked} listed slots, flagged {flagged}"));
        }
        Ok(walked)
    }
}
