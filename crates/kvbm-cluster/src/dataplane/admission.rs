//! Who the data-plane server lets in, and how many: strangers on a short leash, slots kept for
//! members.
//!
//! # Why
//!
//! A connection costs the server a task, a socket and, with security on, a handshake. Before
//! this module a connection took one of the `max_connections` slots the moment it was
//! accepted and kept it for the whole handshake deadline, and the per-peer cap was keyed on
//! the IP address: eight loopback addresses × 32 silent sockets filled all 256 slots and a
//! member's pull was refused until they closed. Now a connection passes three gates:
//!
//! 1. **The accept rate** ([`Admission::accept`]): at most `accept_rate` new connections per
//!    second from one address prefix (a token bucket with as many tokens as its rate; an
//!    IPv4 address is its own prefix, an IPv6 address counts by its /64, the block one host
//!    is usually given). One more is closed at once
//!    ([`ServerStats::accepts_throttled`](super::ServerStats::accepts_throttled)).
//! 2. **The pending pool** (security on; [`Admission::pending`]): a connection that has not
//!    authenticated holds one of `max_pending` pending places, separate from the members'
//!    slots, for at most `handshake_deadline`. When the pool is full the **oldest** pending
//!    connection is dropped to make room
//!    ([`ServerStats::pending_evicted`](super::ServerStats::pending_evicted)), so strangers
//!    who hold sockets open can only delay a member's handshake, which finishes in a round
//!    trip or two, by opening `max_pending` new ones within that time, which the accept rate
//!    bounds.
//! 3. **The member slots** ([`Admission::admit`]): at most `max_connections` connections served
//!    at once and at most `max_connections_per_peer` per peer, where a peer is the member the
//!    handshake proved (its certificate's instance), not its address: two members behind one
//!    address each get their own share, and a member cannot dodge the cap with more
//!    addresses. With security off there is no proof and no pending stage: a peer is its
//!    address prefix and a connection is admitted (or closed) as soon as it is accepted.
//!
//! # Ownership and locks
//!
//! A place is an RAII value: [`Pending`] leaves the pool on drop (or was already taken out by
//! an eviction, which also cancels its token), [`Slot`] gives its member slot back on drop.
//! One `parking_lot` mutex guards all three gates' state; it is a leaf, held only for a few
//! map operations, never across an `.await`.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

use super::ServerStats;
use kvbm_engine::InstanceId;

/// The admission limits (from [`DataPlaneConfig`](super::DataPlaneConfig)); each at least 1.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Limits {
    pub max_connections: usize,
    pub max_per_peer: usize,
    pub max_pending: usize,
    /// New connections per second from one address prefix (also the bucket's depth).
    pub accept_rate: u32,
}

/// Whom a member slot is counted under.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum PeerKey {
    /// The member a handshake proved (security on).
    Member(InstanceId),
    /// An address prefix ([`address_key`]; security off).
    Address(IpAddr),
}

/// The prefix an address is counted under: an IPv4 address itself (also when written as an
/// IPv4-mapped IPv6 address), an IPv6 address by its /64.
pub(crate) fn address_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into()),
        },
    }
}

/// Why a proven member (or, security off, an accepted connection) got no slot.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Full {
    /// `max_connections` are served.
    All,
    /// `max_connections_per_peer` of this peer's are served.
    Peer,
}

impl std::fmt::Display for Full {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Full::All => "at the connection cap (transport.max_connections)",
            Full::Peer => "at the per-peer cap (transport.max_connections_per_peer)",
        })
    }
}

struct Bucket {
    tokens: f64,
    at: Instant,
}

/// Buckets kept before full ones (which carry no state) are dropped.
const MAX_BUCKETS: usize = 4096;

#[derive(Default)]
struct State {
    per_peer: HashMap<PeerKey, usize>,
    served: usize,
    /// Pending connections, oldest first: their id and the token that ends them.
    pending: VecDeque<(u64, CancellationToken)>,
    next_pending: u64,
    buckets: HashMap<IpAddr, Bucket>,
}

/// The three gates of one server: see the [module docs](self).
pub(crate) struct Admission {
    limits: Limits,
    state: Mutex<State>,
    stats: Arc<ServerStats>,
}

impl Admission {
    pub(crate) fn new(limits: Limits, stats: Arc<ServerStats>) -> Self {
        Self {
            limits: Limits {
                max_connections: limits.max_connections.max(1),
                max_per_peer: limits.max_per_peer.max(1),
                max_pending: limits.max_pending.max(1),
                accept_rate: limits.accept_rate.max(1),
            },
            state: Mutex::new(State::default()),
            stats,
        }
    }

    /// Gate 1: whether a connection from `ip` accepted at `now` is within its prefix's
    /// accept rate (counted and logged when not).
    pub(crate) fn accept(&self, ip: IpAddr, now: Instant) -> bool {
        let rate = f64::from(self.limits.accept_rate);
        let key = address_key(ip);
        let mut st = self.state.lock();
        if st.buckets.len() >= MAX_BUCKETS && !st.buckets.contains_key(&key) {
            st.buckets.retain(|_, b| {
                b.tokens + now.saturating_duration_since(b.at).as_secs_f64() * rate < rate
            });
        }
        let b = st.buckets.entry(key).or_insert(Bucket {
            tokens: rate,
            at: now,
        });
        b.tokens = (b.tokens + now.saturating_duration_since(b.at).as_secs_f64() * rate).min(rate);
        b.at = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            return true;
        }
        drop(st);
        self.stats.accepts_throttled.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(kvbm_engine::metrics::DATAPLANE_ACCEPTS_THROTTLED).increment(1);
        tracing::debug!(%ip, "data plane connection refused: over its accept rate");
        false
    }

    /// Gate 2: a pending place for a connection still to authenticate, dropping the oldest
    /// pending connection when the pool is full (its token is cancelled; counted).
    pub(crate) fn pending(self: &Arc<Self>) -> Pending {
        let token = CancellationToken::new();
        let mut st = self.state.lock();
        let evicted = if st.pending.len() >= self.limits.max_pending {
            st.pending.pop_front()
        } else {
            None
        };
        let id = st.next_pending;
        st.next_pending += 1;
        st.pending.push_back((id, token.clone()));
        self.stats
            .pending
            .store(st.pending.len(), Ordering::Release);
        drop(st);
        if let Some((_, oldest)) = evicted {
            oldest.cancel();
            self.stats.pending_evicted.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(kvbm_engine::metrics::DATAPLANE_PENDING_EVICTED).increment(1);
            tracing::debug!("data plane: the oldest unauthenticated connection was dropped");
        }
        Pending {
            admission: self.clone(),
            id,
            token,
        }
    }

    /// Gate 3: a member slot for `key`, or why none is free (counted and logged).
    pub(crate) fn admit(self: &Arc<Self>, key: PeerKey) -> Result<Slot, Full> {
        let mut st = self.state.lock();
        let full = if st.served >= self.limits.max_connections {
            Some(Full::All)
        } else if st.per_peer.get(&key).copied().unwrap_or(0) >= self.limits.max_per_peer {
            Some(Full::Peer)
        } else {
            None
        };
        if let Some(full) = full {
            drop(st);
            let (counter, metric) = match full {
                Full::All => (
                    &self.stats.connections_refused,
                    kvbm_engine::metrics::DATAPLANE_CONNECTIONS_REFUSED,
                ),
                Full::Peer => (
                    &self.stats.peer_connections_refused,
                    kvbm_engine::metrics::DATAPLANE_PEER_CONNECTIONS_REFUSED,
                ),
            };
            counter.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(metric).increment(1);
            tracing::debug!(?key, "data plane connection refused: {full}");
            return Err(full);
        }
        st.served += 1;
        *st.per_peer.entry(key).or_insert(0) += 1;
        self.stats.connections.store(st.served, Ordering::Release);
        Ok(Slot {
            admission: self.clone(),
            key,
        })
    }
}

/// A pending (unauthenticated) connection's place: see [`Admission::pending`].
pub(crate) struct Pending {
    admission: Arc<Admission>,
    id: u64,
    token: CancellationToken,
}

impl Pending {
    /// Resolves when this connection was dropped from the pool to make room for a newer one.
    pub(crate) async fn evicted(&self) {
        self.token.cancelled().await;
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let mut st = self.admission.state.lock();
        if let Some(i) = st.pending.iter().position(|(id, _)| *id == self.id) {
            st.pending.remove(i);
        }
        self.admission
            .stats
            .pending
            .store(st.pending.len(), Ordering::Release);
    }
}

/// A served connection's member slot: see [`Admission::admit`].
pub(crate) struct Slot {
    admission: Arc<Admission>,
    key: PeerKey,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut st = self.admission.state.lock();
        st.served -= 1;
        if let Some(n) = st.per_peer.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                st.per_peer.remove(&self.key);
            }
        }
        self.admission
            .stats
            .connections
            .store(st.served, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn admission(
        max_connections: usize,
        max_per_peer: usize,
        max_pending: usize,
    ) -> Arc<Admission> {
        Arc::new(Admission::new(
            Limits {
                max_connections,
                max_per_peer,
                max_pending,
                accept_rate: 4,
            },
            Arc::new(ServerStats::default()),
        ))
    }

    #[test]
    fn ipv6_counts_by_its_64_and_mapped_ipv4_as_ipv4() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:ffff:1:2:3".parse().unwrap();
        let other: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(address_key(a), address_key(b));
        assert_ne!(address_key(a), address_key(other));
        let mapped: IpAddr = "::ffff:10.0.0.7".parse().unwrap();
        assert_eq!(address_key(mapped), "10.0.0.7".parse::<IpAddr>().unwrap());
        let v4: IpAddr = "10.0.0.7".parse().unwrap();
        assert_ne!(address_key(v4), address_key("10.0.0.8".parse().unwrap()));
    }

    #[test]
    fn the_accept_rate_is_per_prefix_and_refills() {
        let a = admission(8, 8, 8);
        let t0 = Instant::now();
        let x: IpAddr = "2001:db8::1".parse().unwrap();
        let same: IpAddr = "2001:db8::2".parse().unwrap();
        let y: IpAddr = "192.0.2.1".parse().unwrap();
        // Four tokens for the /64 (both addresses draw on them), none left for a fifth.
        assert!((0..2).all(|_| a.accept(x, t0)));
        assert!((0..2).all(|_| a.accept(same, t0)));
        assert!(!a.accept(x, t0));
        assert_eq!(a.stats.accepts_throttled.load(Ordering::Relaxed), 1);
        // Another address has its own bucket.
        assert!(a.accept(y, t0));
        // A quarter of a second later one token is back.
        let t1 = t0 + Duration::from_millis(260);
        assert!(a.accept(x, t1));
        assert!(!a.accept(x, t1));
    }

    #[test]
    fn a_full_pending_pool_drops_its_oldest() {
        let a = admission(8, 8, 2);
        let first = a.pending();
        let second = a.pending();
        assert_eq!(a.stats.pending.load(Ordering::Acquire), 2);
        assert!(!first.token.is_cancelled());
        let third = a.pending();
        assert!(first.token.is_cancelled(), "the oldest made room");
        assert!(!second.token.is_cancelled() && !third.token.is_cancelled());
        assert_eq!(a.stats.pending_evicted.load(Ordering::Relaxed), 1);
        assert_eq!(a.stats.pending.load(Ordering::Acquire), 2);
        drop(first);
        assert_eq!(a.stats.pending.load(Ordering::Acquire), 2, "already out");
        drop(second);
        assert_eq!(a.stats.pending.load(Ordering::Acquire), 1);
        drop(third);
        assert_eq!(a.stats.pending.load(Ordering::Acquire), 0);
    }

    #[test]
    fn member_slots_are_capped_per_member_and_in_all() {
        let a = admission(3, 2, 8);
        let (m, n, o) = (
            PeerKey::Member(InstanceId(1)),
            PeerKey::Member(InstanceId(2)),
            PeerKey::Member(InstanceId(3)),
        );
        let s1 = a.admit(m).unwrap();
        let s2 = a.admit(m).unwrap();
        assert_eq!(a.admit(m).err(), Some(Full::Peer));
        let s3 = a.admit(n).unwrap();
        assert_eq!(a.admit(o).err(), Some(Full::All));
        assert_eq!(a.stats.connections(), 3);
        assert_eq!(a.stats.peer_connections_refused(), 1);
        assert_eq!(a.stats.connections_refused(), 1);
        drop(s1);
        let s4 = a.admit(o).unwrap();
        drop((s2, s3, s4));
        assert_eq!(a.stats.connections(), 0);
        assert!(a.state.lock().per_peer.is_empty());
    }
}
