//! The data plane's key agreement: ephemeral X25519, and the per-direction keys derived from
//! it and the handshake transcript.
//!
//! Both ends sign the transcript (both certificates, both ephemeral public keys, both nonces)
//! with their member keys, so a party in the middle can neither read the agreed secret nor
//! substitute its own ephemeral key. The session keys tag frames ([`SessionKeys::tag`]).

use curve25519_dalek::montgomery::MontgomeryPoint;

use super::{SecurityError, random32};

/// One side's ephemeral X25519 key for one handshake.
pub struct EphemeralKey {
    secret: [u8; 32],
}

impl std::fmt::Debug for EphemeralKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EphemeralKey(redacted)")
    }
}

impl EphemeralKey {
    /// A fresh key from the operating system's random source.
    ///
    /// # Errors
    /// [`SecurityError::Random`].
    pub fn generate() -> Result<Self, SecurityError> {
        Ok(Self {
            secret: random32()?,
        })
    }

    /// The public key to send.
    pub fn public(&self) -> [u8; 32] {
        MontgomeryPoint::mul_base_clamped(self.secret).to_bytes()
    }

    /// The session keys agreed with `peer_public`, bound to `transcript`; `initiator` says which
    /// side this is (each direction gets its own key).
    ///
    /// # Errors
    /// [`SecurityError::Invalid`] if the peer's key is a low-order point (the shared secret
    /// would be all zeros).
    pub fn agree(
        self,
        peer_public: &[u8; 32],
        transcript: &[u8],
        initiator: bool,
    ) -> Result<SessionKeys, SecurityError> {
        let shared = MontgomeryPoint(*peer_public)
            .mul_clamped(self.secret)
            .to_bytes();
        if shared == [0u8; 32] {
            return Err(SecurityError::Invalid(
                "peer's ephemeral key is a low-order point".into(),
            ));
        }
        let mut ikm = Vec::with_capacity(32 + transcript.len());
        ikm.extend_from_slice(&shared);
        ikm.extend_from_slice(transcript);
        let c2s = blake3::derive_key("kvbm data plane v1 client to server", &ikm);
        let s2c = blake3::derive_key("kvbm data plane v1 server to client", &ikm);
        let (send, recv) = if initiator { (c2s, s2c) } else { (s2c, c2s) };
        Ok(SessionKeys { send, recv })
    }
}

/// The two directions' frame keys of one data-plane connection.
#[derive(Clone)]
pub struct SessionKeys {
    send: [u8; 32],
    recv: [u8; 32],
}

impl std::fmt::Debug for SessionKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionKeys(redacted)")
    }
}

impl SessionKeys {
    /// The tag of the `counter`-th frame this side sends over `parts` (keyed BLAKE3, 128 bits).
    pub fn tag_send(&self, counter: u64, parts: &[&[u8]]) -> [u8; 16] {
        tag(&self.send, counter, parts)
    }

    /// Whether `tag` is the tag of the `counter`-th frame the peer sends over `parts`
    /// (compared in constant time).
    pub fn check_recv(&self, counter: u64, parts: &[&[u8]], got: &[u8; 16]) -> bool {
        use subtle::ConstantTimeEq;
        tag(&self.recv, counter, parts).ct_eq(got).into()
    }
}

fn tag(key: &[u8; 32], counter: u64, parts: &[&[u8]]) -> [u8; 16] {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(&counter.to_le_bytes());
    for p in parts {
        h.update(&(p.len() as u64).to_le_bytes());
        h.update(p);
    }
    let mut out = [0u8; 16];
    out.copy_from_slice(&h.finalize().as_bytes()[..16]);
    out
}
