//! NATS decentralized authentication material for the test server in operator mode: an
//! operator, an account it trusts, a user of that account and its `.creds` file, and a user of
//! an account the operator never signed (whose login the server must refuse).
//!
//! Why here and not `nsc`: `nsc` is one more tool to install in CI; a NATS JWT is three
//! base64url parts (header, claims, an Ed25519 signature by the issuer's nkey over the first
//! two), which the `nkeys` crate already in the lock can sign.
//!
//! ```text
//!  operator key ──signs──► operator JWT (self-signed)        ─┐
//!       └──────signs──► account JWT (sub: account key)       ─┼─► nats-server: operator,
//!  account key ──signs──► user JWT (sub: user key) ─► .creds  │   resolver MEMORY, preload
//!  stray account key ──signs──► user JWT ─► foreign .creds   ─┘   (refused: unknown account)
//! ```

use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Result, anyhow};
use nkeys::KeyPair;
use serde_json::{Value, json};

/// base64url without padding (RFC 4648 §5), as JWTs are encoded.
fn b64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | (u32::from(b) << (16 - 8 * i)));
        for i in 0..=chunk.len() {
            out.push(ALPHABET[(n >> (18 - 6 * i)) as usize & 63] as char);
        }
    }
    out
}

/// A NATS JWT (claims version 2) about `subject`, issued and signed by `issuer`, with the
/// type-specific `nats` section.
fn jwt(issuer: &KeyPair, subject: &str, name: &str, nats: Value) -> Result<String> {
    let iat = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let claims = json!({
        // A unique id; the server does not recompute it.
        "jti": format!("{}{iat}", &subject[..16.min(subject.len())]),
        "iat": iat,
        "iss": issuer.public_key(),
        "name": name,
        "sub": subject,
        "nats": nats,
    });
    let head = b64url(br#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let body = b64url(claims.to_string().as_bytes());
    let signed = format!("{head}.{body}");
    let sig = issuer
        .sign(signed.as_bytes())
        .map_err(|e| anyhow!("signing a NATS JWT: {e}"))?;
    Ok(format!("{signed}.{}", b64url(&sig)))
}

/// Unlimited account limits (an omitted limit means zero, which refuses everything).
fn unlimited() -> Value {
    json!({
        "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
        "wildcards": true, "conn": -1, "leaf": -1,
    })
}

fn account_jwt(operator: &KeyPair, account: &KeyPair, name: &str) -> Result<String> {
    jwt(
        operator,
        &account.public_key(),
        name,
        json!({ "type": "account", "version": 2, "limits": unlimited(),
                "default_permissions": { "pub": {}, "sub": {} } }),
    )
}

fn user_jwt(account: &KeyPair, user: &KeyPair, name: &str) -> Result<String> {
    jwt(
        account,
        &user.public_key(),
        name,
        json!({ "type": "user", "version": 2, "pub": {}, "sub": {},
                "subs": -1, "data": -1, "payload": -1 }),
    )
}

/// A `.creds` file's text: the user JWT and its nkey seed, in the format `nsc` writes.
fn creds(jwt: &str, user: &KeyPair) -> Result<String> {
    let seed = user.seed().map_err(|e| anyhow!("nkey seed: {e}"))?;
    Ok(format!(
        "-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n\
         ************************* IMPORTANT *************************\n\
         NKEY Seed printed below can be used to sign and prove identity.\n\
         NKEYs are sensitive and should be treated as secrets.\n\n\
         -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n\n\
         *************************************************************\n"
    ))
}

/// What the operator-mode server and its tests need.
pub(crate) struct OperatorSetup {
    /// The server's configuration lines (operator, resolver, preloaded account).
    pub(crate) server_conf: String,
    /// A `.creds` file of a user of the trusted account.
    pub(crate) user_creds: String,
    /// A `.creds` file of a user of an account the operator never signed.
    pub(crate) foreign_creds: String,
}

/// A fresh operator, account and users (see the module docs).
pub(crate) fn operator_setup() -> Result<OperatorSetup> {
    let operator = KeyPair::new_operator();
    let account = KeyPair::new_account();
    let stray = KeyPair::new_account();
    let (user, foreign) = (KeyPair::new_user(), KeyPair::new_user());
    let op_jwt = jwt(
        &operator,
        &operator.public_key(),
        "kvbm-test-operator",
        json!({ "type": "operator", "version": 2 }),
    )?;
    let acc_jwt = account_jwt(&operator, &account, "TENANT_JWT")?;
    let server_conf = format!(
        "operator: \"{op_jwt}\"\nresolver: MEMORY\nresolver_preload: {{\n  {}: \"{acc_jwt}\"\n}}\n",
        account.public_key()
    );
    Ok(OperatorSetup {
        server_conf,
        user_creds: creds(&user_jwt(&account, &user, "instance_jwt")?, &user)?,
        foreign_creds: creds(&user_jwt(&stray, &foreign, "stranger")?, &foreign)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64url_matches_the_rfc_vectors() {
        for (raw, enc) in [
            ("", ""),
            ("f", "Zg"),
            ("fo", "Zm8"),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg"),
            ("fooba", "Zm9vYmE"),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(b64url(raw.as_bytes()), enc);
        }
        assert_eq!(b64url(&[0xfb, 0xff]), "-_8");
    }

    #[test]
    fn a_jwt_verifies_under_its_issuer_and_names_its_subject() {
        let issuer = KeyPair::new_account();
        let user = KeyPair::new_user();
        let token = user_jwt(&issuer, &user, "u").unwrap();
        let parts: Vec<&str> = token.split('.').collect();
        assert_eq!(parts.len(), 3);
        let sig = decode(parts[2]);
        let signed = format!("{}.{}", parts[0], parts[1]);
        issuer.verify(signed.as_bytes(), &sig).unwrap();
        assert!(
            KeyPair::new_account()
                .verify(signed.as_bytes(), &sig)
                .is_err()
        );
        let claims: Value = serde_json::from_slice(&decode(parts[1])).unwrap();
        assert_eq!(claims["sub"], user.public_key());
        assert_eq!(claims["iss"], issuer.public_key());
        assert_eq!(claims["nats"]["type"], "user");
    }

    /// The inverse of [`b64url`], for the test.
    fn decode(s: &str) -> Vec<u8> {
        let val = |c: u8| match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'-' => 62,
            _ => 63,
        };
        let mut out = Vec::new();
        for chunk in s.as_bytes().chunks(4) {
            let n = chunk
                .iter()
                .enumerate()
                .fold(0u32, |n, (i, &c)| n | (u32::from(val(c)) << (18 - 6 * i)));
            for i in 0..chunk.len() - 1 {
                out.push((n >> (16 - 8 * i)) as u8);
            }
        }
        out
    }
}
