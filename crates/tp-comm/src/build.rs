//! This program's build fingerprint: the crate version and the executable's GNU build id
//! (a hash the linker writes into every ELF it links), so that processes of one job can check
//! at start that they run the same build.
//!
//! The build id is read from the `PT_NOTE` segments of `/proc/self/exe` (a few KiB, not the
//! whole file). An executable without one (linked with `--build-id=none`) is identified by a
//! 64-bit FNV-1a hash of its bytes instead, which reads the whole file once.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

/// `PT_NOTE` program header type.
const PT_NOTE: u32 = 4;
/// `NT_GNU_BUILD_ID` note type.
const NT_GNU_BUILD_ID: u32 = 3;
/// Longest note segment read (build-id notes are 36 bytes; other notes a few hundred).
const MAX_NOTE_SEGMENT: u64 = 1 << 16;

/// How this build identifies itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BuildFingerprint {
    /// The tp-comm crate version (the workspace version).
    pub version: String,
    /// `build-id HEX`, `file-hash HEX`, or `unknown (WHY)` when the executable cannot be read.
    pub build: String,
}

impl std::fmt::Display for BuildFingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "version {}, {}", self.version, self.build)
    }
}

/// The fingerprint of the running executable.
pub fn this_build() -> BuildFingerprint {
    let exe = Path::new("/proc/self/exe");
    let build = match gnu_build_id(exe) {
        Ok(Some(id)) => format!("build-id {}", hex(&id)),
        Ok(None) => match file_hash(exe) {
            Ok(h) => format!("file-hash {h:016x}"),
            Err(e) => format!("unknown (cannot read the executable: {e})"),
        },
        Err(e) => format!("unknown (cannot read the executable: {e})"),
    };
    BuildFingerprint {
        version: env!("CARGO_PKG_VERSION").to_string(),
        build,
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The GNU build id of the ELF file at `path`; `None` when it is not a 64-bit little-endian
/// ELF or has no build-id note.
pub fn gnu_build_id(path: &Path) -> std::io::Result<Option<Vec<u8>>> {
    let mut f = File::open(path)?;
    let mut eh = [0u8; 64];
    if f.read_exact(&mut eh).is_err() {
        return Ok(None);
    }
    // ELF magic, 64-bit class (2), little endian (1).
    if eh[..4] != *b"\x7fELF" || eh[4] != 2 || eh[5] != 1 {
        return Ok(None);
    }
    let u16_at = |b: &[u8], o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
    let u32_at = |b: &[u8], o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
    let u64_at = |b: &[u8], o: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[o..o + 8]);
        u64::from_le_bytes(w)
    };
    let phoff = u64_at(&eh, 0x20);
    let phentsize = usize::from(u16_at(&eh, 0x36));
    let phnum = usize::from(u16_at(&eh, 0x38));
    if phentsize < 56 || phnum == 0 {
        return Ok(None);
    }
    let mut ph = vec![0u8; phentsize * phnum];
    f.seek(SeekFrom::Start(phoff))?;
    if f.read_exact(&mut ph).is_err() {
        return Ok(None);
    }
    for p in ph.chunks_exact(phentsize) {
        if u32_at(p, 0) != PT_NOTE {
            continue;
        }
        let (offset, size) = (u64_at(p, 8), u64_at(p, 32));
        if size > MAX_NOTE_SEGMENT {
            continue;
        }
        let mut notes = vec![0u8; size as usize];
        f.seek(SeekFrom::Start(offset))?;
        if f.read_exact(&mut notes).is_err() {
            continue;
        }
        if let Some(id) = find_build_id(&notes) {
            return Ok(Some(id));
        }
    }
    Ok(None)
}

/// Walks ELF notes (`namesz`, `descsz`, `type`, name and desc each padded to 4 bytes).
fn find_build_id(mut notes: &[u8]) -> Option<Vec<u8>> {
    let pad = |n: usize| n.checked_add(3).map(|v| v & !3);
    while notes.len() >= 12 {
        let word =
            |o: usize| u32::from_le_bytes([notes[o], notes[o + 1], notes[o + 2], notes[o + 3]]);
        let namesz = usize::try_from(word(0)).ok()?;
        let descsz = usize::try_from(word(4)).ok()?;
        let kind = word(8);
        let name_end = 12usize.checked_add(pad(namesz)?)?;
        let desc_end = name_end.checked_add(pad(descsz)?)?;
        if desc_end > notes.len() {
            return None;
        }
        if kind == NT_GNU_BUILD_ID && notes[12..12 + namesz] == *b"GNU\0" && descsz > 0 {
            return Some(notes[name_end..name_end + descsz].to_vec());
        }
        notes = &notes[desc_end..];
    }
    None
}

/// FNV-1a (64 bit) of the whole file.
fn file_hash(path: &Path) -> std::io::Result<u64> {
    let mut f = File::open(path)?;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            return Ok(h);
        }
        for &b in &buf[..n] {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn note(name: &[u8], kind: u32, desc: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&(name.len() as u32).to_le_bytes());
        v.extend_from_slice(&(desc.len() as u32).to_le_bytes());
        v.extend_from_slice(&kind.to_le_bytes());
        v.extend_from_slice(name);
        v.resize(v.len().div_ceil(4) * 4, 0);
        v.extend_from_slice(desc);
        v.resize(v.len().div_ceil(4) * 4, 0);
        v
    }

    #[test]
    fn finds_the_build_id_after_other_notes() {
        let mut notes = note(b"GNU\0", 1, &[0; 16]); // NT_GNU_ABI_TAG
        notes.extend(note(b"GNU\0", NT_GNU_BUILD_ID, &[0xab; 20]));
        assert_eq!(find_build_id(&notes), Some(vec![0xab; 20]));
    }

    #[test]
    fn truncated_or_foreign_notes_give_none() {
        let notes = note(b"GNU\0", NT_GNU_BUILD_ID, &[1; 20]);
        assert_eq!(find_build_id(&notes[..notes.len() - 4]), None);
        assert_eq!(
            find_build_id(&note(b"Go\0\0", NT_GNU_BUILD_ID, &[1; 8])),
            None
        );
        let mut huge = notes.clone();
        huge[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(find_build_id(&huge), None);
    }

    #[test]
    fn this_test_binary_has_a_fingerprint() {
        let fp = this_build();
        assert_eq!(fp.version, env!("CARGO_PKG_VERSION"));
        assert!(
            fp.build.starts_with("build-id ") || fp.build.starts_with("file-hash "),
            "{fp}"
        );
    }

    #[test]
    fn a_file_that_is_not_elf_has_no_build_id() {
        let p = std::env::temp_dir().join(format!("tp-comm-not-elf-{}", std::process::id()));
        std::fs::write(&p, b"#!/bin/sh\necho hi\n").expect("write");
        assert_eq!(gnu_build_id(&p).expect("readable"), None);
        let _ = std::fs::remove_file(&p);
    }
}
