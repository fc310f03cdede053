//! Crash-safe writing (docs/reliability.md R5): files go into a temporary directory and are
//! fsynced, the directory is fsynced and renamed into place, and the `latest` marker is
//! replaced (temporary file, fsync, rename, fsync of the parent) only after that. A crash at
//! any moment leaves `latest` naming the previous complete checkpoint.

use crate::error::{Result, TrainError};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;

/// Where a save is when the hook runs (for fault-injection drills and tests).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SavePoint<'a> {
    /// Half of `file`'s bytes are written to the temporary directory, not yet synced.
    PartWritten { file: &'a str },
    /// `file` is complete and fsynced in the temporary directory.
    FileWritten { file: &'a str },
    /// The step directory is renamed into place; `latest` still names the previous one.
    Renamed,
    /// `latest` names the new checkpoint.
    LatestWritten,
}

/// Called on the writing rank with the step being saved at each [`SavePoint`]; an error
/// aborts the save there (as a crash would, minus the process exit).
pub type SaveHook = std::sync::Arc<dyn Fn(u64, SavePoint<'_>) -> Result<()> + Send + Sync>;

/// Writes `bytes` to `path` (created new), calling `at` half-way and when synced.
pub fn write_synced(
    path: &Path,
    name: &str,
    bytes: &[u8],
    at: &dyn Fn(SavePoint<'_>) -> Result<()>,
) -> Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|e| TrainError::io("create", path, e))?;
    let half = bytes.len() / 2;
    f.write_all(&bytes[..half])
        .map_err(|e| TrainError::io("write", path, e))?;
    at(SavePoint::PartWritten { file: name })?;
    f.write_all(&bytes[half..])
        .map_err(|e| TrainError::io("write", path, e))?;
    f.sync_all().map_err(|e| TrainError::io("fsync", path, e))?;
    at(SavePoint::FileWritten { file: name })?;
    Ok(())
}

/// fsync of a directory, so the names in it (new files, renames) are durable.
pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| TrainError::io("fsync directory", dir, e))
}

/// Replaces `dir/name` with `text` atomically: temporary file, fsync, rename, fsync of `dir`.
pub fn replace_file(dir: &Path, name: &str, text: &str) -> Result<()> {
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    write_synced(&tmp, name, text.as_bytes(), &|_| Ok(()))?;
    let dst = dir.join(name);
    std::fs::rename(&tmp, &dst).map_err(|e| TrainError::io("rename", &tmp, e))?;
    sync_dir(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replace_file_swaps_content_and_leaves_no_temporary() {
        let dir = std::env::temp_dir().join(format!("tp-train-atomic-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        replace_file(&dir, "latest", "a\n").unwrap();
        replace_file(&dir, "latest", "b\n").unwrap();
        assert_eq!(std::fs::read_to_string(dir.join("latest")).unwrap(), "b\n");
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
