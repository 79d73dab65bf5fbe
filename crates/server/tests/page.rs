//! The chat page's routes over HTTP (the browser test is `tools/test-chat-page.sh`): `/`,
//! `/chat.js` and `/chat.css` served with the strict Content-Security-Policy and
//! `nosniff`, open without the API key while the API stays closed, no inline script or
//! style in the page (the CSP would block them), and the script never writes HTML.

mod common;

use common::*;

const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn page_script_and_style_with_csp_and_no_key() {
    let mut cfg = config();
    cfg.api_key = Some("k".into());
    let mut s = start(cfg, fixture(), false).await;
    let mut bodies = Vec::new();
    for (path, ty) in [
        ("/", "text/html; charset=utf-8"),
        ("/chat.js", "text/javascript; charset=utf-8"),
        ("/chat.css", "text/css; charset=utf-8"),
    ] {
        let r = s.client.get(s.url(path)).send().await.unwrap();
        assert_eq!(r.status(), 200, "{path}");
        let h = r.headers();
        assert_eq!(h["content-type"], ty, "{path}");
        assert_eq!(h["content-security-policy"], CSP, "{path}");
        assert_eq!(h["x-content-type-options"], "nosniff", "{path}");
        assert_eq!(h["referrer-policy"], "no-referrer", "{path}");
        bodies.push(r.text().await.unwrap());
    }
    let (html, js) = (&bodies[0], &bodies[1]);
    assert!(html.contains(r#"<script src="/chat.js" defer></script>"#));
    assert!(html.contains(r#"<link rel="stylesheet" href="/chat.css">"#));
    // Every <script> has a src (no inline script), no inline style or handlers.
    assert_eq!(
        html.matches("<script").count(),
        html.matches("<script src=").count()
    );
    for inline in ["style=", "<style", " onclick=", " onload=", " onsubmit="] {
        assert!(!html.contains(inline), "inline {inline} in the page");
    }
    // Text reaches the page through textContent only.
    for sink in [
        "innerHTML",
        "outerHTML",
        "insertAdjacentHTML",
        "document.write",
        "eval(",
    ] {
        assert!(!js.contains(sink), "{sink} in chat.js");
    }
    assert!(js.contains("/v1/chat/completions") && js.contains("/metrics"));
    // The API itself still wants the key.
    let r = s.client.get(s.url("/v1/models")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    s.stop();
}
