//! What the replay serves: a Mooncake FAST'25 JSONL trace, or the built-in synthetic
//! multi-turn workload.
//!
//! A Mooncake line is `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids":
//! [..]}`; `hash_ids` are prefix-block ids (512 tokens per block): two requests share a block id
//! only when they share the whole prefix up to it. Each id is turned into a chained
//! [`SequenceHash`] (`root` for the first block, `child` for the next), with the id as the
//! block's one "token", so the replay's block identity is position-aware like a real engine's.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use kvbm_logical::{Salt, SequenceHash};

use super::trace_line::parse_trace_line;

/// One request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Request {
    /// Arrival time in milliseconds from the start of the trace.
    pub timestamp_ms: u64,
    /// Prefix-block ids of the prompt.
    pub hash_ids: Vec<u64>,
    /// The conversation it belongs to (the synthetic workload's, or a trace's
    /// `conversation_id`); `None` when unknown.
    pub conversation: Option<u64>,
}

impl Request {
    /// What `--instances` assigns by: the conversation, or else the first block id (a
    /// conversation's turns share their first block).
    pub(crate) fn assignment_key(&self) -> (bool, u64) {
        match self.conversation {
            Some(c) => (true, c),
            None => (false, self.hash_ids.first().copied().unwrap_or(0)),
        }
    }
}

/// A whole workload, in arrival order.
#[derive(Debug, Clone)]
pub(crate) struct Workload {
    /// Where it came from (a path, or the synthetic generator and its seed).
    pub source: String,
    /// The requests.
    pub requests: Vec<Request>,
}

impl Workload {
    /// Total blocks over all requests.
    pub(crate) fn total_blocks(&self) -> usize {
        self.requests.iter().map(|r| r.hash_ids.len()).sum()
    }

    /// Distinct block ids.
    pub(crate) fn unique_blocks(&self) -> usize {
        let mut seen = std::collections::HashSet::with_capacity(self.total_blocks());
        for r in &self.requests {
            seen.extend(r.hash_ids.iter().copied());
        }
        seen.len()
    }

    /// The longest request, in blocks.
    pub(crate) fn max_request_blocks(&self) -> usize {
        self.requests
            .iter()
            .map(|r| r.hash_ids.len())
            .max()
            .unwrap_or(0)
    }
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WorkloadError {
    /// The file could not be opened or read.
    #[error("cannot read trace {path}: {source}")]
    Read {
        /// The trace.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A line is not a Mooncake request.
    #[error("trace {path} line {line}: {message}")]
    Malformed {
        /// The trace.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What was wrong.
        message: String,
    },
    /// The trace holds no request.
    #[error("trace {0} holds no request")]
    Empty(PathBuf),
}

/// Reads a Mooncake JSONL trace; `limit` keeps only the first requests.
///
/// # Errors
/// [`WorkloadError`] naming the file, and the line for a malformed one.
pub(crate) fn load_trace(path: &Path, limit: Option<usize>) -> Result<Workload, WorkloadError> {
    let file = std::fs::File::open(path).map_err(|source| WorkloadError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let mut requests = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        if limit.is_some_and(|n| requests.len() >= n) {
            break;
        }
        let line = line.map_err(|source| WorkloadError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let parsed = parse_trace_line(&line).map_err(|e| WorkloadError::Malformed {
            path: path.to_path_buf(),
            line: i + 1,
            message: e.0,
        })?;
        if let Some(parsed) = parsed {
            requests.push(Request {
                timestamp_ms: parsed.timestamp_ms,
                hash_ids: parsed.hash_ids,
                conversation: parsed.conversation,
            });
        }
    }
    if requests.is_empty() {
        return Err(WorkloadError::Empty(path.to_path_buf()));
    }
    Ok(Workload {
        source: path.display().to_string(),
        requests,
    })
}

/// splitmix64: a small, fast, deterministic generator (the workload must not depend on a
/// library's stream staying stable).
#[derive(Debug, Clone)]
pub(crate) struct SplitMix(u64);

impl SplitMix {
    /// A generator from `seed`.
    pub(crate) fn new(seed: u64) -> Self {
        SplitMix(seed)
    }
    /// The next value.
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `lo..=hi`.
    pub(crate) fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }
}

/// Most conversations in progress at once.
const MAX_ACTIVE: usize = 1024;

struct Conversation {
    id: u64,
    context: Vec<u64>,
    turns_left: u64,
}

/// The built-in workload: multi-turn conversations over a few shared system prompts.
///
/// Each conversation starts with one of four system prompts (2–6 blocks, shared by every
/// conversation that uses it) and runs 2–8 turns; a turn's prompt is the whole conversation so
/// far plus 1–4 new user blocks, and its answer adds 1–2 blocks to the context of the next turn
/// (new to the cache: answers are never part of an earlier prompt). Up to 1024 conversations are
/// active at once and requests interleave among them, 0–50 ms apart, so a conversation's next
/// turn often comes after its blocks have left G1. Deterministic in `seed`.
pub(crate) fn synthetic(seed: u64, requests: usize) -> Workload {
    let mut rng = SplitMix::new(seed);
    let mut next_id = 0u64;
    let mut fresh = |n: u64| -> Vec<u64> {
        let v = (next_id..next_id + n).collect();
        next_id += n;
        v
    };
    let systems: Vec<Vec<u64>> = (0..4).map(|_| fresh(rng.range(2, 6))).collect();
    let mut active: Vec<Conversation> = Vec::new();
    let mut out = Vec::with_capacity(requests);
    let mut now = 0u64;
    let mut conversations = 0u64;
    while out.len() < requests {
        if active.len() < MAX_ACTIVE && (active.len() < 4 || rng.range(0, 1) == 0) {
            let sys = &systems[rng.range(0, 3) as usize];
            active.push(Conversation {
                id: conversations,
                context: sys.clone(),
                turns_left: rng.range(2, 8),
            });
            conversations += 1;
        }
        let pick = rng.range(0, active.len() as u64 - 1) as usize;
        let conv = &mut active[pick];
        let user = fresh(rng.range(1, 4));
        conv.context.extend(user);
        out.push(Request {
            timestamp_ms: now,
            hash_ids: conv.context.clone(),
            conversation: Some(conv.id),
        });
        let answer = fresh(rng.range(1, 2));
        conv.context.extend(answer);
        conv.turns_left -= 1;
        if conv.turns_left == 0 {
            active.swap_remove(pick);
        }
        now += rng.range(0, 50);
    }
    Workload {
        source: format!("synthetic multi-turn (seed {seed})"),
        requests: out,
    }
}

/// The chained sequence hashes of a request's blocks (block size 1: the id is the block's token).
pub(crate) fn sequence_hashes(salt: Salt, hash_ids: &[u64], out: &mut Vec<SequenceHash>) {
    out.clear();
    let mut prev: Option<SequenceHash> = None;
    for &id in hash_ids {
        let tokens = [id as u32, (id >> 32) as u32];
        // Two-token blocks keep the full 64-bit id; the manager's block size is 2.
        let h = match prev {
            None => SequenceHash::root(salt, &tokens),
            Some(p) => p.child(&tokens),
        };
        out.push(h);
        prev = Some(h);
    }
}

/// Tokens per logical block used for the sequence hashes (see [`sequence_hashes`]).
pub(crate) const HASH_BLOCK_SIZE: u32 = 2;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_is_deterministic_and_shares_prefixes() {
        let a = synthetic(7, 300);
        let b = synthetic(7, 300);
        assert_eq!(a.requests, b.requests);
        assert_ne!(a.requests, synthetic(8, 300).requests);
        assert_eq!(a.requests.len(), 300);
        let total = a.total_blocks();
        let unique = a.unique_blocks();
        assert!(unique < total, "multi-turn prompts must repeat blocks");
    }

    #[test]
    fn malformed_line_names_its_number() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.jsonl");
        std::fs::write(
            &p,
            "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n\nnot json\n",
        )
        .unwrap();
        let e = load_trace(&p, None).unwrap_err().to_string();
        assert!(e.contains("line 3"), "{e}");
    }

    #[test]
    fn hashes_are_chained_by_prefix() {
        let mut a = Vec::new();
        let mut b = Vec::new();
        sequence_hashes(Salt::NONE, &[1, 2, 3], &mut a);
        sequence_hashes(Salt::NONE, &[1, 2, 4], &mut b);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        let mut c = Vec::new();
        sequence_hashes(Salt::NONE, &[2, 3], &mut c);
        assert_ne!(c[0], a[1], "same id at another position is another block");
    }
}
