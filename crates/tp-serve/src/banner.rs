//! The line `tp serve` prints on stdout once it accepts connections, and its reader for the
//! programs that start the server as a child process (the end-to-end tests).

use std::net::SocketAddr;

const PREFIX: &str = "listening on http://";

/// What a banner line says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Banner {
    pub addr: SocketAddr,
    /// Rank 0's process (under mpirun not the process mpirun started).
    pub pid: Option<u32>,
}

/// The banner for a server at `addr` in process `pid`.
pub fn listening_line(addr: SocketAddr, model: &str, tp: usize, pid: u32) -> String {
    format!("{PREFIX}{addr} (model '{model}', tp {tp}, pid {pid})")
}

/// `None` for any other line; `Some(Err)` naming the line when its address does not parse.
pub fn parse_listening_line(line: &str) -> Option<Result<Banner, String>> {
    let rest = line.strip_prefix(PREFIX)?;
    let addr = rest.split_whitespace().next().unwrap_or("");
    Some(match addr.parse() {
        Ok(addr) => Ok(Banner {
            addr,
            pid: line
                .rsplit_once("pid ")
                .and_then(|(_, p)| p.trim_end_matches(')').parse().ok()),
        }),
        Err(e) => Err(format!("bad address in {line:?}: {e}")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_banner_reads_back() {
        let addr: SocketAddr = "127.0.0.1:8123".parse().unwrap();
        let line = listening_line(addr, "m", 2, 42);
        assert_eq!(
            parse_listening_line(&line),
            Some(Ok(Banner {
                addr,
                pid: Some(42)
            }))
        );
        assert_eq!(parse_listening_line("# loading"), None);
        assert!(matches!(
            parse_listening_line("listening on http://nowhere"),
            Some(Err(_))
        ));
    }
}
