//! The start-up check of an MPI job, right after `MPI_Init`: every rank sends every other its
//! host name and build fingerprint (one `MPI_Iallgather` of a fixed-size record on the control
//! communicator, polled against the deadline). Ranks running different builds stop here with
//! an error naming their hosts, before the first collective could desync.
//!
//! The record's layout is frozen so that any two builds can read each other's:
//! `b"TPFP"`, format `u16` = 1, text length `u16`, then UTF-8 text
//! `version=V\nbuild=B\nhost=H`, zero padded to [`RECORD`] bytes.

use super::notice::Global;
use super::raw;
use super::wait::{self, Outcome};
use crate::build::{this_build, BuildFingerprint};
use crate::error::{CommError, Result};
use mpi::ffi;
use std::os::raw::{c_char, c_int};
use std::time::Instant;

/// Bytes of one rank's record.
const RECORD: usize = 256;
const MAGIC: &[u8; 4] = b"TPFP";
const FORMAT: u16 = 1;

/// What one rank said about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Peer {
    pub host: String,
    /// `None` when its record could not be read (another program, or a far older build).
    pub build: Option<BuildFingerprint>,
}

/// This host's name in messages: `$TP_HOST` when set (a cluster whose hosts share a hostname
/// sets it to each host's address), else MPI's processor name (the hostname).
fn host_name() -> String {
    if let Some(h) = std::env::var("TP_HOST")
        .ok()
        .filter(|h| !h.trim().is_empty())
    {
        return h.trim().to_string();
    }
    let mut buf = vec![0 as c_char; ffi::MPI_MAX_PROCESSOR_NAME as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: MPI is initialized; the buffer holds MPI_MAX_PROCESSOR_NAME + 1 chars.
    let rc = unsafe { ffi::MPI_Get_processor_name(buf.as_mut_ptr(), &mut len) };
    let len = usize::try_from(len).unwrap_or(0).min(buf.len());
    if rc != ffi::MPI_SUCCESS as c_int || len == 0 {
        return "unknown host".into();
    }
    let bytes: Vec<u8> = buf[..len].iter().map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn encode(host: &str, fp: &BuildFingerprint) -> [u8; RECORD] {
    let text = format!("version={}\nbuild={}\nhost={host}", fp.version, fp.build);
    let mut cut = text.len().min(RECORD - 8);
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let mut rec = [0u8; RECORD];
    rec[..4].copy_from_slice(MAGIC);
    rec[4..6].copy_from_slice(&FORMAT.to_le_bytes());
    rec[6..8].copy_from_slice(&(cut as u16).to_le_bytes());
    rec[8..8 + cut].copy_from_slice(&text.as_bytes()[..cut]);
    rec
}

fn decode(rec: &[u8]) -> Option<(String, BuildFingerprint)> {
    if rec.len() != RECORD || rec[..4] != *MAGIC || rec[4..6] != FORMAT.to_le_bytes() {
        return None;
    }
    let len = usize::from(u16::from_le_bytes([rec[6], rec[7]]));
    let text = std::str::from_utf8(rec.get(8..8 + len)?).ok()?;
    let (mut version, mut build, mut host) = (None, None, None);
    for line in text.lines() {
        match line.split_once('=') {
            Some(("version", v)) => version = Some(v.to_string()),
            Some(("build", v)) => build = Some(v.to_string()),
            Some(("host", v)) => host = Some(v.to_string()),
            _ => {}
        }
    }
    Some((
        host?,
        BuildFingerprint {
            version: version?,
            build: build?,
        },
    ))
}

/// Exchanges every rank's record; the caller holds nothing (this takes the MPI lock per poll).
pub(crate) fn exchange(g: &Global) -> Result<Vec<Peer>> {
    let mine = encode(&host_name(), &this_build());
    let n = g.world_size;
    let mut all = vec![0u8; RECORD * n];
    let mut req = raw::null_request();
    {
        let _l = raw::lock();
        // SAFETY: `mine` and `all` (RECORD x world size bytes) outlive the request: on a
        // timeout both are leaked below; the control communicator is live.
        let rc = unsafe {
            ffi::MPI_Iallgather(
                mine.as_ptr().cast(),
                RECORD as c_int,
                raw::byte_type(),
                all.as_mut_ptr().cast(),
                RECORD as c_int,
                raw::byte_type(),
                g.control.0,
                &mut req,
            )
        };
        raw::check(rc, "MPI_Iallgather of the start-up records")?;
    }
    let others: Vec<usize> = (0..n).filter(|&r| r != g.world_rank).collect();
    let deadline = Instant::now() + g.timeout;
    let mut reqs = [req];
    match wait::poll(g, &mut reqs, &others, deadline)? {
        Outcome::Done => {}
        Outcome::TimedOut | Outcome::Lost(..) => {
            std::mem::forget(all);
            return Err(CommError::Backend(format!(
                "rank {} waited {:?} at start for every rank's host and build fingerprint and \
                 not all came; a rank may run another program or a build without this check: \
                 install the same build on every host",
                g.world_rank, g.timeout
            )));
        }
    }
    Ok(all
        .chunks_exact(RECORD)
        .enumerate()
        .map(|(r, rec)| match decode(rec) {
            Some((host, build)) => Peer {
                host,
                build: Some(build),
            },
            None => Peer {
                host: format!("rank {r}'s host (unreadable record)"),
                build: None,
            },
        })
        .collect())
}

/// Every rank must run rank 0's build; a mismatch names each differing rank and its host.
pub(crate) fn check_same_build(peers: &[Peer]) -> Result<()> {
    let Some(first) = peers.first() else {
        return Ok(());
    };
    let differing: Vec<usize> = (1..peers.len())
        .filter(|&r| peers[r].build.is_none() || peers[r].build != first.build)
        .collect();
    if differing.is_empty() {
        return Ok(());
    }
    let show = |r: usize| {
        let p = &peers[r];
        match &p.build {
            Some(b) => format!("rank {r} on {}: {b}", p.host),
            None => format!("rank {r} on {}: no readable fingerprint", p.host),
        }
    };
    let mut lines = vec![show(0)];
    lines.extend(differing.iter().map(|&r| show(r)));
    Err(CommError::BuildMismatch {
        differing: differing.len(),
        world: peers.len(),
        details: lines.join("; "),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(build: &str) -> BuildFingerprint {
        BuildFingerprint {
            version: "0.1.0".into(),
            build: build.into(),
        }
    }

    #[test]
    fn records_round_trip_and_long_hosts_are_cut() {
        let rec = encode("10.213.7.2", &fp("build-id ab"));
        assert_eq!(
            decode(&rec),
            Some(("10.213.7.2".to_string(), fp("build-id ab")))
        );
        let long = "h".repeat(400);
        let rec = encode(&long, &fp("build-id ab"));
        let (host, _) = decode(&rec).expect("decodes");
        assert!(host.len() < 256 && host.starts_with("hhh"));
        let mut bad = rec;
        bad[0] = b'X';
        assert_eq!(decode(&bad), None);
        assert_eq!(decode(&[0u8; 10]), None);
    }

    #[test]
    fn a_differing_build_names_both_hosts() {
        let peer = |h: &str, b: &str| Peer {
            host: h.into(),
            build: Some(fp(b)),
        };
        let same = [peer("a", "build-id 01"), peer("b", "build-id 01")];
        assert!(check_same_build(&same).is_ok());
        let e = check_same_build(&[
            peer("a", "build-id 01"),
            peer("b", "build-id 01"),
            peer("c", "build-id 02"),
        ])
        .expect_err("mismatch");
        let text = e.to_string();
        assert!(
            text.contains("rank 0 on a: version 0.1.0, build-id 01"),
            "{text}"
        );
        assert!(
            text.contains("rank 2 on c: version 0.1.0, build-id 02"),
            "{text}"
        );
        assert!(!text.contains("rank 1 on b"), "{text}");
        let unreadable = [
            peer("a", "build-id 01"),
            Peer {
                host: "x".into(),
                build: None,
            },
        ];
        assert!(check_same_build(&unreadable)
            .expect_err("unreadable")
            .to_string()
            .contains("rank 1 on x: no readable fingerprint"));
    }
}
