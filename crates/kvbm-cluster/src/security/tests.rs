//! The security core's tests: sealing and opening, every forgery refused by kind, the replay
//! window against a reference, credentials through files, the loopback rule, and the data
//! plane's key agreement.

use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;

use super::*;

const NS: &str = "tenant-a";

fn root() -> RootKey {
    RootKey::generate().expect("random")
}

fn verifier(root: &RootKey, ns: &str) -> Verifier {
    Verifier::new(
        root.trust_root(),
        VerifierConfig {
            namespace: ns.into(),
            max_clock_skew: Duration::from_secs(30),
            replay_window: 128,
            max_senders: 16,
        },
    )
}

fn signer(root: &RootKey, id: u64, role: Role, rank: u32, ns: &str) -> Signer {
    Signer::new(Arc::new(
        root.issue(InstanceId(id), role, rank, ns, Duration::from_secs(3600))
            .expect("issue"),
    ))
}

#[test]
fn a_sealed_message_opens_with_its_sender_and_payload() {
    let r = root();
    let s = signer(&r, 7, Role::Leader, 0, NS);
    let v = verifier(&r, NS);
    let sealed = s.seal(b"heartbeat", b"hello");
    let o = v.open(b"heartbeat", &sealed).expect("opens");
    assert_eq!(o.payload, b"hello");
    assert_eq!(o.sender.instance, InstanceId(7));
    assert_eq!(o.sender.role, Role::Leader);
    assert_eq!(v.stats().accepted(), 1);
}

#[test]
fn every_forgery_is_refused_and_counted_by_kind() {
    let r = root();
    let s = signer(&r, 7, Role::Leader, 0, NS);
    let v = verifier(&r, NS);
    let sealed = s.seal(b"heartbeat", b"hello");

    // Another channel.
    assert_eq!(
        v.open(b"events", &sealed).unwrap_err(),
        Rejection::BadSignature
    );
    // A flipped payload byte.
    let mut bad = sealed.clone();
    let at = bad.len() - 64 - 1;
    bad[at] ^= 1;
    assert_eq!(
        v.open(b"heartbeat", &bad).unwrap_err(),
        Rejection::BadSignature
    );
    // Cut short, or not sealed at all.
    assert_eq!(
        v.open(b"heartbeat", &sealed[..40]).unwrap_err(),
        Rejection::Malformed
    );
    assert_eq!(
        v.open(b"heartbeat", b"{\"instance\":7}").unwrap_err(),
        Rejection::Malformed
    );
    // Signed by a root this cluster does not trust.
    let other = signer(&root(), 7, Role::Leader, 0, NS);
    assert_eq!(
        v.open(b"heartbeat", &other.seal(b"heartbeat", b"x"))
            .unwrap_err(),
        Rejection::NotMember
    );
    // Another tenant of the same root.
    let tenant_b = signer(&r, 8, Role::Leader, 0, "tenant-b");
    assert_eq!(
        v.open(b"heartbeat", &tenant_b.seal(b"heartbeat", b"x"))
            .unwrap_err(),
        Rejection::OtherNamespace
    );
    // The genuine message still opens once, then never again.
    assert!(v.open(b"heartbeat", &sealed).is_ok());
    assert_eq!(
        v.open(b"heartbeat", &sealed).unwrap_err(),
        Rejection::Replayed
    );

    let st = v.stats();
    assert_eq!(st.rejected(Rejection::BadSignature), 2);
    assert_eq!(st.rejected(Rejection::Malformed), 2);
    assert_eq!(st.rejected(Rejection::NotMember), 1);
    assert_eq!(st.rejected(Rejection::OtherNamespace), 1);
    assert_eq!(st.rejected(Rejection::Replayed), 1);
    assert_eq!(st.accepted(), 1);
}

/// Re-signs `sealed` after `edit` changed its body (what a member with its own key could do
/// to its own message; here to make a stale timestamp).
fn resign(s: &Signer, context: &[u8], sealed: &[u8], edit: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut body = sealed[..sealed.len() - 64].to_vec();
    edit(&mut body);
    let sig = s.credential().sign(&signed_message(context, &body));
    body.extend_from_slice(&sig);
    body
}

#[test]
fn stale_and_expired_messages_are_refused() {
    let r = root();
    let s = signer(&r, 7, Role::Leader, 0, NS);
    let v = verifier(&r, NS);
    let sealed = s.seal(b"c", b"p");
    let cert_len = u16::from_le_bytes([sealed[8], sealed[9]]) as usize;
    let ts_at = 10 + cert_len + 8;
    let old = resign(&s, b"c", &sealed, |b| {
        let ts = now_ms() - 60_000;
        b[ts_at..ts_at + 8].copy_from_slice(&ts.to_le_bytes());
    });
    assert_eq!(v.open(b"c", &old).unwrap_err(), Rejection::Stale);

    let expired = Signer::new(Arc::new(
        r.issue(InstanceId(9), Role::Leader, 0, NS, Duration::ZERO)
            .unwrap(),
    ));
    std::thread::sleep(Duration::from_millis(5));
    assert_eq!(
        v.open(b"c", &expired.seal(b"c", b"p")).unwrap_err(),
        Rejection::Expired
    );
}

#[test]
fn the_replay_window_takes_reordered_messages_once_and_old_ones_never() {
    let mut w = ReplayWindow::new(64);
    assert!(w.accept(100));
    assert!(w.accept(102));
    assert!(w.accept(101), "reordered within the window");
    assert!(!w.accept(101), "duplicate");
    assert!(!w.accept(100), "duplicate");
    assert!(w.accept(100 + 64 + 10));
    assert!(!w.accept(102), "slid out of the window");
    assert!(w.accept(100 + 64 + 9));
    assert!(w.accept(u64::MAX));
    assert!(!w.accept(u64::MAX));
}

proptest! {
    /// Against a reference set: a number is accepted iff it was never accepted and is within
    /// the window below the highest accepted so far.
    #[test]
    fn replay_window_matches_a_reference(seqs in proptest::collection::vec(0u64..400, 1..300)) {
        let mut w = ReplayWindow::new(64);
        let mut seen = std::collections::HashSet::new();
        let mut high: Option<u64> = None;
        for s in seqs {
            let expect = match high {
                None => true,
                Some(h) if s > h => true,
                Some(h) => h - s < 64 && !seen.contains(&s),
            };
            prop_assert_eq!(w.accept(s), expect, "seq {}", s);
            if expect {
                seen.insert(s);
                high = Some(high.map_or(s, |h| h.max(s)));
            }
        }
    }

    /// No input makes the decoder panic; anything but a genuine message is refused.
    #[test]
    fn open_survives_any_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        let r = root();
        let v = verifier(&r, NS);
        prop_assert!(v.open(b"c", &bytes).is_err());
        let _ = MemberCert::decode(&bytes);
    }

    /// Any single-bit change of a genuine message is refused.
    #[test]
    fn any_bit_flip_is_refused(bit in 0usize..4000) {
        let r = root();
        let s = signer(&r, 1, Role::Worker, 3, NS);
        let v = verifier(&r, NS);
        let mut m = s.seal(b"c", b"payload bytes");
        let bit = bit % (m.len() * 8);
        m[bit / 8] ^= 1 << (bit % 8);
        prop_assert!(v.open(b"c", &m).is_err());
    }
}

#[test]
fn credentials_round_trip_through_files_and_are_checked_on_load() {
    let dir = tempfile::tempdir().unwrap();
    let r = root();
    let root_file = dir.path().join("root.key");
    r.save(&root_file).unwrap();
    assert!(r.save(&root_file).is_err(), "never overwrites");
    let r2 = RootKey::load(&root_file).unwrap();
    assert_eq!(r2.trust_root(), r.trust_root());

    let c = r2
        .issue(InstanceId(5), Role::Worker, 2, NS, Duration::from_secs(60))
        .unwrap();
    let f = dir.path().join("w2.cred");
    c.save(&f).unwrap();
    let back = Credential::load(&f, Some(&r.trust_root())).unwrap();
    assert_eq!(back.cert(), c.cert());

    let err = Credential::load(&f, Some(&root().trust_root())).unwrap_err();
    assert!(err.to_string().contains("not signed by"), "{err}");

    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
    let err = Credential::load(&f, None).unwrap_err();
    assert!(err.to_string().contains("chmod 600"), "{err}");
    assert!(
        !format!("{c:?}").contains(&hex(&c.key.to_bytes())),
        "Debug hides the key"
    );
}

#[test]
fn config_needs_both_halves_and_loopback_is_no_exception() {
    let mut c = SecurityConfig {
        trust_root: Some(root().trust_root().to_hex()),
        ..Default::default()
    };
    assert_eq!(c.validate().unwrap_err().0, "security.credential_file");
    c.trust_root = Some("zz".into());
    c.credential_file = Some("/x".into());
    assert_eq!(c.validate().unwrap_err().0, "security.trust_root");

    let off = Security::Off;
    // Loopback is no boundary: without credentials, only `insecure` runs.
    let err = off
        .require_for(false, ["127.0.0.1:0", "nats://localhost:4222"])
        .unwrap_err();
    assert!(err.to_string().contains("127.0.0.1:0"), "{err}");
    assert!(err.to_string().contains("security.insecure"), "{err}");
    assert!(
        off.require_for(true, ["127.0.0.1:0", "nats://localhost:4222"])
            .is_ok()
    );
    let err = off
        .require_for(false, ["127.0.0.1:0", "nats://10.0.0.5:4222"])
        .unwrap_err();
    assert!(err.to_string().contains("nats://10.0.0.5:4222"), "{err}");
    assert!(off.require_for(true, ["0.0.0.0:7000"]).is_ok());
    assert!(is_loopback("[::1]:9"));
    assert!(is_loopback("nats://user:pw@127.0.0.1:4222"));
    assert!(!is_loopback("0.0.0.0:7000"));
    assert!(!is_loopback("nats.example.com:4222"));
}

#[test]
fn both_ends_agree_on_session_keys_and_tags_bind_everything() {
    let a = EphemeralKey::generate().unwrap();
    let b = EphemeralKey::generate().unwrap();
    let (pa, pb) = (a.public(), b.public());
    let client = a.agree(&pb, b"transcript", true).unwrap();
    let server = b.agree(&pa, b"transcript", false).unwrap();
    let t = client.tag_send(3, &[b"head", b"body"]);
    assert!(server.check_recv(3, &[b"head", b"body"], &t));
    assert!(
        !server.check_recv(4, &[b"head", b"body"], &t),
        "counter bound"
    );
    assert!(
        !server.check_recv(3, &[b"headb", b"ody"], &t),
        "framing bound"
    );
    assert!(
        !client.check_recv(3, &[b"head", b"body"], &t),
        "direction bound"
    );
    let c = EphemeralKey::generate().unwrap();
    let other = c.agree(&pb, b"transcript", false).unwrap();
    assert!(!other.check_recv(3, &[b"head", b"body"], &t));
    assert!(
        EphemeralKey::generate()
            .unwrap()
            .agree(&[0u8; 32], b"t", true)
            .is_err(),
        "low-order point refused"
    );
}

#[test]
fn one_config_names_each_instances_credential() {
    let c = SecurityConfig {
        credential_file: Some("/etc/kvbm/{instance}.cred".into()),
        ..Default::default()
    };
    assert_eq!(
        c.for_instance(InstanceId(0x2a)).credential_file.unwrap(),
        std::path::PathBuf::from("/etc/kvbm/000000000000002a.cred")
    );
    let plain = SecurityConfig {
        credential_file: Some("/etc/kvbm/a.cred".into()),
        ..Default::default()
    };
    assert_eq!(plain.for_instance(InstanceId(7)), plain);
}

fn write_list(path: &std::path::Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).unwrap();
}

/// Attack (N4): a member whose key leaked is removed by the revocation list, with no new root.
/// From the next look at the file its sealed messages (every channel goes through
/// `check_cert`: heartbeats, events, snapshots, control, beats, handshakes) are refused and
/// counted, by fingerprint or by instance, while other members still open; a later version of
/// the file that does not parse keeps the last list (nobody is un-revoked); a list that group
/// or others may write, or with a bad line, is refused at start naming the file and the line.
#[test]
fn security_a_revoked_member_is_refused_for_sealed_messages() {
    let dir = tempfile::tempdir().unwrap();
    let list = dir.path().join("revoked");
    write_list(&list, "# nobody yet\n");
    let r = root();
    let b = signer(&r, 0xb, Role::Leader, 0, NS);
    let c = signer(&r, 0xc, Role::Worker, 1, NS);
    let v = verifier(&r, NS)
        .with_revocations(Revocations::load(&list, Duration::from_millis(1)).unwrap());
    assert!(v.open(b"heartbeat", &b.seal(b"heartbeat", b"1")).is_ok());
    assert!(v.open(b"beat", &c.seal(b"beat", b"1")).is_ok());

    write_list(
        &list,
        &format!("# leaked 2026-12-07\n{}\n", b.cert().fingerprint_hex()),
    );
    std::thread::sleep(Duration::from_millis(5));
    assert_eq!(
        v.open(b"heartbeat", &b.seal(b"heartbeat", b"2"))
            .unwrap_err(),
        Rejection::Revoked
    );
    assert!(
        v.open(b"beat", &c.seal(b"beat", b"2")).is_ok(),
        "others still open"
    );
    assert_eq!(v.stats().rejected(Rejection::Revoked), 1);
    assert_eq!(v.recheck(b.cert()), Err(Rejection::Revoked));

    // Every certificate of an instance.
    write_list(
        &list,
        &format!(
            "{}\ninstance 000000000000000c\n",
            b.cert().fingerprint_hex()
        ),
    );
    std::thread::sleep(Duration::from_millis(5));
    assert_eq!(
        v.open(b"beat", &c.seal(b"beat", b"3")).unwrap_err(),
        Rejection::Revoked
    );

    // A version that does not parse: the last list stays.
    write_list(&list, "not a fingerprint at all\n");
    std::thread::sleep(Duration::from_millis(5));
    assert_eq!(
        v.open(b"heartbeat", &b.seal(b"heartbeat", b"4"))
            .unwrap_err(),
        Rejection::Revoked
    );
    assert_eq!(
        v.open(b"beat", &c.seal(b"beat", b"4")).unwrap_err(),
        Rejection::Revoked
    );

    // At start, a bad line or a list others may write is an error naming it.
    let e = Revocations::load(&list, Duration::from_secs(1)).unwrap_err();
    assert!(e.to_string().contains("line 1"), "{e}");
    {
        use std::os::unix::fs::PermissionsExt;
        write_list(&list, "");
        std::fs::set_permissions(&list, std::fs::Permissions::from_mode(0o666)).unwrap();
    }
    let e = Revocations::load(&list, Duration::from_secs(1)).unwrap_err();
    assert!(e.to_string().contains("chmod go-w"), "{e}");
}

/// Rotating the root without downtime: while members trust both roots (`trust_root = "old,new"`)
/// certificates of either are accepted and a credential of either loads; once the old root is
/// dropped its certificates are refused; a member whose own certificate is revoked does not
/// start.
#[test]
fn security_rotating_the_root_accepts_both_during_the_overlap_and_then_only_the_new() {
    let dir = tempfile::tempdir().unwrap();
    let (old, new) = (root(), root());
    let by_old = signer(&old, 1, Role::Leader, 0, NS);
    let by_new = signer(&new, 2, Role::Leader, 0, NS);
    let both = verifier(&old, NS).with_more_roots([new.trust_root()]);
    assert!(both.open(b"h", &by_old.seal(b"h", b"x")).is_ok());
    assert!(both.open(b"h", &by_new.seal(b"h", b"x")).is_ok());
    assert_eq!(
        verifier(&new, NS)
            .open(b"h", &by_old.seal(b"h", b"y"))
            .unwrap_err(),
        Rejection::NotMember
    );

    let cred = new
        .issue(
            InstanceId(3),
            Role::Leader,
            0,
            NS,
            Duration::from_secs(3600),
        )
        .unwrap();
    let file = dir.path().join("m.cred");
    cred.save(&file).unwrap();
    let config = |roots: String| SecurityConfig {
        trust_root: Some(roots),
        credential_file: Some(file.clone()),
        ..SecurityConfig::default()
    };
    let overlap = config(format!(
        "{}, {}",
        old.trust_root().to_hex(),
        new.trust_root().to_hex()
    ));
    let sec = Security::from_config(&overlap).unwrap();
    assert!(sec.open(b"h", &by_old.seal(b"h", b"z")).is_ok());
    assert!(sec.open(b"h", &by_new.seal(b"h", b"z")).is_ok());
    let e = Security::from_config(&config(old.trust_root().to_hex())).unwrap_err();
    assert!(e.to_string().contains("not signed by"), "{e}");

    let list = dir.path().join("revoked");
    write_list(&list, &format!("{}\n", cred.cert().fingerprint_hex()));
    let revoked = SecurityConfig {
        revoked_file: Some(list),
        ..overlap
    };
    let e = Security::from_config(&revoked).unwrap_err();
    assert!(e.to_string().contains("revocation list"), "{e}");
}

/// A member is warned before its own certificate expires: at start and then at most once an
/// hour, only within `security.expiry_warning_ms`.
#[test]
fn a_member_is_warned_before_its_own_certificate_expires() {
    let r = root();
    let s = signer(&r, 1, Role::Leader, 0, NS);
    s.warn_within(Duration::from_secs(60));
    assert_eq!(
        s.warned_at_ms.load(Ordering::Relaxed),
        0,
        "an hour left, no warning"
    );
    s.warn_within(Duration::from_secs(7200));
    let first = s.warned_at_ms.load(Ordering::Relaxed);
    assert_ne!(first, 0, "warned at once");
    assert!(!s.warn_expiry(first + 60_000), "not again within the hour");
    assert!(s.warn_expiry(first + 3_600_001), "again an hour later");
}
