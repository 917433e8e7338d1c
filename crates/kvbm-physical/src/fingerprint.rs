//! What makes a stored block's bytes meaningful: the [`ModelFingerprint`].
//!
//! A block's payload is only KV for the model, dtype, KV layout, block geometry, KV group and
//! tensor-parallel rank that produced it. The same sequence hash under another model (or the
//! same model at another dtype, page size or TP rank) names other bytes. So every identity
//! that leaves the process binds a digest of those parts:
//!
//! * G4 object paths are `{namespace}/fp-{fingerprint}/…` and the object header's binding
//!   digest covers the fingerprint ([`ObjectStorage::with_fingerprint`](crate::ObjectStorage::with_fingerprint)),
//!   so instances with different fingerprints share a bucket and never list, probe or read
//!   each other's blocks;
//! * the G3 journal's header records it ([`JournalGeometry::fingerprint`](crate::JournalGeometry)):
//!   a journal written under another fingerprint starts the disk tier cold (a miss, never a
//!   hit; see [`crate::storage::journal`]);
//! * the cluster plane (kvbm-engine) scopes its event, heartbeat and snapshot subjects by it,
//!   so peers with another fingerprint are never seen.
//!
//! **Invariant:** a block written under one fingerprint is never served under another.
//!
//! # Digest
//!
//! BLAKE3 in key-derivation mode with the context [`FINGERPRINT_CONTEXT`] (domain separation
//! and the format version in one), over a tagged, length-prefixed encoding of every field,
//! truncated to 128 bits. The encoding is fixed: changing it means a new context string, and
//! every stored block of the old version becomes a miss. Fields, in order:
//!
//! | tag | field | encoding |
//! |---|---|---|
//! | `m` | model id | u64 length + UTF-8 |
//! | `d` | dtype name | u64 length + UTF-8 |
//! | `k` | KV layout within a region (e.g. `NHD`, `HND`) | u64 length + UTF-8 |
//! | `g` | per-block geometry: layers, outer dim, page size, inner dim, dtype bytes | 5 × u64 |
//! | `q` | KV group | u32 |
//! | `p` | parallelism: `0` canonical; `1`, world u64, rank u64; or `2`, tp, pp, pcp, dcp u64 | |
//! | `x` | engine parts, only when any is given: count u64, then per part (sorted by name) name and value, each u64 length + UTF-8 | |
//!
//! The `x` field is absent when no engine part is given, so adding the field left every
//! digest without parts unchanged. Engine parts carry what an engine's own configuration
//! says about the bytes that the fields above do not (vLLM: `tokens_per_hash`,
//! `blocks_per_chunk`, the KV groups' `tokens_per_block` and layer names, the canonical
//! format; see kvbm-vllm).
//!
//! The block count and the memory arrangement ([`LayoutKind`](crate::LayoutKind)) are not
//! bound: a stored payload is serialized region by region in (layer, outer) order whatever the
//! arrangement, so a fully contiguous and a layer-separate layout of one geometry store the
//! same bytes.

use crate::error::{PhysicalError, Result};
use crate::layout::LayoutConfig;

/// Bytes of a [`ModelFingerprint`] digest.
pub const FINGERPRINT_LEN: usize = 16;

/// BLAKE3 key-derivation context of the digest (domain and version).
pub const FINGERPRINT_CONTEXT: &str = "kvbm 2026-12 model fingerprint v1";

/// Longest model id, dtype or KV layout name accepted (bytes).
pub const MAX_NAME_LEN: usize = 256;

/// Longest engine part value accepted (bytes; a KV group's layer names can be long).
pub const MAX_PART_VALUE_LEN: usize = 64 << 10;

/// How the stored bytes relate to tensor parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Parallelism {
    /// The canonical, parallelism-free layout: any rank of any TP size reads the same bytes.
    Canonical,
    /// Per-rank bytes: rank `rank` of `world` ranks.
    Rank {
        /// This rank (below `world`).
        rank: usize,
        /// Tensor-parallel world size (at least 1).
        world: usize,
    },
    /// Every worker's bytes of an engine of this parallel shape, side by side in rank order:
    /// the rows of a node-shared offload region, as vLLM's scheduler-side tiers store them.
    /// Readable by any engine of the same shape, whatever its rank.
    Engine {
        /// Tensor-parallel size (at least 1).
        tp: usize,
        /// Pipeline-parallel size (at least 1).
        pp: usize,
        /// Prefill context-parallel size (at least 1).
        pcp: usize,
        /// Decode context-parallel size (at least 1).
        dcp: usize,
    },
}

/// A 128-bit digest of what makes a block's bytes meaningful (see the [module docs](self)).
/// Built only by [`ModelFingerprint::builder`], which validates every part.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModelFingerprint([u8; FINGERPRINT_LEN]);

impl ModelFingerprint {
    /// A builder; every part but the KV group (default 0) is required.
    pub fn builder() -> FingerprintBuilder {
        FingerprintBuilder::default()
    }

    /// The digest bytes.
    pub fn as_bytes(&self) -> &[u8; FINGERPRINT_LEN] {
        &self.0
    }

    /// Lowercase hex of the digest (32 characters).
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The path segment and subject token that scopes storage and messages: `fp-{hex}`.
    pub fn key_segment(&self) -> String {
        format!("fp-{}", self.to_hex())
    }

    /// The first 64 bits (little-endian), never 0 (0 means "no fingerprint" where a 64-bit
    /// field records one, e.g. the G3 journal header).
    pub fn short(&self) -> u64 {
        u64::from_le_bytes(self.0[..8].try_into().expect("8 bytes")).max(1)
    }
}

impl std::fmt::Debug for ModelFingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ModelFingerprint({})", self.to_hex())
    }
}

impl std::fmt::Display for ModelFingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.key_segment())
    }
}

/// Builds a [`ModelFingerprint`], checking each part.
#[derive(Debug, Clone, Default)]
pub struct FingerprintBuilder {
    model: Option<String>,
    dtype: Option<String>,
    kv_layout: Option<String>,
    geometry: Option<LayoutConfig>,
    kv_group: u32,
    parallelism: Option<Parallelism>,
    parts: std::collections::BTreeMap<String, String>,
}

impl FingerprintBuilder {
    /// The model id (e.g. `meta-llama/Llama-3.1-8B-Instruct@<revision>`). Required.
    pub fn model(mut self, model: impl Into<String>) -> Self {
        self.model = Some(model.into());
        self
    }

    /// The KV cache dtype name (e.g. `bfloat16`, `fp8_e4m3`). Required; a known name must
    /// agree with the geometry's `dtype_bytes`.
    pub fn dtype(mut self, dtype: impl Into<String>) -> Self {
        self.dtype = Some(dtype.into());
        self
    }

    /// How a region's `[tokens × inner]` elements are ordered (e.g. `NHD`, `HND`). Required.
    pub fn kv_layout(mut self, kv_layout: impl Into<String>) -> Self {
        self.kv_layout = Some(kv_layout.into());
        self
    }

    /// The per-block geometry (its block count is ignored). Required.
    pub fn geometry(mut self, geometry: LayoutConfig) -> Self {
        self.geometry = Some(geometry);
        self
    }

    /// The KV cache group (hybrid models have several). Default: 0.
    pub fn kv_group(mut self, group: u32) -> Self {
        self.kv_group = group;
        self
    }

    /// Per-rank or canonical bytes. Required.
    pub fn parallelism(mut self, p: Parallelism) -> Self {
        self.parallelism = Some(p);
        self
    }

    /// An engine part: something the engine's configuration says about the bytes that the
    /// other fields do not (e.g. vLLM's `tokens_per_hash`). Parts are bound by name, in name
    /// order; giving a name again replaces its value. Default: none.
    pub fn part(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.parts.insert(name.into(), value.into());
        self
    }

    /// The fingerprint.
    ///
    /// # Errors
    /// [`PhysicalError::InvalidArgument`] naming the part: a missing part; a model id, dtype
    /// or KV layout that is empty, longer than [`MAX_NAME_LEN`] or holds a control character;
    /// a known dtype whose size differs from `dtype_bytes`; a geometry dimension of 0; a
    /// world size of 0 or a rank not below it; an engine parallel size of 0; an engine part
    /// whose name is not a valid name (as a model id) or whose value is longer than 64 KiB.
    pub fn build(self) -> Result<ModelFingerprint> {
        let missing = |what: &str| {
            PhysicalError::InvalidArgument(format!("model fingerprint: no {what} given"))
        };
        let model = self.model.ok_or_else(|| missing("model id"))?;
        let dtype = self.dtype.ok_or_else(|| missing("dtype"))?;
        let kv_layout = self.kv_layout.ok_or_else(|| missing("KV layout"))?;
        let g = self.geometry.ok_or_else(|| missing("block geometry"))?;
        let parallelism = self.parallelism.ok_or_else(|| missing("parallelism"))?;
        check_name("model id", &model)?;
        check_name("dtype", &dtype)?;
        check_name("KV layout", &kv_layout)?;
        let dims = [
            ("num_layers", g.num_layers),
            ("outer_dim", g.outer_dim),
            ("page_size", g.page_size),
            ("inner_dim", g.inner_dim),
            ("dtype_bytes", g.dtype_bytes),
        ];
        if let Some((name, _)) = dims.iter().find(|(_, v)| *v == 0) {
            return Err(PhysicalError::InvalidArgument(format!(
                "model fingerprint: geometry {name} must be at least 1"
            )));
        }
        if let Some(size) = dtype_size(&dtype)
            && size != g.dtype_bytes
        {
            return Err(PhysicalError::InvalidArgument(format!(
                "model fingerprint: dtype {dtype} is {size} byte(s) per element, the geometry \
                 says dtype_bytes = {}",
                g.dtype_bytes
            )));
        }
        if let Parallelism::Rank { rank, world } = parallelism
            && (world == 0 || rank >= world)
        {
            return Err(PhysicalError::InvalidArgument(format!(
                "model fingerprint: tensor-parallel rank {rank} is not below world size {world}"
            )));
        }
        if let Parallelism::Engine { tp, pp, pcp, dcp } = parallelism
            && let Some((what, _)) = [("tp", tp), ("pp", pp), ("pcp", pcp), ("dcp", dcp)]
                .into_iter()
                .find(|(_, v)| *v == 0)
        {
            return Err(PhysicalError::InvalidArgument(format!(
                "model fingerprint: engine parallel size {what} must be at least 1"
            )));
        }
        for (name, value) in &self.parts {
            check_name("engine part name", name)?;
            if value.len() > MAX_PART_VALUE_LEN {
                return Err(PhysicalError::InvalidArgument(format!(
                    "model fingerprint: engine part {name} is {} bytes, more than {MAX_PART_VALUE_LEN}",
                    value.len()
                )));
            }
        }

        let mut h = blake3::Hasher::new_derive_key(FINGERPRINT_CONTEXT);
        for (tag, s) in [(b'm', &model), (b'd', &dtype), (b'k', &kv_layout)] {
            h.update(&[tag]);
            h.update(&(s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        }
        h.update(b"g");
        for (_, v) in dims {
            h.update(&(v as u64).to_le_bytes());
        }
        h.update(b"q");
        h.update(&self.kv_group.to_le_bytes());
        h.update(b"p");
        match parallelism {
            Parallelism::Canonical => {
                h.update(&[0]);
            }
            Parallelism::Rank { rank, world } => {
                h.update(&[1]);
                h.update(&(world as u64).to_le_bytes());
                h.update(&(rank as u64).to_le_bytes());
            }
            Parallelism::Engine { tp, pp, pcp, dcp } => {
                h.update(&[2]);
                for v in [tp, pp, pcp, dcp] {
                    h.update(&(v as u64).to_le_bytes());
                }
            }
        }
        if !self.parts.is_empty() {
            h.update(b"x");
            h.update(&(self.parts.len() as u64).to_le_bytes());
            for (name, value) in &self.parts {
                for s in [name, value] {
                    h.update(&(s.len() as u64).to_le_bytes());
                    h.update(s.as_bytes());
                }
            }
        }
        let mut out = [0u8; FINGERPRINT_LEN];
        out.copy_from_slice(&h.finalize().as_bytes()[..FINGERPRINT_LEN]);
        Ok(ModelFingerprint(out))
    }
}

/// Checks a model id, dtype or KV layout name as [`FingerprintBuilder::build`] does: 1 to
/// [`MAX_NAME_LEN`] bytes, no control character.
///
/// # Errors
/// [`PhysicalError::InvalidArgument`] naming `what`.
pub fn check_name(what: &str, s: &str) -> Result<()> {
    if s.is_empty() || s.len() > MAX_NAME_LEN || s.chars().any(char::is_control) {
        return Err(PhysicalError::InvalidArgument(format!(
            "model fingerprint: the {what} must be 1..={MAX_NAME_LEN} bytes without control \
             characters, got {s:?}"
        )));
    }
    Ok(())
}

/// Bytes per element of the dtype names kvbm knows (lowercase, as vLLM and PyTorch spell
/// them); `None` for any other name (accepted as given).
pub fn dtype_size(dtype: &str) -> Option<usize> {
    Some(match dtype.to_ascii_lowercase().as_str() {
        "float32" | "fp32" | "f32" => 4,
        "float16" | "fp16" | "f16" | "half" | "bfloat16" | "bf16" => 2,
        "fp8" | "fp8_e4m3" | "fp8_e5m2" | "float8_e4m3fn" | "float8_e5m2" | "uint8" | "int8" => 1,
        _ => return None,
    })
}

#[cfg(test)]
mod tests;
