//! The authenticated data plane's handshake (protocol version 3) and the session it yields:
//! see the [module docs](super) for the exchange.
//!
//! The client proves its key first: the server answers a hello with a fresh challenge (random
//! bytes, no key agreement, no signature), and only once the client's signature over its hello
//! and that challenge verifies under the certificate it sent, and the member is admitted (the
//! connection caps), does the server make its ephemeral key and sign. A copied certificate
//! buys a stranger 40 random bytes. The proof covers the client's ephemeral key and the
//! server's signature covers the whole transcript, and the session keys come from it, so the
//! client's first tagged request is its key confirmation (no second client signature).
//!
//! Both functions run under the caller's deadline (the whole handshake within
//! `io_timeout`) and read only bounded lengths: a hello head is 16 bytes, its body at most
//! [`wire::MAX_CERT_LEN`] + 64. They count nothing themselves: a [`Refused`] names the
//! [`Rejection`] the caller counts in the [`SecurityStats`](crate::security::SecurityStats)
//! and in its own stats.

use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::wire::{
    self, CHALLENGE_LEN, CHALLENGE_MAGIC, CLIENT_HELLO_MAGIC, FLAG_PAYLOAD_MAC, HELLO_HEAD_LEN,
    Hello, RESPONSE_HEAD_LEN, RESPONSE_MAGIC, SERVER_HELLO_MAGIC, SIG_LEN, Status, TAG_LEN,
};
use crate::security::{EphemeralKey, MemberCert, Rejection, Role, Sealing, SessionKeys};
use kvbm_engine::InstanceId;

/// One authenticated connection's keys and counters (one per direction: every tag this side
/// sends takes the next send counter, every tag it checks the next receive counter, so a
/// replayed, dropped or reordered frame fails its tag).
#[derive(Debug)]
pub(crate) struct Session {
    keys: SessionKeys,
    send: u64,
    recv: u64,
    /// Payloads are tagged too (either side asked for it).
    pub payload_mac: bool,
    /// Who the peer proved to be.
    pub peer: Arc<MemberCert>,
}

impl Session {
    /// The tag of the next thing this side sends, over `parts`.
    pub(crate) fn tag(&mut self, parts: &[&[u8]]) -> [u8; TAG_LEN] {
        let t = self.keys.tag_send(self.send, parts);
        self.send += 1;
        t
    }

    /// Whether `got` is the tag of the next thing the peer sends, over `parts`.
    pub(crate) fn check(&mut self, parts: &[&[u8]], got: &[u8; TAG_LEN]) -> bool {
        let ok = self.keys.check_recv(self.recv, parts, got);
        self.recv += 1;
        ok
    }
}

/// Why a handshake failed.
#[derive(Debug)]
pub(crate) struct Refused {
    /// The security refusal to count, if the peer failed a check (none for I/O failures, a
    /// peer that refused us, and a member turned away at a cap).
    pub rejection: Option<Rejection>,
    /// What the server answers (best effort): [`Status::AuthRequired`], or [`Status::Busy`]
    /// for a member turned away at a cap.
    pub status: Status,
    /// What happened, for the error.
    pub message: String,
}

impl Refused {
    fn rejected(r: Rejection, message: impl Into<String>) -> Self {
        Self {
            rejection: Some(r),
            status: Status::AuthRequired,
            message: message.into(),
        }
    }
    fn io(e: std::io::Error) -> Self {
        Self {
            rejection: None,
            status: Status::AuthRequired,
            message: format!("handshake I/O: {e}"),
        }
    }
    /// A proven member the server will not serve now (a connection cap): answered
    /// [`Status::Busy`], counted by the caller as a cap refusal, not as a security one.
    pub(crate) fn busy(message: impl Into<String>) -> Self {
        Self {
            rejection: None,
            status: Status::Busy,
            message: message.into(),
        }
    }
}

fn fresh() -> Result<(EphemeralKey, [u8; 32]), Refused> {
    let rng = |e: crate::security::SecurityError| Refused {
        rejection: None,
        status: Status::AuthRequired,
        message: format!("handshake: {e}"),
    };
    let key = EphemeralKey::generate().map_err(rng)?;
    let nonce = crate::security::random32().map_err(rng)?;
    Ok((key, nonce))
}

fn hello(sealing: &Sealing, payload_mac: bool, key: &EphemeralKey, nonce: [u8; 32]) -> Hello {
    Hello {
        flags: if payload_mac { FLAG_PAYLOAD_MAC } else { 0 },
        cert: sealing.signer.cert().encode(),
        ephemeral: key.public(),
        nonce,
    }
}

/// Who may be at the other end of a connection.
///
/// The instance plane connects leaders (an instance's server holds its G2 registrations); the
/// rank plane connects worker ranks of one rank number (a rank of an instance whose ranks are
/// processes serves the slices its leader lent, and pulls its own slice of a block from the
/// same rank of the holder: see `dataplane::rank`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Party {
    /// An instance's leader.
    Leader,
    /// A worker at this rank of an instance.
    Rank(u32),
}

impl Party {
    fn admits(self, cert: &MemberCert) -> bool {
        match self {
            Party::Leader => cert.role == Role::Leader,
            Party::Rank(r) => cert.role == Role::Worker && cert.rank == r,
        }
    }

    fn describe(self) -> String {
        match self {
            Party::Leader => "an instance's leader".to_owned(),
            Party::Rank(r) => format!("a worker at rank {r}"),
        }
    }
}

/// Checks a peer certificate: the root, the expiry, the namespace (tenant), and the role (and
/// rank) `party` names.
fn check_peer(
    sealing: &Sealing,
    cert: &[u8],
    who: &str,
    party: Party,
) -> Result<Arc<MemberCert>, Refused> {
    let cert = sealing
        .verifier
        .check_cert(cert)
        .map_err(|r| Refused::rejected(r, format!("{who}'s certificate refused: {r}")))?;
    if !party.admits(&cert) {
        return Err(Refused::rejected(
            Rejection::NotAllowed,
            format!("{who} is {cert}, not {}", party.describe()),
        ));
    }
    Ok(cert)
}

/// Reads the rest of a hello whose first 8 bytes (`first`) were already read: its head (the
/// body's length bounded before anything is read for it), then its body. Returns the hello's
/// bytes as sent (for the transcript) and the decoded hello.
async fn read_hello(
    stream: &mut TcpStream,
    first: [u8; 8],
    magic: u64,
    what: &str,
) -> Result<(Vec<u8>, Hello), Refused> {
    let mut head = [0u8; HELLO_HEAD_LEN];
    head[..8].copy_from_slice(&first);
    stream
        .read_exact(&mut head[8..])
        .await
        .map_err(Refused::io)?;
    let (flags, body_len) = Hello::decode_head(&head, magic)
        .map_err(|e| Refused::rejected(Rejection::Malformed, format!("{what}: {e}")))?;
    let mut bytes = vec![0u8; HELLO_HEAD_LEN + body_len];
    bytes[..HELLO_HEAD_LEN].copy_from_slice(&head);
    stream
        .read_exact(&mut bytes[HELLO_HEAD_LEN..])
        .await
        .map_err(Refused::io)?;
    let hello = Hello::decode_body(flags, &bytes[HELLO_HEAD_LEN..])
        .map_err(|e| Refused::rejected(Rejection::Malformed, format!("{what}: {e}")))?;
    Ok((bytes, hello))
}

/// The server's side, after it read the client hello's first 8 bytes (`first`, the hello
/// magic). The server's own work (an X25519 key, a signature) starts only once the client has
/// signed a fresh challenge with the key of the certificate it sent, and `admit` let the
/// proven member in (a connection cap; its value is handed back with the session): a hello
/// with a copied certificate gets 40 random bytes and nothing else.
pub(crate) async fn server<A>(
    stream: &mut TcpStream,
    sealing: &Sealing,
    party: Party,
    payload_mac: bool,
    first: [u8; 8],
    admit: impl FnOnce(&MemberCert) -> Result<A, Refused>,
) -> Result<(Session, A), Refused> {
    let (client_hello, theirs) =
        read_hello(stream, first, CLIENT_HELLO_MAGIC, "client hello").await?;
    let challenge = wire::encode_challenge(&crate::security::random32().map_err(|e| Refused {
        rejection: None,
        status: Status::AuthRequired,
        message: format!("handshake: {e}"),
    })?);
    stream.write_all(&challenge).await.map_err(Refused::io)?;
    let mut proof = [0u8; SIG_LEN];
    stream.read_exact(&mut proof).await.map_err(Refused::io)?;
    // The tenant check: a client of another namespace (or no member) gets nothing.
    let peer = check_peer(sealing, &theirs.cert, "the client", party)?;
    if !peer.verifies(&wire::client_proof(&client_hello, &challenge), &proof) {
        return Err(Refused::rejected(
            Rejection::BadSignature,
            format!("{peer}: the proof of its key does not verify"),
        ));
    }
    let admitted = admit(&peer)?;

    let (key, nonce) = fresh()?;
    let server_hello = hello(sealing, payload_mac, &key, nonce).encode(SERVER_HELLO_MAGIC);
    let transcript = wire::transcript(&client_hello, &challenge, &proof, &server_hello);
    let sig = sealing
        .signer
        .credential()
        .sign(&wire::server_signed(&transcript));
    let mut out = server_hello;
    out.extend_from_slice(&sig);
    stream.write_all(&out).await.map_err(Refused::io)?;
    let keys = key
        .agree(&theirs.ephemeral, &transcript, false)
        .map_err(|e| Refused::rejected(Rejection::Malformed, format!("{peer}: {e}")))?;
    Ok((
        Session {
            keys,
            send: 0,
            recv: 0,
            payload_mac: payload_mac || theirs.flags & FLAG_PAYLOAD_MAC != 0,
            peer,
        },
        admitted,
    ))
}

/// Reads the first 8 bytes of the server's next message: `Ok(magic)`, or the refusal it sent
/// in the plain protocol (the server is off, refused us, or is busy).
async fn next_magic(stream: &mut TcpStream) -> Result<[u8; 8], Refused> {
    let mut first = [0u8; 8];
    stream.read_exact(&mut first).await.map_err(Refused::io)?;
    if u64::from_le_bytes(first) != RESPONSE_MAGIC {
        return Ok(first);
    }
    let mut r = [0u8; RESPONSE_HEAD_LEN];
    r[..8].copy_from_slice(&first);
    stream.read_exact(&mut r[8..]).await.map_err(Refused::io)?;
    let (status, message) = match wire::decode_response(&r) {
        Ok((status, _)) => (
            status,
            format!("the server refused: {}", Status::describe(status)),
        ),
        Err(e) => (Status::AuthRequired as u32, e.message),
    };
    Err(Refused {
        rejection: None,
        status: if status == Status::Busy as u32 {
            Status::Busy
        } else {
            Status::AuthRequired
        },
        message,
    })
}

/// The client's side: proves this member to the server (its signature over the server's
/// challenge), and checks the server is a member of this namespace, `party` (a leader, or a
/// worker at a rank) of `expected` (the instance the client means to pull from).
pub(crate) async fn client(
    stream: &mut TcpStream,
    sealing: &Sealing,
    payload_mac: bool,
    expected: InstanceId,
    party: Party,
) -> Result<Session, Refused> {
    let (key, nonce) = fresh()?;
    let client_hello = hello(sealing, payload_mac, &key, nonce).encode(CLIENT_HELLO_MAGIC);
    stream.write_all(&client_hello).await.map_err(Refused::io)?;

    let first = next_magic(stream).await?;
    if u64::from_le_bytes(first) != CHALLENGE_MAGIC {
        return Err(Refused::rejected(
            Rejection::Malformed,
            format!(
                "the server sent {:#018x}, not a challenge",
                u64::from_le_bytes(first)
            ),
        ));
    }
    let mut challenge = [0u8; CHALLENGE_LEN];
    challenge[..8].copy_from_slice(&first);
    stream
        .read_exact(&mut challenge[8..])
        .await
        .map_err(Refused::io)?;
    let proof = sealing
        .signer
        .credential()
        .sign(&wire::client_proof(&client_hello, &challenge));
    stream.write_all(&proof).await.map_err(Refused::io)?;

    let first = next_magic(stream).await?;
    let (server_hello, theirs) =
        read_hello(stream, first, SERVER_HELLO_MAGIC, "server hello").await?;
    let mut sig = [0u8; SIG_LEN];
    stream.read_exact(&mut sig).await.map_err(Refused::io)?;
    let peer = check_peer(sealing, &theirs.cert, "the server", party)?;
    // The server must be the instance we mean to pull from: a member answering at another's
    // address (a forged heartbeat, a reused port) is refused here, before any request.
    if peer.instance != expected {
        return Err(Refused::rejected(
            Rejection::NotAllowed,
            format!("the server is {peer}, not the instance asked for ({expected})"),
        ));
    }
    let transcript = wire::transcript(&client_hello, &challenge, &proof, &server_hello);
    if !peer.verifies(&wire::server_signed(&transcript), &sig) {
        return Err(Refused::rejected(
            Rejection::BadSignature,
            format!("{peer}: handshake signature does not verify"),
        ));
    }
    let keys = key
        .agree(&theirs.ephemeral, &transcript, true)
        .map_err(|e| Refused::rejected(Rejection::Malformed, format!("{peer}: {e}")))?;
    Ok(Session {
        keys,
        send: 0,
        recv: 0,
        payload_mac: payload_mac || theirs.flags & FLAG_PAYLOAD_MAC != 0,
        peer,
    })
}
