//! The built-in web pages: the chat at `/` and the dashboard at `/dashboard`, with their
//! scripts and style under `/ui/`. The files are compiled into the binary (nothing is fetched
//! from elsewhere at run time) and served with a content security policy that allows only
//! this server's own scripts and styles: no inline script, no `eval`, so text that reaches a
//! page (model output, user input, imported conversations) cannot run even if it ended up
//! parsed as HTML. The pages themselves build every element with `textContent`.
//!
//! The pages and assets need no API key (they hold no data); the API calls they make do, and
//! the pages ask for the key.

use super::routes::error_response;
use super::server::AppState;
use crate::error::ApiError;
use axum::extract::{Path, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

/// One embedded file: its name under `/ui/`, content type and bytes.
struct Asset {
    name: &'static str,
    content_type: &'static str,
    body: &'static str,
}

const ASSETS: &[Asset] = &[
    Asset {
        name: "chat.html",
        content_type: "text/html; charset=utf-8",
        body: include_str!("assets/chat.html"),
    },
    Asset {
        name: "dashboard.html",
        content_type: "text/html; charset=utf-8",
        body: include_str!("assets/dashboard.html"),
    },
    Asset {
        name: "chat.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_str!("assets/chat.js"),
    },
    Asset {
        name: "markdown.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_str!("assets/markdown.js"),
    },
    Asset {
        name: "dashboard.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_str!("assets/dashboard.js"),
    },
    Asset {
        name: "style.css",
        content_type: "text/css; charset=utf-8",
        body: include_str!("assets/style.css"),
    },
];

/// The policy every page and asset is served with: this origin's scripts, styles and API
/// only; no inline script or style attribute code, no plugins, no framing.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; frame-ancestors 'none'";

/// Whether `path` is a page or asset that answers without the API key.
pub(crate) fn is_public(path: &str) -> bool {
    path == "/" || path == "/dashboard" || path.starts_with("/ui/")
}

fn serve(st: &AppState, name: &str) -> Response {
    match ASSETS.iter().find(|a| a.name == name) {
        Some(a) => {
            st.metrics.request("ui", 200);
            (
                [
                    (header::CONTENT_TYPE, a.content_type),
                    (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
                    (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
                    (header::REFERRER_POLICY, "no-referrer"),
                    (header::CACHE_CONTROL, "no-cache"),
                ],
                a.body,
            )
                .into_response()
        }
        None => {
            st.metrics.request("ui", 404);
            let names: Vec<&str> = ASSETS.iter().map(|a| a.name).collect();
            error_response(&ApiError::not_found(format!(
                "no file /ui/{name}; the built-in pages have {}",
                names.join(", ")
            )))
        }
    }
}

pub(crate) async fn chat_page(State(st): State<Arc<AppState>>) -> Response {
    serve(&st, "chat.html")
}

pub(crate) async fn dashboard_page(State(st): State<Arc<AppState>>) -> Response {
    serve(&st, "dashboard.html")
}

pub(crate) async fn asset(State(st): State<Arc<AppState>>, Path(name): Path<String>) -> Response {
    serve(&st, &name)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pages never hand text to the HTML parser or to the script compiler.
    #[test]
    fn assets_build_elements_from_text_only() {
        for a in ASSETS {
            for banned in [
                "innerHTML",
                "outerHTML",
                "insertAdjacentHTML",
                "document.write",
                "eval(",
                "new Function",
                "setTimeout('",
                "setTimeout(\"",
            ] {
                assert!(!a.body.contains(banned), "{} uses {banned}", a.name);
            }
            if a.name.ends_with(".html") {
                // No inline script or handler attribute: the policy would block them anyway.
                assert!(!a.body.contains("<script>"), "{}", a.name);
                let handler = a.body.split(|c: char| c.is_whitespace()).any(|w| {
                    w.strip_prefix("on")
                        .and_then(|r| r.split_once('='))
                        .is_some_and(|(name, _)| name.chars().all(|c| c.is_ascii_lowercase()))
                });
                assert!(!handler, "{} has an inline handler", a.name);
            }
        }
        assert!(is_public("/") && is_public("/ui/chat.js") && is_public("/dashboard"));
        assert!(!is_public("/v1/models") && !is_public("/dashboard.json"));
    }
}
