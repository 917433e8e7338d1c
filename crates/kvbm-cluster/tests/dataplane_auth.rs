//! Instances with credentials (`Instance::builder(..).security(..)`), over a real
//! `nats-server` and the real TCP data plane: two leaders of one namespace pull each other's
//! G2 blocks over the authenticated protocol, bytes verified; a leader of another namespace
//! (same trust root) believes none of their sealed messages and, told of the blocks anyway, is
//! refused by the serving instance and gets nothing, counted on both sides, and the serving
//! instance keeps serving its members.
//!
//! Needs `cargo xtask services start` (or skips under `KVBM_TEST_SKIP_SERVICES=1`).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvbm_cluster::instance::{Instance, synthetic_block};
use kvbm_cluster::security::{Role, RootKey, Security, SecurityConfig};
use kvbm_engine::InstanceId;
use kvbm_engine::KvbmRuntime;
use kvbm_logical::{Salt, SequenceHash, TierId, TokenBlockSequence};
use kvbm_tests::wait::eventually_async;

#[path = "../../kvbm-engine/tests/common/mod.rs"]
mod common;

const A: InstanceId = InstanceId(0xa1);
const B: InstanceId = InstanceId(0xb2);
const C: InstanceId = InstanceId(0xc3);

fn runtime(nats_url: &str, subject: &str) -> KvbmRuntime {
    KvbmRuntime::builder()
        .tokio_handle(tokio::runtime::Handle::current())
        .set("logical.block_size", 4)
        .set("logical.events.max_delay_ms", 1)
        .set("events.idle_tick_ms", 1)
        .set("events.subject", subject)
        .set("tiers.g1_blocks", 16)
        .set("tiers.g2_blocks", 16)
        .set("transport.nats_url", nats_url)
        .set("transport.heartbeat_interval_ms", 50)
        .set("transport.heartbeat_timeout_ms", 400)
        .set("transport.request_timeout_ms", 1000)
        .build()
        .unwrap()
}

async fn member(rt: &KvbmRuntime, root: &RootKey, id: InstanceId, ns: &str) -> Instance {
    let cred = root
        .issue(id, Role::Leader, 0, ns, Duration::from_secs(3600))
        .unwrap();
    let security = Security::with_credential(
        root.trust_root(),
        Arc::new(cred),
        &SecurityConfig::default(),
    );
    Instance::builder(&rt.handle())
        .geometry(common::geometry_with(32))
        .security(security)
        .build()
        .await
        .unwrap()
}

fn prefix(seed: u32, n: usize) -> Vec<SequenceHash> {
    let tokens: Vec<u32> = (0..(n as u32 * 4)).map(|t| seed * 100_000 + t).collect();
    TokenBlockSequence::from_tokens(&tokens, 4, Salt::NONE)
        .unwrap()
        .hashes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_instances_pull_only_from_members_of_their_namespace() {
    let test = "dataplane_auth_instances";
    let Some(nats) = kvbm_tests::services::nats(test) else {
        return;
    };
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let subject = format!("kvbm.test.dpauth_{}_{nanos}", std::process::id());
    let root = RootKey::generate().unwrap();
    let (rt_a, rt_b, rt_c) = (
        runtime(&nats.url, &subject),
        runtime(&nats.url, &subject),
        runtime(&nats.url, &subject),
    );
    let a = member(&rt_a, &root, A, "ns").await;
    let b = member(&rt_b, &root, B, "ns").await;
    let c = member(&rt_c, &root, C, "other").await;
    assert_eq!((a.id(), b.id(), c.id()), (A, B, C));

    eventually_async("B knows where A serves", || {
        b.peers().get(A) == Some(a.data_plane().unwrap().local_addr())
    })
    .await;
    let p = prefix(7, 4);
    assert_eq!(a.compute(&p, &synthetic_block).unwrap(), 4);
    eventually_async("B's index has A's G2 blocks", || {
        p.iter()
            .all(|h| b.index().locations(*h) == vec![(A, TierId::G2)])
    })
    .await;

    // C, of another namespace, believes none of A's sealed heartbeats or events: it never
    // learns where A serves nor what A holds.
    let other_ns = kvbm_cluster::security::Rejection::OtherNamespace;
    eventually_async("C drops A's messages as another namespace's", || {
        c.security().stats().unwrap().rejected(other_ns) >= 2
    })
    .await;
    assert_eq!(c.peers().get(A), None);
    assert!(p.iter().all(|h| c.index().locations(*h).is_empty()));

    // Told anyway (as a NATS-only attacker could not: the messages are sealed), C is refused by
    // A's data plane: nothing pulled, nothing registered, counted on both sides.
    c.peers().insert(A, a.data_plane().unwrap().local_addr());
    c.index()
        .replace_instance(A, &p.iter().map(|h| (*h, TierId::G2)).collect::<Vec<_>>());
    let got = c.onboard(&p).await.unwrap();
    assert!(got.blocks.is_empty(), "{got:?}");
    assert_eq!(c.lookup(&p).local_g2, 0);
    assert!(a.data_plane().unwrap().stats().handshakes_refused() >= 1);
    assert!(c.data_plane_client_stats().unwrap().handshakes_refused >= 1);
    assert_eq!(a.data_plane().unwrap().stats().blocks_served(), 0);

    // B, a member, pulls over the authenticated protocol; bytes verified.
    let got = b.onboard(&p).await.unwrap();
    assert_eq!(got.remote_g2, Some((A, 4)), "{got:?}");
    let mut want = vec![0u8; b.block_bytes()];
    for (blk, h) in got.blocks.iter().zip(&p) {
        synthetic_block(*h, &mut want);
        assert_eq!(b.read_g1(blk).as_ref(), Some(&want));
    }
    drop(got);
    assert!(a.data_plane().unwrap().stats().handshakes() >= 1);
    assert_eq!(a.data_plane().unwrap().stats().blocks_served(), 4);
    assert_eq!(b.data_plane_client_stats().unwrap().handshakes_refused, 0);

    for i in [a, b, c] {
        i.shutdown().await;
    }
    rt_a.shutdown();
    rt_b.shutdown();
    rt_c.shutdown();
}
