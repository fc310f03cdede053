//! A minimal blocking HTTP/1.1 client for the end-to-end tests and `tp bench serve`: one
//! request per connection (`Connection: close`), plain or chunked bodies, server-sent events
//! read as they arrive, and a deadline on every read and write.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// A whole response.
#[derive(Clone, Debug)]
pub struct Response {
    pub status: u16,
    /// Header names lowercased.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as JSON (`Null` when it is not JSON).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }
}

/// A server address plus the headers every request carries (e.g. the API key).
#[derive(Clone, Debug)]
pub struct Client {
    pub addr: SocketAddr,
    pub headers: Vec<(String, String)>,
    /// Deadline of each read or write.
    pub timeout: Duration,
}

impl Client {
    pub fn new(addr: SocketAddr) -> Self {
        Client {
            addr,
            headers: Vec::new(),
            timeout: Duration::from_secs(60),
        }
    }

    pub fn with_api_key(mut self, key: &str) -> Self {
        self.headers
            .push(("Authorization".into(), format!("Bearer {key}")));
        self
    }

    pub fn get(&self, path: &str) -> std::io::Result<Response> {
        self.request("GET", path, None)
    }

    /// POSTs raw bytes (they need not be JSON, nor UTF-8).
    pub fn post(&self, path: &str, body: &[u8]) -> std::io::Result<Response> {
        self.request("POST", path, Some(body))
    }

    pub fn post_json(&self, path: &str, body: &serde_json::Value) -> std::io::Result<Response> {
        self.post(path, body.to_string().as_bytes())
    }

    pub fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
    ) -> std::io::Result<Response> {
        let mut reader = self.send(method, path, body)?;
        let (status, headers) = read_head(&mut reader)?;
        let mut body = Vec::new();
        if is_chunked(&headers) {
            while let Some(chunk) = read_chunk(&mut reader)? {
                body.extend_from_slice(&chunk);
            }
        } else {
            reader.read_to_end(&mut body)?;
        }
        Ok(Response {
            status,
            headers,
            body,
        })
    }

    /// POSTs a streaming request and returns the event reader once the head has arrived.
    pub fn stream(&self, path: &str, body: &serde_json::Value) -> std::io::Result<EventStream> {
        let mut reader = self.send("POST", path, Some(body.to_string().as_bytes()))?;
        let (status, headers) = read_head(&mut reader)?;
        Ok(EventStream {
            status,
            chunked: is_chunked(&headers),
            headers,
            reader,
            pending: Vec::new(),
            ended: false,
        })
    }

    fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
    ) -> std::io::Result<BufReader<TcpStream>> {
        let stream = TcpStream::connect_timeout(&self.addr, self.timeout)?;
        stream.set_read_timeout(Some(self.timeout))?;
        stream.set_write_timeout(Some(self.timeout))?;
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n",
            self.addr
        );
        for (k, v) in &self.headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        if let Some(b) = body {
            head.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                b.len()
            ));
        }
        head.push_str("\r\n");
        let mut w = &stream;
        w.write_all(head.as_bytes())?;
        if let Some(b) = body {
            // A server may answer (413, 401) and close before reading a large body: the
            // answer still counts, so a failed write is not an error here.
            let _ = w.write_all(b);
        }
        w.flush()?;
        Ok(BufReader::new(stream))
    }
}

fn bad(msg: impl Into<String>) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg.into())
}

fn read_head(r: &mut BufReader<TcpStream>) -> std::io::Result<(u16, Vec<(String, String)>)> {
    let mut line = String::new();
    r.read_line(&mut line)?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad(format!("bad status line {line:?}")))?;
    let mut headers = Vec::new();
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 {
            return Err(bad("connection closed inside the headers"));
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    Ok((status, headers))
}

fn is_chunked(headers: &[(String, String)]) -> bool {
    headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"))
}

/// One chunk of a chunked body; `None` at the last (empty) chunk.
fn read_chunk(r: &mut BufReader<TcpStream>) -> std::io::Result<Option<Vec<u8>>> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Ok(None);
    }
    let size_hex = line.trim().split(';').next().unwrap_or("");
    let size =
        usize::from_str_radix(size_hex, 16).map_err(|_| bad(format!("bad chunk size {line:?}")))?;
    if size == 0 {
        return Ok(None);
    }
    let mut buf = vec![0u8; size + 2]; // the data and its CRLF
    r.read_exact(&mut buf)?;
    buf.truncate(size);
    Ok(Some(buf))
}

/// Server-sent events of a streaming response.
#[derive(Debug)]
pub struct EventStream {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    chunked: bool,
    reader: BufReader<TcpStream>,
    /// Bytes received but not yet split into events.
    pending: Vec<u8>,
    ended: bool,
}

impl EventStream {
    /// The next event's `data` (comments and keep-alives skipped); `None` at the end of the body.
    pub fn next_data(&mut self) -> std::io::Result<Option<String>> {
        loop {
            if let Some(end) = self.pending.windows(2).position(|w| w == b"\n\n") {
                let raw: Vec<u8> = self.pending.drain(..end + 2).collect();
                let event = String::from_utf8_lossy(&raw);
                let data: Vec<&str> = event
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(|d| d.strip_prefix(' ').unwrap_or(d))
                    .collect();
                if !data.is_empty() {
                    return Ok(Some(data.join("\n")));
                }
                continue;
            }
            if self.ended {
                return Ok(None);
            }
            let bytes = if self.chunked {
                read_chunk(&mut self.reader)?
            } else {
                let mut buf = vec![0u8; 4096];
                let n = self.reader.read(&mut buf)?;
                buf.truncate(n);
                (n > 0).then_some(buf)
            };
            match bytes {
                Some(b) => self.pending.extend(b.iter().filter(|&&c| c != b'\r')),
                None => self.ended = true,
            }
        }
    }
}
