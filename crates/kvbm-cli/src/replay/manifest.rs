//! The persistent index of the G3 disk tier: which block (sequence hash) lives in which slot,
//! with the xxh3-128 of its payload as it was written.
//!
//! The disk file holds bytes and a per-slot header (length, slot, checksum) but not block
//! identity; this manifest adds it, so a later run with the same `--g3-dir` starts warm.
//!
//! Crash safety: the manifest is read at start and then **removed**; a new one is written
//! (to a temporary name, then renamed) only after a clean end of the run, once the disk file
//! has been synced. A run that dies half-way therefore leaves no manifest, and the next run
//! starts cold instead of trusting slots that may have been overwritten. The file ends with an
//! xxh3-64 of everything before it; a damaged or foreign file is ignored with a warning.
//!
//! On read, a block onboarded from G3 is checked twice: by the disk layer (header: slot,
//! length, payload checksum) and here (the payload's checksum must equal the one recorded for
//! that hash), which catches a slot that holds a valid block of another hash.
//!
//! ```text
//! "KVBMG3M1" | block_bytes u64 | num_slots u64 | count u64 | count × (hash u128, slot u64, xxh3-128 u128) | xxh3-64 u64
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"KVBMG3M1";
const ENTRY: usize = 16 + 8 + 16;

/// One G3 block: its slot and payload checksum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// Slot in the disk file.
    pub slot: usize,
    /// xxh3-128 of the payload written there.
    pub checksum: u128,
}

/// The in-memory manifest.
#[derive(Debug, Default)]
pub struct Manifest {
    /// By sequence hash.
    pub entries: HashMap<u128, Entry>,
}

/// The manifest's path inside a G3 directory.
pub fn path_in(dir: &Path) -> PathBuf {
    dir.join("g3.manifest")
}

/// What loading found.
#[derive(Debug)]
pub enum Loaded {
    /// No manifest (first run, or the previous run did not end cleanly).
    Missing,
    /// A manifest for another geometry or a damaged file: ignored, with why.
    Ignored(String),
    /// The entries whose slot fits `num_slots`.
    Found(Manifest),
}

impl Manifest {
    /// Reads the manifest of `dir` for `block_bytes`-byte blocks in `num_slots` slots.
    pub fn load(dir: &Path, block_bytes: usize, num_slots: usize) -> Loaded {
        let path = path_in(dir);
        let data = match std::fs::read(&path) {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Loaded::Missing,
            Err(e) => return Loaded::Ignored(format!("cannot read {}: {e}", path.display())),
        };
        let bad = |why: &str| Loaded::Ignored(format!("{}: {why}", path.display()));
        if data.len() < 8 + 24 + 8 || &data[..8] != MAGIC {
            return bad("not a kvbm G3 manifest");
        }
        let (body, tail) = data.split_at(data.len() - 8);
        let sum = u64::from_le_bytes(tail.try_into().expect("8 bytes"));
        if xxhash_rust::xxh3::xxh3_64(body) != sum {
            return bad("checksum mismatch (damaged file)");
        }
        let u64_at = |o: usize| u64::from_le_bytes(body[o..o + 8].try_into().expect("8 bytes"));
        let (bb, count) = (u64_at(8) as usize, u64_at(24) as usize);
        if bb != block_bytes {
            return bad(&format!(
                "written for {bb}-byte blocks, this run uses {block_bytes}"
            ));
        }
        if body.len() != 32 + count * ENTRY {
            return bad("length does not match its entry count");
        }
        let mut entries = HashMap::with_capacity(count);
        for e in body[32..].chunks_exact(ENTRY) {
            let hash = u128::from_le_bytes(e[..16].try_into().expect("16 bytes"));
            let slot = u64::from_le_bytes(e[16..24].try_into().expect("8 bytes")) as usize;
            let checksum = u128::from_le_bytes(e[24..40].try_into().expect("16 bytes"));
            if slot < num_slots {
                entries.insert(hash, Entry { slot, checksum });
            }
        }
        Loaded::Found(Manifest { entries })
    }

    /// Removes the manifest of `dir` (called once it has been read: see the module docs).
    pub fn remove(dir: &Path) -> std::io::Result<()> {
        match std::fs::remove_file(path_in(dir)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// Writes `entries` atomically (temporary file, fsync, rename).
    pub fn save(
        dir: &Path,
        block_bytes: usize,
        num_slots: usize,
        entries: &[(u128, Entry)],
    ) -> std::io::Result<()> {
        use std::io::Write;
        let mut body = Vec::with_capacity(32 + entries.len() * ENTRY + 8);
        body.extend_from_slice(MAGIC);
        body.extend_from_slice(&(block_bytes as u64).to_le_bytes());
        body.extend_from_slice(&(num_slots as u64).to_le_bytes());
        body.extend_from_slice(&(entries.len() as u64).to_le_bytes());
        for (hash, e) in entries {
            body.extend_from_slice(&hash.to_le_bytes());
            body.extend_from_slice(&(e.slot as u64).to_le_bytes());
            body.extend_from_slice(&e.checksum.to_le_bytes());
        }
        let sum = xxhash_rust::xxh3::xxh3_64(&body);
        body.extend_from_slice(&sum.to_le_bytes());
        let tmp = dir.join("g3.manifest.tmp");
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&body)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path_in(dir))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_then_damage_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            Manifest::load(dir.path(), 4096, 8),
            Loaded::Missing
        ));
        let entries = vec![
            (
                1u128,
                Entry {
                    slot: 3,
                    checksum: 9,
                },
            ),
            (
                2u128,
                Entry {
                    slot: 9,
                    checksum: 7,
                },
            ),
        ];
        Manifest::save(dir.path(), 4096, 16, &entries).unwrap();
        let Loaded::Found(m) = Manifest::load(dir.path(), 4096, 8) else {
            panic!("expected a manifest")
        };
        assert_eq!(m.entries.len(), 1, "slot 9 does not fit 8 slots");
        assert_eq!(
            m.entries[&1],
            Entry {
                slot: 3,
                checksum: 9
            }
        );
        assert!(matches!(
            Manifest::load(dir.path(), 8192, 8),
            Loaded::Ignored(_)
        ));
        let p = path_in(dir.path());
        let mut d = std::fs::read(&p).unwrap();
        d[40] ^= 1;
        std::fs::write(&p, d).unwrap();
        assert!(matches!(
            Manifest::load(dir.path(), 4096, 8),
            Loaded::Ignored(_)
        ));
        Manifest::remove(dir.path()).unwrap();
        assert!(matches!(
            Manifest::load(dir.path(), 4096, 8),
            Loaded::Missing
        ));
    }
}
