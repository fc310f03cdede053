//! Authentication: the API key's own check ([`check_api_key`], at start) and the middleware
//! that asks every request for `Authorization: Bearer KEY` when the server has a key.

use super::routes::{error_response, label};
use super::server::AppState;
use crate::error::ApiError;
use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;
use std::sync::Arc;

/// What is wrong with an API key, if anything: it must be non-empty and printable ASCII
/// without spaces (it travels in an HTTP header as a Bearer token). An empty key would
/// otherwise turn authentication off without a word.
pub fn check_api_key(key: &str) -> std::result::Result<(), String> {
    if key.trim().is_empty() {
        return Err("the API key is empty; an empty key would serve without authentication. Give a non-empty key, or none to serve without one".into());
    }
    if let Some(c) = key.chars().find(|c| !c.is_ascii_graphic()) {
        return Err(format!(
            "the API key contains {c:?}; a key must be printable ASCII without spaces (clients send it in an HTTP header)"
        ));
    }
    Ok(())
}

/// With an API key, every request needs `Authorization: Bearer KEY` (the scheme in any case,
/// the key compared in constant time); `/health` is exempt when `public_health` is set, and
/// the web pages and their assets always are (they hold no data; their API calls need the key),
/// and so are the admin endpoints, which check the admin key instead.
pub(crate) async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.cfg.api_key {
        let path = req.uri().path();
        let exempt = (st.cfg.public_health && path == "/health")
            || super::ui::is_public(path)
            || path.starts_with("/admin/");
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer_token);
        let ok = given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes()));
        if !ok && !exempt {
            st.metrics.request(label(req.uri().path()), 401);
            return error_response(&ApiError::unauthorized(st.cfg.auth_hint.as_deref()));
        }
    }
    next.run(req).await
}

/// The token of an `Authorization: Bearer TOKEN` value; the scheme is case-insensitive
/// (RFC 9110 section 11.1).
pub fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once([' ', '\t'])?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// Equal bytes, in a time that depends only on the lengths.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let n = a.len().max(b.len());
    let mut diff = (a.len() ^ b.len()) as u64;
    for i in 0..n {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= u64::from(x ^ y);
    }
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_eq_compares_whole_keys() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
        assert!(constant_time_eq(b"", b""));
    }

    #[test]
    fn bearer_scheme_is_case_insensitive() {
        assert_eq!(bearer_token("Bearer k1"), Some("k1"));
        assert_eq!(bearer_token("bearer k1"), Some("k1"));
        assert_eq!(bearer_token("BEARER   k1 "), Some("k1"));
        assert_eq!(bearer_token("Bearer\tk1"), Some("k1"));
        assert_eq!(bearer_token("Basic k1"), None);
        assert_eq!(bearer_token("Bearer"), None);
        assert_eq!(bearer_token("Bearer  "), None);
        assert_eq!(bearer_token("Bearerk1"), None);
    }
}
