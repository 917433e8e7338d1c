//! One Mooncake trace line, parsed: `{"timestamp": ms, "input_length": n, "output_length": m,
//! "hash_ids": [..]}`, with an optional `"conversation_id": n` (not in the Mooncake traces;
//! `kvbm replay --instances` assigns requests to instances by it when present).
//!
//! Self-contained (serde, serde_json and thiserror only) so the `fuzz/` crate includes this file
//! as is and fuzzes the very parser the replay uses.

use serde::Deserialize;

/// A parsed line: arrival time (ms) and prefix-block ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TraceLine {
    /// Arrival time in whole milliseconds.
    pub timestamp_ms: u64,
    /// Prefix-block ids of the prompt.
    pub hash_ids: Vec<u64>,
    /// The conversation the request belongs to, when the trace says.
    pub conversation: Option<u64>,
}

/// Why a line is not a Mooncake request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub(crate) struct MalformedLine(pub String);

#[derive(Deserialize)]
struct Line {
    timestamp: f64,
    #[allow(dead_code)]
    input_length: u64,
    #[allow(dead_code)]
    output_length: u64,
    hash_ids: Vec<u64>,
    #[serde(default)]
    conversation_id: Option<u64>,
}

/// Parses one line; `Ok(None)` for a blank line.
///
/// # Errors
/// [`MalformedLine`] saying what is wrong (bad JSON, a missing or mistyped field, a negative or
/// non-finite timestamp).
pub(crate) fn parse_trace_line(text: &str) -> Result<Option<TraceLine>, MalformedLine> {
    if text.trim().is_empty() {
        return Ok(None);
    }
    let parsed: Line = serde_json::from_str(text).map_err(|e| MalformedLine(e.to_string()))?;
    if !(parsed.timestamp.is_finite() && parsed.timestamp >= 0.0) {
        return Err(MalformedLine(format!(
            "timestamp {} is not a non-negative number of milliseconds",
            parsed.timestamp
        )));
    }
    Ok(Some(TraceLine {
        timestamp_ms: parsed.timestamp as u64,
        hash_ids: parsed.hash_ids,
        conversation: parsed.conversation_id,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn good_blank_and_bad_lines() {
        let l = parse_trace_line(
            r#"{"timestamp": 12.7, "input_length": 1, "output_length": 2, "hash_ids": [3, 4]}"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!(l.timestamp_ms, 12);
        assert_eq!(l.hash_ids, [3, 4]);
        assert_eq!(parse_trace_line("   ").unwrap(), None);
        for (bad, why) in [
            ("{", "EOF"),
            (
                r#"{"timestamp": -1, "input_length": 1, "output_length": 2, "hash_ids": []}"#,
                "non-negative",
            ),
            (
                r#"{"timestamp": 1, "input_length": 1, "output_length": 2}"#,
                "hash_ids",
            ),
            (
                r#"{"timestamp": 1, "input_length": 1, "output_length": 2, "hash_ids": [-1]}"#,
                "invalid value",
            ),
        ] {
            let e = parse_trace_line(bad).unwrap_err();
            assert!(e.0.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn arbitrary_text_never_panics() {
        // A deterministic sweep over mutated lines (the fuzz target explores further).
        let base =
            br#"{"timestamp": 1e3, "input_length": 5, "output_length": 2, "hash_ids": [1, 2, 3]}"#;
        let mut state = 0x1234_5678u64;
        for _ in 0..20_000 {
            let mut b = base.to_vec();
            for _ in 0..3 {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let i = (state >> 33) as usize % b.len();
                b[i] = (state >> 16) as u8;
            }
            let _ = parse_trace_line(&String::from_utf8_lossy(&b));
        }
    }
}
