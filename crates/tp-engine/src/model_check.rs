//! Start-up check of the model under mpirun: every rank opens the model file on its own host
//! and the ranks compare its size and a SHA-256 of its header (GGUF: the bytes before the
//! tensor data, which describe every tensor's dtype, shape and range; HF: config.json and
//! each safetensors header). A host whose file is missing, unreadable or different stops
//! the job before loading, named, instead of producing garbage later. A difference inside
//! the tensor data alone is not caught (that would mean reading the whole file on every host).

use crate::launch::host_of;
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};
use tp_comm::{CommError, CommExt, Group};
use tp_models::{open_checkpoint, Checkpoint, GgufCheckpoint, ModelError};

/// Why a host's model could not be identified, or why the hosts' models disagree.
#[derive(Debug, thiserror::Error)]
pub enum ModelCheckError {
    #[error(transparent)]
    Open(#[from] ModelError),
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} is not a usable model file: {what}", path.display())]
    Malformed { path: PathBuf, what: String },
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(
        "the model {} is missing or differs on {hosts} ({views}); every host needs the same \
         file at the same path (compare `sha256sum` of it on each host)",
        path.display()
    )]
    Differs {
        path: PathBuf,
        /// The hosts of the ranks whose copy is missing or different, comma separated.
        hosts: String,
        /// Each such rank's view (and rank 0's), "; " separated.
        views: String,
    },
}

fn read_error(path: &Path) -> impl FnOnce(std::io::Error) -> ModelCheckError + '_ {
    move |source| ModelCheckError::Read {
        path: path.to_path_buf(),
        source,
    }
}

fn malformed(path: &Path, what: impl Into<String>) -> ModelCheckError {
    ModelCheckError::Malformed {
        path: path.to_path_buf(),
        what: what.into(),
    }
}

/// What a host's copy of the model looks like from outside.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelIdentity {
    /// Bytes of the file (HF: of every safetensors file).
    pub bytes: u64,
    pub header_sha256: [u8; 32],
}

impl std::fmt::Display for ModelIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let short: String = self.header_sha256[..6]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        write!(f, "{} bytes, header sha256 {short}...", self.bytes)
    }
}

/// Largest header hashed (a safetensors header says its own length; GGUF headers of big
/// vocabularies are a few MB).
const MAX_HEADER: u64 = 256 << 20;

/// Opens the checkpoint at `path` and identifies the file(s).
pub fn open_and_identify(
    path: &Path,
) -> Result<(Box<dyn Checkpoint>, ModelIdentity), ModelCheckError> {
    let hf_dir = hf_dir(path);
    if let Some(dir) = hf_dir {
        let ckpt = open_checkpoint(path)?;
        let id = identify_hf(&dir)?;
        return Ok((ckpt, id));
    }
    if !path.exists() {
        // open_checkpoint's message says what to pass instead.
        return Err(open_checkpoint(path).err().map_or_else(
            || malformed(path, "it does not exist"),
            ModelCheckError::from,
        ));
    }
    let gguf = GgufCheckpoint::open(path)?;
    let bytes = gguf.file_bytes() as u64;
    let header = gguf.header().header_bytes;
    let header_sha256 = hash_prefix(path, header)?;
    Ok((
        Box::new(gguf),
        ModelIdentity {
            bytes,
            header_sha256,
        },
    ))
}

/// The HF directory `path` stands for, if it is one (as `open_checkpoint` decides).
fn hf_dir(path: &Path) -> Option<PathBuf> {
    if path.is_dir() {
        return Some(path.to_path_buf());
    }
    let in_dir = path.extension().is_some_and(|e| e == "safetensors")
        || path.file_name().is_some_and(|n| n == "config.json");
    in_dir
        .then(|| path.parent().map(Path::to_path_buf))
        .flatten()
}

fn hash_prefix(path: &Path, len: u64) -> Result<[u8; 32], ModelCheckError> {
    if len > MAX_HEADER {
        return Err(malformed(path, format!("its header claims {len} bytes")));
    }
    let mut f = std::fs::File::open(path).map_err(read_error(path))?;
    let mut h = Sha256::new();
    let mut left = len;
    let mut buf = vec![0u8; 1 << 20];
    while left > 0 {
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let n = f.read(&mut buf[..want]).map_err(read_error(path))?;
        if n == 0 {
            return Err(malformed(path, "it ends inside its header"));
        }
        h.update(&buf[..n]);
        left -= n as u64;
    }
    Ok(h.finalize().into())
}

/// config.json, then each safetensors file (sorted by name): its name, size and header.
fn identify_hf(dir: &Path) -> Result<ModelIdentity, ModelCheckError> {
    let mut h = Sha256::new();
    let config = dir.join("config.json");
    h.update(std::fs::read(&config).map_err(read_error(&config))?);
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(read_error(dir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    let mut bytes = 0u64;
    for p in &files {
        let len = std::fs::metadata(p).map_err(read_error(p))?.len();
        let mut first = [0u8; 8];
        std::fs::File::open(p)
            .and_then(|mut f| f.read_exact(&mut first))
            .map_err(read_error(p))?;
        let header = u64::from_le_bytes(first)
            .checked_add(8)
            .filter(|&n| n <= len)
            .ok_or_else(|| malformed(p, "its header is longer than the file"))?;
        h.update(
            p.file_name()
                .map(|n| n.as_encoded_bytes())
                .unwrap_or_default(),
        );
        h.update(len.to_le_bytes());
        h.update(hash_prefix(p, header)?);
        bytes += len;
    }
    Ok(ModelIdentity {
        bytes,
        header_sha256: h.finalize().into(),
    })
}

/// Bytes of one rank's record: status, size, hash, then an error text.
const RECORD: usize = 512;
const TEXT_AT: usize = 50;

fn encode(mine: &Result<ModelIdentity, String>) -> Vec<u8> {
    let mut rec = vec![0u8; RECORD];
    match mine {
        Ok(id) => {
            rec[0] = 1;
            rec[8..16].copy_from_slice(&id.bytes.to_le_bytes());
            rec[16..48].copy_from_slice(&id.header_sha256);
        }
        Err(text) => {
            rec[0] = 2;
            let mut cut = text.len().min(RECORD - TEXT_AT);
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            rec[48..50].copy_from_slice(&(cut as u16).to_le_bytes());
            rec[TEXT_AT..TEXT_AT + cut].copy_from_slice(&text.as_bytes()[..cut]);
        }
    }
    rec
}

fn decode(rec: &[u8]) -> Result<ModelIdentity, String> {
    match rec.first() {
        Some(1) if rec.len() >= 48 => {
            let mut b = [0u8; 8];
            b.copy_from_slice(&rec[8..16]);
            let mut header_sha256 = [0u8; 32];
            header_sha256.copy_from_slice(&rec[16..48]);
            Ok(ModelIdentity {
                bytes: u64::from_le_bytes(b),
                header_sha256,
            })
        }
        Some(2) if rec.len() >= TEXT_AT => {
            let len = usize::from(u16::from_le_bytes([rec[48], rec[49]]));
            let text = rec.get(TEXT_AT..TEXT_AT + len).unwrap_or_default();
            Err(String::from_utf8_lossy(text).into_owned())
        }
        _ => Err("sent an unreadable model record".into()),
    }
}

/// Every rank's view of the model; all must be readable and equal to rank 0's. Called by
/// every rank of `g` (one all_gather); on a difference every rank returns the same error.
pub fn check_same_model(
    g: &Group,
    path: &Path,
    mine: &Result<ModelIdentity, String>,
) -> Result<(), ModelCheckError> {
    let n = g.size();
    let mut all = vec![0u8; RECORD * n];
    g.all_gather(&encode(mine), &mut all)?;
    let views: Vec<Result<ModelIdentity, String>> = all.chunks_exact(RECORD).map(decode).collect();
    compare(path, &views)
}

fn compare(path: &Path, views: &[Result<ModelIdentity, String>]) -> Result<(), ModelCheckError> {
    let reference = views.first().and_then(|v| v.as_ref().ok());
    let bad: Vec<usize> = (0..views.len())
        .filter(|&r| match (&views[r], reference) {
            (Ok(id), Some(r0)) => id != r0,
            _ => true,
        })
        .collect();
    if bad.is_empty() {
        return Ok(());
    }
    let show = |r: usize| match &views[r] {
        Ok(id) => format!("rank {r} on {}: {id}", host_of(r)),
        Err(e) => format!("rank {r} on {}: cannot open it: {e}", host_of(r)),
    };
    let mut lines: Vec<String> = Vec::new();
    if !bad.contains(&0) {
        lines.push(show(0));
    }
    lines.extend(bad.iter().map(|&r| show(r)));
    let hosts: Vec<String> = bad.iter().map(|&r| host_of(r)).collect();
    Err(ModelCheckError::Differs {
        path: path.to_path_buf(),
        hosts: hosts.join(", "),
        views: lines.join("; "),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(bytes: u64, h: u8) -> ModelIdentity {
        ModelIdentity {
            bytes,
            header_sha256: [h; 32],
        }
    }

    #[test]
    fn records_round_trip() {
        for v in [Ok(id(7, 3)), Err("no such file".to_string())] {
            assert_eq!(decode(&encode(&v)), v);
        }
        let long = Err("é".repeat(600));
        let back = decode(&encode(&long)).expect_err("an error");
        assert!(back.len() <= RECORD - TEXT_AT && back.starts_with('é'));
        assert!(decode(&[9u8; RECORD]).is_err());
        assert!(decode(&[]).is_err());
    }

    #[test]
    fn a_missing_or_different_file_names_its_rank() {
        let p = Path::new("/m.gguf");
        assert!(compare(p, &[Ok(id(1, 1)), Ok(id(1, 1))]).is_ok());
        let e = compare(p, &[Ok(id(1, 1)), Ok(id(1, 2)), Ok(id(1, 1))])
            .expect_err("differs")
            .to_string();
        assert!(e.contains("rank 1 on ") && !e.contains("rank 2 on"), "{e}");
        assert!(e.contains("rank 0 on "), "{e}");
        let e = compare(p, &[Ok(id(1, 1)), Err("gone".into())])
            .expect_err("missing")
            .to_string();
        assert!(e.contains("cannot open it: gone"), "{e}");
        let e = compare(p, &[Err("gone".into()), Ok(id(1, 1))])
            .expect_err("rank 0 missing")
            .to_string();
        assert!(e.contains("rank 0 on ") && e.contains("rank 1 on "), "{e}");
    }

    #[test]
    fn the_identity_of_a_gguf_file_is_its_size_and_header() {
        let dir = std::env::temp_dir().join(format!("tp-model-check-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let p = dir.join("a.bin");
        std::fs::write(&p, b"0123456789").expect("write");
        let a = hash_prefix(&p, 4).expect("hash");
        std::fs::write(&p, b"0123xxxxxx").expect("write");
        assert_eq!(hash_prefix(&p, 4).expect("hash"), a);
        std::fs::write(&p, b"0124xxxxxx").expect("write");
        assert_ne!(hash_prefix(&p, 4).expect("hash"), a);
        assert!(hash_prefix(&p, 11).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
