//! Entry points of the fuzz targets (the `fuzz/` crate, run by `cargo xtask fuzz` and CI):
//! one per decoder of bytes another process sends, which must survive any input without a
//! panic or an overflow (issue 23). Not an API: hidden, and nothing here is used by kvbm.
//!
//! Each takes the fuzzer's bytes, decodes them the way the receiving code does, and, where
//! a decoded value feeds arithmetic (offsets, counts, lengths), runs that arithmetic too.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::security::{MemberCert, Role, RootKey, Signer, Verifier, VerifierConfig};

/// The data plane's request head and its hashes (what a server reads from a client), in both
/// protocol versions, and an authenticated client's or server's hello.
pub fn dataplane_request(data: &[u8]) {
    use super::dataplane::wire::{
        CLIENT_HELLO_MAGIC, HASH_LEN, HELLO_HEAD_LEN, Hello, REQUEST_HEAD_LEN, SERVER_HELLO_MAGIC,
        VERSION, VERSION_AUTH, decode_hashes, decode_request_version,
    };
    if let Some((head, rest)) = data.split_first_chunk::<HELLO_HEAD_LEN>() {
        for magic in [CLIENT_HELLO_MAGIC, SERVER_HELLO_MAGIC] {
            if let Ok((flags, len)) = Hello::decode_head(head, magic) {
                // The body's length is bounded before anything is read for it.
                assert!(len <= 256 + 64);
                if let Ok(h) = Hello::decode_body(flags, &rest[..rest.len().min(len)]) {
                    let _ = sealing().1.check_cert(&h.cert);
                }
            }
        }
    }
    let Some((head, rest)) = data.split_first_chunk::<REQUEST_HEAD_LEN>() else {
        return;
    };
    for version in [VERSION, VERSION_AUTH] {
        if let Ok(h) = decode_request_version(head, version) {
            // What the server computes before reading the hashes.
            let _ = (h.count as usize).checked_mul(HASH_LEN);
            let hashes = decode_hashes(rest);
            assert_eq!(hashes.len(), rest.len() / HASH_LEN);
        }
    }
}

/// The data plane's response head and a frame header (what a client reads from a server).
pub fn dataplane_response(data: &[u8]) {
    use super::dataplane::wire::{
        FRAME_HEADER_LEN, RESPONSE_HEAD_LEN, VERSION, VERSION_AUTH, decode_response_version,
    };
    let Some((head, rest)) = data.split_first_chunk::<RESPONSE_HEAD_LEN>() else {
        return;
    };
    for version in [VERSION, VERSION_AUTH] {
        let _ = decode_response_version(head, version);
    }
    if let Some((frame, _)) = rest.split_first_chunk::<FRAME_HEADER_LEN>()
        && let Ok(h) = kvbm_physical::checksum::BlockHeader::decode(frame, &|| "fuzz".into())
    {
        let _ = h.verify(0, &|| "fuzz".into());
        let _ = (h.len as usize).checked_add(FRAME_HEADER_LEN);
    }
}

/// A control request or response envelope as a worker or leader decodes it from NATS.
#[cfg(feature = "nats")]
pub fn control_envelope(data: &[u8]) {
    use super::transport::control::{ControlRequest, ControlResponse};
    let _ = super::transport::nats::fuzz_decode_envelope::<ControlRequest>(data);
    let _ = super::transport::nats::fuzz_decode_envelope::<ControlResponse>(data);
}

/// Worker rank heartbeats as a leader's membership takes them off the wire.
#[cfg(feature = "nats")]
pub fn rank_beat(data: &[u8]) {
    super::transport::membership::fuzz_beats(data);
}

/// A heartbeat, snapshot request or snapshot page as the presence protocol decodes it.
#[cfg(feature = "nats")]
pub fn presence(data: &[u8]) {
    super::instance::presence::fuzz_decode(data);
}

/// An event batch as the pub/sub decodes it from NATS.
#[cfg(feature = "nats")]
pub fn event_batch(data: &[u8]) {
    super::pubsub::nats::fuzz_decode(data);
}

/// A member certificate (its own decoder, then the verifier's check against a trust root).
pub fn member_cert(data: &[u8]) {
    if let Ok(cert) = MemberCert::decode(data) {
        assert_eq!(
            MemberCert::decode(&cert.encode()).ok().map(|c| c.encode()),
            Some(cert.encode())
        );
    }
    let _ = sealing().1.check_cert(data);
}

/// A sealed message: opened as it arrives, and a valid sealed message with the fuzzer's bytes
/// written over part of it (first byte: where; the rest: what), which must be refused unless
/// nothing changed.
pub fn sealed(data: &[u8]) {
    let (signer, verifier) = sealing();
    let _ = verifier.open(b"fuzz", data);
    let Some((&at, patch)) = data.split_first() else {
        return;
    };
    let good = signer.seal(b"fuzz", b"payload");
    let mut bad = good.clone();
    let at = at as usize % bad.len();
    let n = patch.len().min(bad.len() - at);
    bad[at..at + n].copy_from_slice(&patch[..n]);
    let opened = verifier.open(b"fuzz", &bad);
    if bad != good {
        assert!(opened.is_err(), "a changed sealed message opened");
    }
}

/// One signer and a verifier of its trust root, made once per process.
fn sealing() -> &'static (Signer, Verifier) {
    static S: OnceLock<(Signer, Verifier)> = OnceLock::new();
    S.get_or_init(|| {
        let root = RootKey::generate().expect("a root key");
        let cred = root
            .issue(
                kvbm_engine::InstanceId(7),
                Role::Leader,
                0,
                "fuzz",
                Duration::from_secs(3600),
            )
            .expect("a credential");
        let verifier = Verifier::new(
            root.trust_root(),
            VerifierConfig {
                namespace: "fuzz".into(),
                max_clock_skew: Duration::from_secs(60),
                replay_window: 1 << 20,
                max_senders: 16,
            },
        );
        (Signer::new(Arc::new(cred)), verifier)
    })
}
