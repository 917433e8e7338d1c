//! The grants ([`super`]) against the document that shows them and the subjects the
//! code uses.

use super::Grants;
use crate::instance::lending::lease_subject;
use crate::instance::presence::{heartbeat_subject, snapshot_subject};
use crate::transport::membership::members_subject;
use crate::transport::nats::DEFAULT_CONTROL_PREFIX;
use kvbm_engine::{InstanceId, WorkerAddress};

const INSTANCE: u64 = 0xa1;

/// NATS subject matching: `*` is one token, a trailing `>` one or more.
fn matches(pattern: &str, subject: &str) -> bool {
    let (mut p, mut s) = (pattern.split('.'), subject.split('.'));
    loop {
        match (p.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

fn allows(list: &[String], subject: &str) -> bool {
    list.iter().any(|p| matches(p, subject))
}

/// `docs/security.md`'s sample configuration gives each role exactly these grants.
#[test]
fn the_documented_grants_are_these() {
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/security.md"
    ))
    .unwrap();
    for (user, grants) in [
        ("instance_a", Grants::instance("kvbm.events")),
        ("leader_a", Grants::leader(DEFAULT_CONTROL_PREFIX, INSTANCE)),
        ("worker_a", Grants::worker(DEFAULT_CONTROL_PREFIX, INSTANCE)),
    ] {
        let start = doc
            .find(&format!("user: \"{user}\""))
            .unwrap_or_else(|| panic!("{user} in the sample configuration"));
        let block = &doc[start..];
        let end = block[1..]
            .find("{ user:")
            .or_else(|| block[1..].find("{ nkey:"))
            .map_or(block.len(), |e| e + 1);
        let block = &block[..end];
        assert!(
            block.contains(&grants.publish_line()),
            "{user}: {}\n{block}",
            grants.publish_line()
        );
        assert!(
            block.contains(&grants.subscribe_line()),
            "{user}: {}\n{block}",
            grants.subscribe_line()
        );
        assert_eq!(
            block.contains("allow_responses: true"),
            grants.allow_responses,
            "{user}\n{block}"
        );
    }
}

/// Each role may use the subjects the code really uses, and no other instance's.
#[test]
fn the_grants_cover_the_subjects_the_code_uses() {
    let id = InstanceId(INSTANCE);
    let other = InstanceId(0xb2);
    let leader = Grants::leader(DEFAULT_CONTROL_PREFIX, INSTANCE);
    let worker = Grants::worker(DEFAULT_CONTROL_PREFIX, INSTANCE);
    let control = WorkerAddress::new(id, 3).control_subject(DEFAULT_CONTROL_PREFIX);
    let members = members_subject(DEFAULT_CONTROL_PREFIX, id);
    assert!(allows(&leader.publish, &control));
    assert!(allows(&leader.subscribe, &members));
    assert!(allows(&worker.subscribe, &control));
    assert!(allows(&worker.publish, &members));
    let foreign = WorkerAddress::new(other, 3).control_subject(DEFAULT_CONTROL_PREFIX);
    assert!(!allows(&leader.publish, &foreign));
    assert!(!allows(&worker.subscribe, &foreign));
    assert!(!allows(
        &worker.publish,
        &members_subject(DEFAULT_CONTROL_PREFIX, other)
    ));
    assert!(
        !allows(&worker.publish, &control),
        "a worker cannot command another rank"
    );

    let instance = Grants::instance("kvbm.events");
    let scoped = "kvbm.events.fp-0123456789abcdef0123456789abcdef";
    for subject in [
        scoped.to_owned(),
        heartbeat_subject(scoped),
        snapshot_subject(scoped, id),
        snapshot_subject(scoped, other),
        lease_subject(scoped, id),
        lease_subject(scoped, other),
    ] {
        assert!(allows(&instance.publish, &subject), "{subject}");
        assert!(allows(&instance.subscribe, &subject), "{subject}");
    }
    assert!(!allows(&instance.publish, &control));
    assert!(allows(&instance.subscribe, "_INBOX.abc.def"));
}

/// The one-line form the test server's configuration is written in.
#[test]
fn the_server_form_lists_every_grant() {
    assert_eq!(
        Grants::worker("kvbm.ctl", INSTANCE).to_conf(),
        r#"{ publish: { allow: ["kvbm.ctl.00000000000000a1.members"] }, subscribe: { allow: ["kvbm.ctl.00000000000000a1.worker.>"] }, allow_responses: true }"#
    );
    assert_eq!(
        Grants::leader("kvbm.ctl", INSTANCE).to_conf(),
        r#"{ publish: { allow: ["kvbm.ctl.00000000000000a1.worker.>"] }, subscribe: { allow: ["_INBOX.>", "kvbm.ctl.00000000000000a1.members"] } }"#
    );
    assert_eq!(
        Grants::instance("kvbm.events")
            .with_subjects(&["kvbm.test.>"])
            .to_conf(),
        r#"{ publish: { allow: ["kvbm.events", "kvbm.events.>", "kvbm.test.>"] }, subscribe: { allow: ["kvbm.events", "kvbm.events.>", "_INBOX.>", "kvbm.test.>"] }, allow_responses: true }"#
    );
}
