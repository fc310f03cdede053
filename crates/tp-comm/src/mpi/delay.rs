//! `TP_NET_DELAY_US`: an opt-in test aid modelling link latency (the project machines' kernel
//! has no netem): each message step of this backend waits that many microseconds before it
//! posts its sends. See ARCHITECTURE.md, "MPI backend".

use crate::error::{CommError, Result};
use std::time::{Duration, Instant};

/// The environment variable read at `MpiRuntime::init`.
pub const VAR: &str = "TP_NET_DELAY_US";
/// The largest delay accepted (one second per message step).
const MAX_US: u64 = 1_000_000;
/// Below this much remaining, the wait yields instead of sleeping (sleeps overshoot by the
/// timer slack, ~50-70 us).
const SLEEP_MARGIN: Duration = Duration::from_micros(100);

/// The delay named by the variable's value (`None` or empty: no delay).
pub(crate) fn parse(value: Option<&str>) -> Result<Duration> {
    let Some(v) = value.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(Duration::ZERO);
    };
    match v.parse::<u64>() {
        Ok(us) if us <= MAX_US => Ok(Duration::from_micros(us)),
        _ => Err(CommError::Backend(format!(
            "{VAR}={v:?} is not a delay: give whole microseconds from 0 to {MAX_US} \
             (e.g. {VAR}=200), or unset it to send without delay"
        ))),
    }
}

/// Reads the variable from this process's environment.
pub(crate) fn from_env() -> Result<Duration> {
    let v = std::env::var_os(VAR);
    match v.as_ref().map(|s| s.to_str()) {
        None => Ok(Duration::ZERO),
        Some(Some(s)) => parse(Some(s)),
        Some(None) => Err(CommError::Backend(format!(
            "{VAR} is not valid UTF-8; give whole microseconds, e.g. {VAR}=200"
        ))),
    }
}

/// Waits `d` (nothing when zero): sleeps most of it, then yields until it has passed.
pub(crate) fn wait(d: Duration) {
    if d.is_zero() {
        return;
    }
    let end = Instant::now() + d;
    if d > SLEEP_MARGIN {
        std::thread::sleep(d - SLEEP_MARGIN);
    }
    while Instant::now() < end {
        std::thread::yield_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_parse_and_bad_values_are_refused() {
        assert_eq!(parse(None).ok(), Some(Duration::ZERO));
        assert_eq!(parse(Some(" ")).ok(), Some(Duration::ZERO));
        assert_eq!(parse(Some("200")).ok(), Some(Duration::from_micros(200)));
        for bad in ["-1", "2ms", "1e3", "1000001"] {
            let e = parse(Some(bad)).unwrap_err().to_string();
            assert!(e.contains(VAR) && e.contains("microseconds"), "{bad}: {e}");
        }
    }

    #[test]
    fn waits_at_least_the_delay() {
        let t = Instant::now();
        wait(Duration::from_micros(300));
        assert!(t.elapsed() >= Duration::from_micros(300));
        let t = Instant::now();
        wait(Duration::ZERO);
        assert!(t.elapsed() < Duration::from_millis(50));
    }
}
