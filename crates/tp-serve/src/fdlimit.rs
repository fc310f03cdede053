//! The process's open-file limit (`RLIMIT_NOFILE`): raised from its soft to its hard value at
//! start (every connection is a file descriptor), and the default connection cap derived
//! from it with a reserve for the process's own files and for refusals.

use std::io;

/// Soft and hard open-file limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpenFileLimit {
    pub soft: u64,
    pub hard: u64,
}

/// Highest soft limit asked for when the hard limit is unlimited (Linux refuses more than
/// `fs.nr_open`, 2^20 by default).
const UNLIMITED_TARGET: u64 = 1 << 20;

/// The current limits.
#[cfg(unix)]
pub fn open_file_limit() -> io::Result<OpenFileLimit> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `r` is a valid, writable rlimit for the duration of the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(OpenFileLimit {
        soft: from_rlim(r.rlim_cur),
        hard: from_rlim(r.rlim_max),
    })
}

#[cfg(unix)]
#[allow(clippy::unnecessary_cast)] // rlim_t is u64 on Linux, not on every unix
fn from_rlim(v: libc::rlim_t) -> u64 {
    if v == libc::RLIM_INFINITY {
        u64::MAX
    } else {
        v as u64
    }
}

/// Raises the soft limit to the hard one (at most 2^20 when the hard limit is unlimited);
/// returns the limits before and after.
#[cfg(unix)]
#[allow(clippy::unnecessary_cast)]
pub fn raise_open_file_limit() -> io::Result<(OpenFileLimit, OpenFileLimit)> {
    let before = open_file_limit()?;
    let target = before.hard.min(UNLIMITED_TARGET.max(before.soft));
    if target <= before.soft {
        return Ok((before, before));
    }
    let r = libc::rlimit {
        rlim_cur: target as libc::rlim_t,
        rlim_max: if before.hard == u64::MAX {
            libc::RLIM_INFINITY
        } else {
            before.hard as libc::rlim_t
        },
    };
    // SAFETY: `r` is a valid rlimit; setrlimit only reads it.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((before, open_file_limit()?))
}

#[cfg(not(unix))]
pub fn open_file_limit() -> io::Result<OpenFileLimit> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "open-file limits are a unix notion",
    ))
}

#[cfg(not(unix))]
pub fn raise_open_file_limit() -> io::Result<(OpenFileLimit, OpenFileLimit)> {
    open_file_limit().map(|l| (l, l))
}

/// Largest default cap, however many descriptors the process may open.
pub const MAX_DEFAULT_CONNECTIONS: usize = 8192;

/// Descriptors kept for the process itself (model file, stdio, the runtime, MPI) and for
/// refusals: an eighth of the limit, at least 32.
pub fn fd_reserve(limit: u64) -> u64 {
    (limit / 8).max(32)
}

/// The default connection cap for an open-file limit: the limit less [`fd_reserve`], at
/// least 1, at most [`MAX_DEFAULT_CONNECTIONS`].
pub fn default_max_connections(limit: u64) -> usize {
    let n = limit.saturating_sub(fd_reserve(limit)).max(1);
    usize::try_from(n)
        .unwrap_or(usize::MAX)
        .min(MAX_DEFAULT_CONNECTIONS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_cap_leaves_a_reserve() {
        assert_eq!(default_max_connections(64), 32);
        assert_eq!(default_max_connections(1024), 896);
        assert_eq!(default_max_connections(20_000), MAX_DEFAULT_CONNECTIONS);
        assert_eq!(default_max_connections(u64::MAX), MAX_DEFAULT_CONNECTIONS);
        assert_eq!(default_max_connections(10), 1);
        assert_eq!(default_max_connections(0), 1);
    }

    #[cfg(unix)]
    #[test]
    fn raising_never_lowers_the_limit() {
        let (before, after) = raise_open_file_limit().unwrap();
        assert!(after.soft >= before.soft);
        assert_eq!(after.hard, before.hard);
        assert!(after.soft <= after.hard);
    }
}
