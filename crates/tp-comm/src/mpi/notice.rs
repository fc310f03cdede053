//! Process-wide MPI state and departure notices (R1): the world control communicator, the
//! table of departed world ranks, the panic hook and the "exited" notice sent at shutdown.
//!
//! A rank that panics or exits sends a small notice to every other world rank; every poll
//! loop probes for notices, so peers waiting on it fail with `PeerLost` instead of hanging.
//! A rank killed by a signal sends nothing: then `mpirun` tears the whole job down.

use super::raw::{self, Comm};
use crate::error::{Departure, OpKind};
use crate::flight::FlightRecorder;
use mpi::ffi;
use std::collections::HashMap;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Tag of departure notices on the world control communicator.
const NOTICE_TAG: c_int = 7;
/// Longest panic message carried by a notice.
const MAX_MESSAGE: usize = 200;
/// How long a departing rank waits for its notices to go out.
const SEND_GRACE: Duration = Duration::from_millis(200);

/// What this process knows about a departed world rank.
#[derive(Clone, Debug)]
pub(crate) struct Departed {
    pub why: Departure,
    /// The departed rank's last call (op, seq), as it reported it.
    pub last: Option<(OpKind, u64)>,
    pub seen: Instant,
}

/// State shared by every communicator of this process.
pub(crate) struct Global {
    pub world_rank: usize,
    pub world_size: usize,
    pub control: Comm,
    pub timeout: Duration,
    pub verify: bool,
    /// `TP_NET_DELAY_US`: waited before each message step's sends (zero: none).
    pub net_delay: Duration,
    /// Bytes this process handed to MPI sends for collectives and sends (see `bytes_sent`).
    pub sent: AtomicU64,
    pub flight: FlightRecorder,
    pub epoch: Instant,
    pub finalized: AtomicBool,
    departed: Mutex<HashMap<usize, Departed>>,
    last: Mutex<Option<(OpKind, u64)>>,
    notified: AtomicBool,
}

static GLOBAL: OnceLock<Global> = OnceLock::new();

pub(crate) fn global() -> Option<&'static Global> {
    GLOBAL.get()
}

pub(crate) fn install(g: Global) -> &'static Global {
    GLOBAL.get_or_init(|| g)
}

impl Global {
    pub fn new(
        world_rank: usize,
        world_size: usize,
        control: Comm,
        opts: &super::MpiOptions,
        net_delay: Duration,
    ) -> Self {
        Global {
            world_rank,
            world_size,
            control,
            timeout: opts.timeout,
            verify: opts.verify,
            net_delay,
            sent: AtomicU64::new(0),
            flight: FlightRecorder::default(),
            epoch: Instant::now(),
            finalized: AtomicBool::new(false),
            departed: Mutex::new(HashMap::new()),
            last: Mutex::new(None),
            notified: AtomicBool::new(false),
        }
    }

    pub fn flight_record(&self) -> String {
        self.flight.render(
            &format!("rank {} (this process)", self.world_rank),
            self.epoch,
        )
    }

    /// Counts `bytes` handed to MPI sends.
    pub fn count_sent(&self, bytes: usize) {
        self.sent.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub fn set_last(&self, op: OpKind, seq: u64) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some((op, seq));
    }

    /// Receives every pending notice. The caller holds the MPI lock.
    pub fn drain_notices(&self) {
        loop {
            let mut flag: c_int = 0;
            let mut st = raw::empty_status();
            // SAFETY: `control` is a live communicator; flag and status are valid out-params.
            let rc = unsafe {
                ffi::MPI_Iprobe(
                    ffi::RSMPI_ANY_SOURCE,
                    NOTICE_TAG,
                    self.control.0,
                    &mut flag,
                    &mut st,
                )
            };
            if rc != ffi::MPI_SUCCESS as c_int || flag == 0 {
                return;
            }
            let mut len: c_int = 0;
            // SAFETY: `st` was filled by the successful probe above.
            unsafe { ffi::MPI_Get_count(&st, raw::byte_type(), &mut len) };
            let mut buf = vec![0u8; usize::try_from(len).unwrap_or(0).min(4096)];
            let cap = c_int::try_from(buf.len()).unwrap_or(0);
            // SAFETY: a message from `st.MPI_SOURCE` with this tag is pending (probed under the
            // lock), so the receive completes at once; `buf` holds `cap` bytes and a longer
            // message is truncated with an error code, not an overflow.
            let rc = unsafe {
                ffi::MPI_Recv(
                    buf.as_mut_ptr().cast(),
                    cap,
                    raw::byte_type(),
                    st.MPI_SOURCE,
                    NOTICE_TAG,
                    self.control.0,
                    ffi::RSMPI_STATUS_IGNORE,
                )
            };
            let src = usize::try_from(st.MPI_SOURCE).unwrap_or(usize::MAX);
            let d = if rc == ffi::MPI_SUCCESS as c_int {
                decode(&buf)
            } else {
                None
            }
            .unwrap_or(Departed {
                why: Departure::Exited("sent an unreadable departure notice".into()),
                last: None,
                seen: Instant::now(),
            });
            self.departed
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(src)
                .or_insert(d);
        }
    }

    /// The first departed world rank among `members`, if any.
    pub fn lost_member(&self, members: &[usize]) -> Option<(usize, Departed)> {
        let t = self.departed.lock().unwrap_or_else(|p| p.into_inner());
        if t.is_empty() {
            return None;
        }
        members
            .iter()
            .find_map(|m| t.get(m).map(|d| (*m, d.clone())))
    }

    /// Sends a departure notice to every other world rank and waits up to ~200 ms for the
    /// sends. Only the first call does anything.
    pub fn notify(&self, why: &Departure) {
        if self.notified.swap(true, Ordering::SeqCst) || self.finalized.load(Ordering::SeqCst) {
            return;
        }
        let last = *self.last.lock().unwrap_or_else(|p| p.into_inner());
        let msg = encode(why, last);
        let Some(_guard) = raw::try_lock_for(SEND_GRACE) else {
            return;
        };
        let len = c_int::try_from(msg.len()).unwrap_or(0);
        let mut reqs = Vec::new();
        for peer in (0..self.world_size).filter(|&p| p != self.world_rank) {
            let mut req = raw::null_request();
            let Ok(dst) = c_int::try_from(peer) else {
                continue;
            };
            // SAFETY: `msg` is leaked below if a send is still pending, so the buffer outlives
            // every request; `control` is live.
            let rc = unsafe {
                ffi::MPI_Isend(
                    msg.as_ptr().cast(),
                    len,
                    raw::byte_type(),
                    dst,
                    NOTICE_TAG,
                    self.control.0,
                    &mut req,
                )
            };
            if rc == ffi::MPI_SUCCESS as c_int {
                reqs.push(req);
            }
        }
        let end = Instant::now() + SEND_GRACE;
        let mut done = false;
        while !done && Instant::now() < end {
            done = true;
            for r in reqs.iter_mut() {
                let mut flag: c_int = 0;
                // SAFETY: `r` is a request from MPI_Isend above (or null once complete).
                unsafe { ffi::MPI_Test(r, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
                done &= flag != 0;
            }
            if !done {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        if !done {
            std::mem::forget(msg);
        }
    }
}

fn encode(why: &Departure, last: Option<(OpKind, u64)>) -> Vec<u8> {
    let (kind, text) = match why {
        Departure::Panicked(m) => (1u8, m.as_str()),
        Departure::Exited(m) => (2u8, m.as_str()),
    };
    let mut cut = text.len().min(MAX_MESSAGE);
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let mut out = vec![kind, last.map_or(0, |(op, _)| op.code())];
    out.extend_from_slice(&last.map_or(0, |(_, s)| s).to_le_bytes());
    out.extend_from_slice(&text.as_bytes()[..cut]);
    out
}

fn decode(buf: &[u8]) -> Option<Departed> {
    let kind = *buf.first()?;
    let op = OpKind::from_code(*buf.get(1)?);
    let seq = u64::from_le_bytes(buf.get(2..10)?.try_into().ok()?);
    let text = String::from_utf8_lossy(buf.get(10..)?).into_owned();
    let why = match kind {
        1 => Departure::Panicked(text),
        2 => Departure::Exited(text),
        _ => return None,
    };
    Some(Departed {
        why,
        last: op.map(|o| (o, seq)),
        seen: Instant::now(),
    })
}

/// Chains a panic hook that sends a "panicked" notice after the previous hook ran.
pub(crate) fn install_panic_hook() {
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        prev(info);
        if let Some(g) = global() {
            let msg = match info.payload().downcast_ref::<&str>() {
                Some(s) => s.to_string(),
                None => info
                    .payload()
                    .downcast_ref::<String>()
                    .cloned()
                    .unwrap_or_else(|| "non-string panic payload".into()),
            };
            let loc = info
                .location()
                .map(|l| format!(" at {l}"))
                .unwrap_or_default();
            g.notify(&Departure::Panicked(format!("{msg}{loc}")));
            // Peers need a moment to report the notice before mpirun tears the job down.
            std::thread::sleep(Duration::from_millis(300));
        }
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_round_trip_and_truncate() {
        let long = "é".repeat(300);
        let m = encode(&Departure::Panicked(long), Some((OpKind::AllReduce, 2)));
        let d = decode(&m).expect("decodes");
        assert_eq!(d.last, Some((OpKind::AllReduce, 2)));
        match d.why {
            Departure::Panicked(t) => assert!(t.len() <= MAX_MESSAGE && !t.is_empty()),
            other => panic!("wrong kind {other:?}"),
        }
        assert!(decode(&[9, 0]).is_none());
        assert!(decode(&[]).is_none());
    }
}
