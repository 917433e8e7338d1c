//! Object keys and put modes: the object tier's vocabulary, free of the `object_store` stack.
//!
//! These types are what the transfer manager's options and the layers above name objects with,
//! so they exist in every build; [`ObjectStorage`](crate::ObjectStorage) itself (and its
//! `object_store` dependency tree) is behind the default `object` feature. The key parser is
//! here too, so the fuzz crate builds it without that tree (`fuzz/`, `default-features = false`).

use crate::error::{PhysicalError, Result};

/// Opaque key material of an object-tier block (the layer above derives it from a sequence
/// hash). Hash keys render as 32 lowercase hex digits.
#[derive(
    Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct ObjectKey(String);

impl ObjectKey {
    /// A key from 128 bits of hash.
    pub fn from_u128(v: u128) -> Self {
        ObjectKey(format!("{v:032x}"))
    }
    /// A key from a string (must be a valid object path segment sequence).
    pub fn new(s: impl Into<String>) -> Self {
        ObjectKey(s.into())
    }
    /// The key text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
    /// The 128-bit hash this key names, when it is a hash key ([`parse_hash_key`]).
    ///
    /// # Errors
    /// As [`parse_hash_key`].
    pub fn parse_hash(&self) -> Result<u128> {
        parse_hash_key(&self.0)
    }
}

/// Parses a block object key: exactly 32 lowercase hex digits, the rendering of
/// [`ObjectKey::from_u128`] (so every accepted key renders back to itself; a sign, uppercase
/// digits or another length are refused).
///
/// # Errors
/// [`PhysicalError::InvalidArgument`] naming the key (its first 64 characters).
pub fn parse_hash_key(key: &str) -> Result<u128> {
    let ok = key.len() == 32 && key.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    if !ok {
        let shown: String = key.chars().take(64).collect();
        return Err(PhysicalError::InvalidArgument(format!(
            "object key {shown:?} is not a block key (32 lowercase hex digits)"
        )));
    }
    u128::from_str_radix(key, 16).map_err(|e| {
        PhysicalError::InvalidArgument(format!("object key {key:?} is not a block key: {e}"))
    })
}

impl From<u128> for ObjectKey {
    fn from(v: u128) -> Self {
        ObjectKey::from_u128(v)
    }
}
impl From<String> for ObjectKey {
    fn from(s: String) -> Self {
        ObjectKey(s)
    }
}
impl From<&str> for ObjectKey {
    fn from(s: &str) -> Self {
        ObjectKey(s.to_string())
    }
}
impl std::fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// How a block put treats an existing object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ObjectPutMode {
    /// Replace it. Default.
    #[default]
    Overwrite,
    /// Fail with [`PhysicalError::AlreadyExists`] (conditional create).
    Create,
}
