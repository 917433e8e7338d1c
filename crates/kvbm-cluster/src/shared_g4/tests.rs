//! The shared-G4 ready barrier over a real `nats-server`: with security on, announcements a
//! non-member or another instance's member forged do not complete it; the real members' do.

use super::*;
use crate::security::{RootKey, SecurityConfig};

fn member(root: &RootKey, id: u64, role: Role) -> Security {
    let rank = u32::from(role == Role::Worker);
    let cred = root
        .issue(InstanceId(id), role, rank, "ns", Duration::from_secs(3600))
        .unwrap();
    Security::with_credential(
        root.trust_root(),
        Arc::new(cred),
        &SecurityConfig::default(),
    )
}

/// Attack (issue 23): instance 1 waits for instance 2. A client without a credential, a
/// member of instance 3, and instance 2's worker each announce "2" (sealed as themselves, or
/// not at all): instance 1 keeps waiting and counts them. Instance 2's leader then announces
/// itself, and both barriers complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_forged_ready_announcements_do_not_start_a_run() {
    let Some(nats) = kvbm_tests::services::nats("security_ready_barrier") else {
        return;
    };
    let subject = format!("kvbm.test.ready.{}", std::process::id());
    let connect = |name: &'static str| {
        let url = nats.url.clone();
        async move {
            crate::transport::nats::connect(&url, name, Duration::from_millis(50))
                .await
                .unwrap()
        }
    };
    let root = RootKey::generate().unwrap();
    let one = Arc::new(member(&root, 1, Role::Leader));
    let (c1, cf) = (connect("one").await, connect("forger").await);

    // The forgers announce "2" every 20 ms for the whole wait.
    let forgeries: Vec<Vec<u8>> = vec![
        b"2".to_vec(),
        member(&root, 3, Role::Leader).seal(format!("ready:{subject}.ready").as_bytes(), b"2"),
        member(&root, 2, Role::Worker).seal(format!("ready:{subject}.ready").as_bytes(), b"2"),
    ];
    let forging = {
        let (cf, subject) = (cf.clone(), format!("{subject}.ready"));
        tokio::spawn(async move {
            loop {
                for f in &forgeries {
                    let _ = cf.publish(subject.clone(), f.clone().into()).await;
                }
                let _ = cf.flush().await;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let refused_before = one.stats().unwrap().rejected_total();
    let r = ready_barrier(&c1, &subject, 1, 2, &one, Duration::from_millis(1500)).await;
    let e = r.expect_err("forged announcements must not complete the barrier");
    assert!(e.to_string().contains("only 1 of 2"), "{e}");
    let stats = one.stats().unwrap();
    assert!(
        stats.rejected(Rejection::NotAllowed) >= 2,
        "the members speaking for instance 2 are counted"
    );
    assert!(
        stats.rejected_total() > refused_before + 2,
        "the unsealed one too"
    );

    // Instance 2's leader joins: both complete, the forgers still talking.
    let two = Arc::new(member(&root, 2, Role::Leader));
    let c2 = connect("two").await;
    let (s1, s2) = (subject.clone(), subject.clone());
    let (o1, o2) = (one.clone(), two.clone());
    let a =
        tokio::spawn(
            async move { ready_barrier(&c1, &s1, 1, 2, &o1, Duration::from_secs(30)).await },
        );
    let b =
        tokio::spawn(
            async move { ready_barrier(&c2, &s2, 2, 2, &o2, Duration::from_secs(30)).await },
        );
    if let Err(e) = a.await.unwrap() {
        panic!("instance 1: {e}");
    }
    if let Err(e) = b.await.unwrap() {
        panic!("instance 2: {e}");
    }
    forging.abort();
}

/// Off (a loopback run without credentials), announcements are plain ids, as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_security_the_barrier_completes_on_plain_announcements() {
    let Some(nats) = kvbm_tests::services::nats("ready_barrier_off") else {
        return;
    };
    let subject = format!("kvbm.test.ready_off.{}", std::process::id());
    let mut waits = Vec::new();
    for me in 1..=3u64 {
        let c = crate::transport::nats::connect(&nats.url, "r", Duration::from_millis(50))
            .await
            .unwrap();
        let subject = subject.clone();
        waits.push(tokio::spawn(async move {
            ready_barrier(&c, &subject, me, 3, &Security::Off, Duration::from_secs(10)).await
        }));
    }
    for w in waits {
        w.await.unwrap().unwrap();
    }
}
