//! Worker membership over a real `nats-server`: a rank joins by heartbeat, leaves, comes back
//! as a new incarnation and is sent nothing until the leader brings it back in step; work
//! addressed to the old incarnation is refused by the new one; with security on, beats forged
//! by a non-member or by another rank's worker neither join, restart nor remove a rank.

use std::time::Duration;

use kvbm_logical::TierId;
use kvbm_physical::{BlockLayout, PhysicalLayout, PinPolicy, TransferManager};

use super::*;
use crate::security::{RootKey, SecurityConfig};
use crate::transport::control::{ControlRequest, ControlResponse, Envelope, WorkerControl};
use crate::transport::nats::{NatsControl, WorkerServer, connect};
use kvbm_engine::worker::PhysicalWorker;

const I: InstanceId = InstanceId(0x5eed);
const MS50: Duration = Duration::from_millis(50);

fn worker() -> Arc<PhysicalWorker> {
    let tm = Arc::new(TransferManager::new().unwrap());
    let geometry = BlockLayout::builder()
        .num_blocks(4)
        .num_layers(1)
        .outer_dim(1)
        .page_size(16)
        .inner_dim(16)
        .dtype_bytes(2)
        .build()
        .unwrap();
    let g2 = tm
        .register_layout(PhysicalLayout::allocate_host(geometry, PinPolicy::Unpinned).unwrap())
        .unwrap();
    Arc::new(PhysicalWorker::new(0, tm).with_layout(TierId::G2, g2))
}

async fn digests(c: &NatsControl) -> std::result::Result<Vec<u64>, ControlError> {
    match c
        .call(ControlRequest::Digest {
            tier: TierId::G2,
            blocks: vec![0, 1, 2, 3],
        })
        .await?
    {
        ControlResponse::Digests(d) => Ok(d),
        other => panic!("{other:?}"),
    }
}

async fn next_event(rx: &mut broadcast::Receiver<MemberEvent>) -> MemberEvent {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("an event within 10 s")
        .unwrap()
}

/// Issue 24, item 4: join, leave, rejoin. The restarted rank's memory is empty; the leader
/// sends it nothing until it acknowledged the restart, and a request still addressed to the
/// old incarnation is refused by the new one (the work fails cleanly, nothing runs on it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_joins_restarts_and_is_sent_nothing_until_brought_back_in_step() {
    let Some(nats) = kvbm_tests::services::nats("membership_rejoin") else {
        return;
    };
    let prefix = format!("kvbm.test.members.{}", std::process::id());
    let address = WorkerAddress::new(I, 0);
    let leader = connect(&nats.url, "leader", MS50).await.unwrap();
    let cancel = CancellationToken::new();
    let members = Membership::follow(
        &leader,
        &prefix,
        I,
        Duration::from_millis(600),
        Arc::new(Security::Off),
        cancel.clone(),
    )
    .await
    .unwrap();
    let mut events = members.events();
    let control = NatsControl::new(leader.clone(), &prefix, address, Duration::from_secs(5))
        .with_membership(members.clone());
    // Nothing heard yet: the call fails at once, nothing is sent.
    assert!(matches!(
        digests(&control).await,
        Err(ControlError::NotJoined { .. })
    ));

    // The rank starts: it joins, and is driven.
    let start = |cancel: CancellationToken| {
        let url = nats.url.clone();
        let prefix = prefix.clone();
        async move {
            let client = connect(&url, "worker", MS50).await.unwrap();
            let server = WorkerServer::new(client, &prefix, address, worker()).heartbeat(MS50);
            let epoch = server.epoch();
            server.start(cancel).await.unwrap();
            epoch
        }
    };
    let first_cancel = CancellationToken::new();
    let first = start(first_cancel.clone()).await;
    assert_eq!(
        next_event(&mut events).await,
        MemberEvent::Joined(RankTarget {
            address,
            epoch: first
        })
    );
    members.wait_for(1, Duration::from_secs(5)).await.unwrap();
    let filled = control
        .call(ControlRequest::Fill {
            tier: TierId::G2,
            seed: 9,
        })
        .await
        .unwrap();
    assert_eq!(filled, ControlResponse::Done);
    let before = digests(&control).await.unwrap();

    // It stops (departing): lost at once; calls fail without being sent.
    first_cancel.cancel();
    assert!(matches!(
        next_event(&mut events).await,
        MemberEvent::Lost(t) if t.epoch == first
    ));
    assert!(matches!(
        digests(&control).await,
        Err(ControlError::NotJoined { .. })
    ));

    // A new process for the rank: another incarnation, with empty memory.
    let second = start(CancellationToken::new()).await;
    assert_ne!(first, second);
    assert!(matches!(
        next_event(&mut events).await,
        MemberEvent::Restarted { was, now } if was.epoch == first && now.epoch == second
    ));
    assert_eq!(members.stats().restarts(), 1);
    // Not in step: the leader sends it nothing.
    let e = digests(&control).await.unwrap_err();
    assert!(
        matches!(e, ControlError::Rejoining { epoch, .. } if epoch == second),
        "{e:?}"
    );
    assert!(e.is_unreachable());
    // Work still addressed to the old incarnation (sent before the leader knew) is refused by
    // the new one: nothing runs on it.
    let stale = serde_json::to_vec(&Envelope::addressed(
        ControlRequest::Fill {
            tier: TierId::G2,
            seed: 1,
        },
        RankTarget {
            address,
            epoch: first,
        },
    ))
    .unwrap();
    let reply = leader
        .request(address.control_subject(&prefix), stale.into())
        .await
        .unwrap();
    let reply: Envelope<ControlResponse> = serde_json::from_slice(&reply.payload).unwrap();
    assert!(
        matches!(&reply.body, ControlResponse::Refused(m) if m.starts_with("stale")),
        "{reply:?}"
    );

    // The leader declares the rank's state empty and acknowledges: driven again, and its
    // memory is the new process's (not the blocks the old one held).
    assert_eq!(
        members.acknowledge(address),
        Some(RankTarget {
            address,
            epoch: second
        })
    );
    let after = digests(&control).await.unwrap();
    assert_ne!(
        after, before,
        "the new incarnation does not hold the old one's bytes"
    );
    cancel.cancel();
}

/// Security on: beats sealed by a non-member, by another rank's worker, or by a leader do not
/// count; the rank's own worker credential does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_forged_beats_neither_join_restart_nor_remove_a_rank() {
    let Some(nats) = kvbm_tests::services::nats("security_membership") else {
        return;
    };
    let prefix = format!("kvbm.test.members_sec.{}", std::process::id());
    let subject = members_subject(&prefix, I);
    let root = RootKey::generate().unwrap();
    let member = |role: Role, rank: u32| {
        let cred = root
            .issue(I, role, rank, "ns", Duration::from_secs(3600))
            .unwrap();
        Arc::new(Security::with_credential(
            root.trust_root(),
            Arc::new(cred),
            &SecurityConfig::default(),
        ))
    };
    let leader = connect(&nats.url, "leader", MS50).await.unwrap();
    let cancel = CancellationToken::new();
    let members = Membership::follow(
        &leader,
        &prefix,
        I,
        Duration::from_secs(5),
        member(Role::Leader, 0),
        cancel.clone(),
    )
    .await
    .unwrap();
    let address = WorkerAddress::new(I, 0);
    let beat = |epoch: u64, departing: bool| {
        serde_json::to_vec(&RankBeat {
            version: BEAT_VERSION,
            rank: RankTarget { address, epoch },
            departing,
        })
        .unwrap()
    };
    let ctx = beat_context(&subject);
    let forger = connect(&nats.url, "forger", MS50).await.unwrap();
    let publish = |bytes: Vec<u8>| {
        let (forger, subject) = (forger.clone(), subject.clone());
        async move {
            forger.publish(subject, bytes.into()).await.unwrap();
            forger.flush().await.unwrap();
        }
    };
    // Forged joins: unsealed, rank 1's worker, the leader.
    publish(beat(7, false)).await;
    publish(member(Role::Worker, 1).seal(&ctx, &beat(7, false))).await;
    publish(member(Role::Leader, 0).seal(&ctx, &beat(7, false))).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(matches!(
        members.target(address),
        Err(ControlError::NotJoined { .. })
    ));
    assert_eq!(members.stats().rejected(), 3);

    // The rank's own worker joins; forged restarts and departures change nothing.
    let own = member(Role::Worker, 0);
    publish(own.seal(&ctx, &beat(1, false))).await;
    members.wait_for(1, Duration::from_secs(5)).await.unwrap();
    publish(beat(2, false)).await;
    publish(member(Role::Worker, 1).seal(&ctx, &beat(2, false))).await;
    publish(member(Role::Worker, 1).seal(&ctx, &beat(1, true))).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        members.target(address).unwrap(),
        RankTarget { address, epoch: 1 }
    );
    assert_eq!(members.stats().restarts(), 0);
    assert_eq!(members.stats().rejected(), 6);
    cancel.cancel();
}

/// Issue 24, item 4: a restarted rank is brought back in step only once the leader's G2 holds
/// nothing it placed before: inactive blocks are dropped at once (never matched again), a block
/// a session still holds delays the rank's return until it is released (and dropped too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_in_step_acknowledges_a_restart_once_the_leaders_g2_is_empty() {
    use kvbm_logical::{BlockManager, BlockRegistry, G2, Salt, TokenBlockSequence};

    let Some(nats) = kvbm_tests::services::nats("membership_keep_in_step") else {
        return;
    };
    let prefix = format!("kvbm.test.members_keep.{}", std::process::id());
    let subject = members_subject(&prefix, I);
    let address = WorkerAddress::new(I, 0);
    let client = connect(&nats.url, "leader", MS50).await.unwrap();
    let cancel = CancellationToken::new();
    let members = Membership::follow(
        &client,
        &prefix,
        I,
        Duration::from_millis(400),
        Arc::new(Security::Off),
        cancel.clone(),
    )
    .await
    .unwrap();
    let beat = |epoch: u64| {
        let (client, subject) = (client.clone(), subject.clone());
        async move {
            let body = serde_json::to_vec(&RankBeat {
                version: BEAT_VERSION,
                rank: RankTarget { address, epoch },
                departing: false,
            })
            .unwrap();
            client.publish(subject, body.into()).await.unwrap();
            client.flush().await.unwrap();
        }
    };

    // The leader's G2: four blocks placed on the rank, one still held by a session.
    let registry = BlockRegistry::new();
    let g2 = Arc::new(
        BlockManager::<G2>::builder()
            .block_count(4)
            .block_size(4)
            .registry(registry)
            .build()
            .unwrap(),
    );
    let seq =
        TokenBlockSequence::from_tokens(&(0..16).collect::<Vec<u32>>(), 4, Salt::NONE).unwrap();
    let complete = g2
        .allocate_blocks(4)
        .unwrap()
        .into_iter()
        .zip(seq.blocks())
        .map(|(b, tb)| b.complete_token_block(tb).unwrap())
        .collect();
    let mut placed = g2.register_blocks(complete);
    let held = placed.pop().unwrap();
    drop(placed);
    let leader = Arc::new(
        kvbm_engine::InstanceLeader::builder()
            .g2(g2.clone())
            .build()
            .unwrap(),
    );
    let _keeper = {
        let leader = leader.clone();
        members.keep_in_step(move |_| leader.forget_worker_memory(), cancel.clone())
    };

    beat(1).await;
    members.wait_for(1, Duration::from_secs(5)).await.unwrap();
    assert_eq!(leader.find_matches(&seq.hashes()).count(TierId::G2), 4);

    // The rank restarts: what the leader placed is dropped, and the rank waits for the held
    // block.
    beat(2).await;
    kvbm_tests::wait::eventually_async("the restarted rank is rejoining", || {
        matches!(
            members.target(address),
            Err(ControlError::Rejoining { epoch: 2, .. })
        )
    })
    .await;
    // The keeper forgets the lost memory on its next pass; the held block keeps the rank
    // rejoining meanwhile.
    kvbm_tests::wait::eventually_async(
        "inactive blocks of the lost memory are never matched again",
        || leader.find_matches(&seq.hashes()[..3]).count(TierId::G2) == 0,
    )
    .await;
    assert!(matches!(
        members.target(address),
        Err(ControlError::Rejoining { epoch: 2, .. })
    ));
    // Released: dropped in turn, and the rank is in step again.
    drop(held);
    for _ in 0..100 {
        beat(2).await;
        if members.target(address).is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        members.target(address).unwrap(),
        RankTarget { address, epoch: 2 }
    );
    assert_eq!(leader.find_matches(&seq.hashes()).count(TierId::G2), 0);
    assert_eq!(g2.available_blocks(), 4);
    cancel.cancel();
}
