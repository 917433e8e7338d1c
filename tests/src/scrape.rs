//! Reads a running `kvbm`'s Prometheus endpoint (`--metrics-addr`): the fault tests assert from
//! what kvbm exports, as an operator would, rather than from its internals.
//!
//! The exposition format is parsed only as far as the tests need: one sample per line,
//! `name{label="value",...} number`, comments skipped.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// One sample: its labels and value.
pub type Sample = (BTreeMap<String, String>, f64);

/// `GET /metrics` from `127.0.0.1:port`; `None` when nothing answers (not up yet, or exited).
pub fn scrape(port: u16) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    let at = body.find("\r\n\r\n")?;
    Some(body[at + 4..].to_string())
}

/// Every sample of `name` in `text`.
pub fn samples(text: &str, name: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let (labels, value) = if let Some(l) = rest.strip_prefix('{') {
            let Some(end) = l.find('}') else { continue };
            (&l[..end], l[end + 1..].trim())
        } else if rest.starts_with(' ') {
            ("", rest.trim())
        } else {
            continue; // another metric whose name starts with `name`
        };
        let Ok(v) = value.split_whitespace().next().unwrap_or("").parse::<f64>() else {
            continue;
        };
        let map = labels
            .split(',')
            .filter_map(|kv| {
                let (k, v) = kv.split_once('=')?;
                Some((k.trim().to_string(), v.trim().trim_matches('"').to_string()))
            })
            .collect();
        out.push((map, v));
    }
    out
}

/// The value of the sample of `name` whose labels include every pair of `labels`.
pub fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples(text, name)
        .into_iter()
        .find(|(l, _)| {
            labels
                .iter()
                .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|(_, v)| v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_labelled_and_plain_samples() {
        let t = "# HELP x y\nkvbm_a{pipeline=\"g2_to_g4\",queue=\"input\"} 12\nkvbm_a{pipeline=\"g1_to_g2\",queue=\"input\"} 3\nkvbm_ab 7\nkvbm_b 1.5\n";
        assert_eq!(
            sample(t, "kvbm_a", &[("pipeline", "g2_to_g4"), ("queue", "input")]),
            Some(12.0)
        );
        assert_eq!(samples(t, "kvbm_a").len(), 2);
        assert_eq!(sample(t, "kvbm_b", &[]), Some(1.5));
        assert_eq!(sample(t, "kvbm_c", &[]), None);
    }
}
