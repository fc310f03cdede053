//! The checksum manifest of a checkpoint directory (Megatron-LM keeps a SHA-256 per
//! checkpoint file): every file's size and SHA-256, verified before anything is loaded.

use crate::error::{Result, TrainError};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::Path;

pub const MANIFEST: &str = "manifest.json";

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub bytes: u64,
    pub sha256: String,
}

/// File name -> size and digest.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub files: BTreeMap<String, Entry>,
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl Manifest {
    pub fn add(&mut self, name: &str, bytes: &[u8]) {
        self.files.insert(
            name.to_string(),
            Entry {
                bytes: bytes.len() as u64,
                sha256: sha256_hex(bytes),
            },
        );
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default() + "\n"
    }

    /// Reads `dir/manifest.json`.
    pub fn read(dir: &Path) -> Result<Manifest> {
        let path = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&path).map_err(|e| {
            TrainError::checkpoint(
                &path,
                format!("cannot read the manifest ({e}); the checkpoint is incomplete: resume from another one"),
            )
        })?;
        serde_json::from_str(&text).map_err(|e| {
            TrainError::checkpoint(&path, format!("the manifest is not valid JSON ({e})"))
        })
    }

    /// Reads `dir/name`, checking it against its entry; the bytes on success.
    pub fn read_verified(&self, dir: &Path, name: &str) -> Result<Vec<u8>> {
        let path = dir.join(name);
        let entry = self.files.get(name).ok_or_else(|| {
            TrainError::checkpoint(&path, "the manifest has no entry for this file")
        })?;
        let bytes = std::fs::read(&path).map_err(|e| TrainError::io("read", &path, e))?;
        let actual = sha256_hex(&bytes);
        if bytes.len() as u64 != entry.bytes || actual != entry.sha256 {
            return Err(TrainError::Checksum {
                path,
                expected: format!("{} ({} bytes)", entry.sha256, entry.bytes),
                actual: format!("{actual} ({} bytes)", bytes.len()),
            });
        }
        Ok(bytes)
    }

    /// Checks the files a reader needs, `needed` ([`Manifest::read_verified`], one at a
    /// time), and only those: inference reads the model, config and tokenizer, so a
    /// checkpoint whose optimizer state was removed (to share the model) or damaged still
    /// loads there; resuming reads the optimizer too and verifies it
    /// ([`crate::Checkpoint::open`]). A file the manifest does not list is an error naming it.
    pub fn verify_files(&self, dir: &Path, needed: &[&str]) -> Result<()> {
        if let Some(name) = needed.iter().find(|n| !self.files.contains_key(**n)) {
            return Err(TrainError::checkpoint(
                dir.join(MANIFEST),
                format!("lists no {name}; the checkpoint is incomplete: use another one"),
            ));
        }
        for name in needed {
            self.read_verified(dir, name)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_digest_and_flip_detection() {
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let dir = std::env::temp_dir().join(format!("tp-train-manifest-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut m = Manifest::default();
        m.add("a.bin", b"hello");
        std::fs::write(dir.join("a.bin"), b"hello").unwrap();
        assert_eq!(m.read_verified(&dir, "a.bin").unwrap(), b"hello");
        std::fs::write(dir.join("a.bin"), b"hellp").unwrap();
        let e = m.read_verified(&dir, "a.bin").unwrap_err();
        assert!(matches!(e, TrainError::Checksum { .. }), "{e}");
        assert!(e.to_string().contains("a.bin is corrupt"), "{e}");
        let e = m.verify_files(&dir, &["a.bin"]).unwrap_err();
        assert!(matches!(e, TrainError::Checksum { .. }), "{e}");
        // A listed file the reader does not need may be damaged or gone.
        m.add("c.bin", b"state");
        m.verify_files(&dir, &[]).unwrap();
        std::fs::write(dir.join("a.bin"), b"hello").unwrap();
        m.verify_files(&dir, &["a.bin"]).unwrap();
        let e = m.verify_files(&dir, &["b.bin"]).unwrap_err();
        assert!(e.to_string().contains("lists no b.bin"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
