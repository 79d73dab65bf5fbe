//! The chat page at `/`: one static page embedded in the binary.
//!
//! Owns: the routes `/` (HTML), `/chat.js`, `/chat.css` (the files under
//! `crates/server/static/`, compiled in with `include_str!`; no build step), an empty
//! `/favicon.ico`, and the
//! headers they are served with: a strict Content-Security-Policy (scripts, styles and
//! connections from this origin only, no inline script or style, no frames, no plugins),
//! `nosniff`, no referrer. The page talks to the API like any client (`/v1/models`,
//! streamed `/v1/chat/completions`, `/metrics`), so these routes need no API key: with
//! `--api-key` the page asks for the key and sends it on those requests.

use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

/// The page's Content-Security-Policy.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

const HTML: &str = include_str!("../static/chat.html");
const JS: &str = include_str!("../static/chat.js");
const CSS: &str = include_str!("../static/chat.css");

fn asset(body: &'static str, content_type: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

/// The page's routes, merged into the server's router.
pub(crate) fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route(
            "/",
            get(|| async { asset(HTML, "text/html; charset=utf-8") }),
        )
        .route(
            "/chat.js",
            get(|| async { asset(JS, "text/javascript; charset=utf-8") }),
        )
        .route(
            "/chat.css",
            get(|| async { asset(CSS, "text/css; charset=utf-8") }),
        )
        // Browsers ask for it on their own; nothing, rather than a 404 in their console.
        .route(
            "/favicon.ico",
            get(|| async { axum::http::StatusCode::NO_CONTENT }),
        )
}
