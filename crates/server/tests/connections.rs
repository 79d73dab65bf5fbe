//! Connections on loopback with raw sockets (issue 35 items 4 and 20): silent or idle
//! sockets cannot keep `/health` or an authenticated client out, slow headers and slow
//! bodies are cut by their timeouts, a shutdown completes while a slow body is open, and
//! `sluice_connections` counts the open connections exactly. Every wait is bounded by a
//! watchdog (`WATCHDOG`), far above what each case needs: a hang fails, nothing is timed.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::*;

/// A hang fails the test after this long (the cases need a few seconds at most).
const WATCHDOG: Duration = Duration::from_secs(90);

fn connect(s: &Server) -> TcpStream {
    let addr = s.base.strip_prefix("http://").unwrap().to_string();
    let c = TcpStream::connect(addr).unwrap();
    // The watchdog: a read that waits this long fails the test (the server hangs).
    c.set_read_timeout(Some(WATCHDOG)).unwrap();
    c
}

/// Read until the peer closes: the bytes read (a read past the watchdog fails).
fn read_to_close(c: &mut TcpStream, what: &str) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match c.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                panic!("{what}: the server never closed the connection")
            }
            Err(_) => break,
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Read one response head and its Content-Length body (keep-alive connections).
fn read_response(c: &mut TcpStream, what: &str) -> (u16, String) {
    let mut buf = Vec::new();
    let mut b = [0u8; 4096];
    let mut more = |buf: &mut Vec<u8>| {
        let n = c
            .read(&mut b)
            .unwrap_or_else(|e| panic!("{what}: no response ({e}): it hangs"));
        assert!(n > 0, "{what}: closed before the response ended");
        buf.extend_from_slice(&b[..n]);
    };
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).into_owned();
            let len: usize = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse().ok())?
                })
                .unwrap_or(0);
            while buf.len() < end + 4 + len {
                more(&mut buf);
            }
            let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
            let body = String::from_utf8_lossy(&buf[end + 4..end + 4 + len]).into_owned();
            return (status, body);
        }
        more(&mut buf);
    }
}

fn get(s: &Server, path: &str, extra: &str) -> (u16, String) {
    let mut c = connect(s);
    let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\n{extra}Connection: close\r\n\r\n");
    c.write_all(req.as_bytes()).unwrap();
    read_response(&mut c, path)
}

/// `--max-connections` silent sockets (never a byte sent) cannot keep `/health` out:
/// before, each held a connection slot until the client gave up, and the next client
/// waited in the kernel's backlog for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_sockets_cannot_block_health() {
    let mut cfg = config();
    cfg.max_connections = 4;
    let mut s = start(cfg, fixture(), false).await;
    let mut silent = Vec::new();
    for _ in 0..4 {
        silent.push(connect(&s));
    }
    let (st, body) = get(&s, "/health", "");
    assert_eq!(st, 200, "{body}");
    drop(silent);
    s.stop();
}

/// Clients that send full headers without the API key (answered 401) or stay idle after
/// a request cannot keep an authenticated client out at the connection limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_and_idle_connections_cannot_starve_a_keyed_client() {
    let mut cfg = config();
    cfg.max_connections = 3;
    cfg.api_key = Some("k3y".into());
    let mut s = start(cfg, fixture(), false).await;
    // The readiness probe's pooled connection: closed with its client.
    s.client = reqwest::Client::builder().timeout(TIMEOUT).build().unwrap();
    let mut held = Vec::new();
    for i in 0..3 {
        let mut c = connect(&s);
        // Keep-alive: the connection stays open, idle, after its 401.
        let path = ["/v1/models", "/metrics", "/v1/models"][i];
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n");
        c.write_all(req.as_bytes()).unwrap();
        let (st, _) = read_response(&mut c, "unauthenticated");
        assert_eq!(st, 401);
        held.push(c);
    }
    let (st, body) = get(&s, "/v1/models", "Authorization: Bearer k3y\r\n");
    assert_eq!(st, 200, "{body}");
    assert!(body.contains("tiny"), "{body}");
    drop(held);
    s.stop();
}

/// A body that stops arriving is answered 408 (naming the body timeout) once the body
/// timeout has passed, and the connection is closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_body_is_cut_with_408() {
    let mut cfg = config();
    cfg.body_timeout = Duration::from_secs(1);
    let mut s = start(cfg, fixture(), false).await;
    let mut c = connect(&s);
    c.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ",
    )
    .unwrap();
    let text = read_to_close(&mut c, "slow body");
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("body"), "{text}");
    assert!(
        text.to_ascii_lowercase().contains("connection: close"),
        "{text}"
    );
    s.stop();
}

/// Headers that stop arriving: the connection is closed once the header timeout has
/// passed (before: held open for as long as the client liked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_are_closed() {
    let mut cfg = config();
    cfg.header_timeout = Duration::from_secs(1);
    cfg.idle_timeout = Duration::from_secs(600);
    let mut s = start(cfg, fixture(), false).await;
    let mut c = connect(&s);
    c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n").unwrap();
    let text = read_to_close(&mut c, "slow headers");
    assert!(!text.contains("200 OK"), "{text}");
    s.stop();
}

/// A keep-alive connection left idle after a request is closed after the idle timeout;
/// while idle it is not cut by the (shorter) header timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_keep_alive_is_closed_after_idle_timeout() {
    let mut cfg = config();
    cfg.header_timeout = Duration::from_secs(600);
    cfg.idle_timeout = Duration::from_secs(1);
    let mut s = start(cfg, fixture(), false).await;
    let mut c = connect(&s);
    c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let (st, _) = read_response(&mut c, "first request");
    assert_eq!(st, 200);
    let rest = read_to_close(&mut c, "idle keep-alive");
    assert!(rest.is_empty(), "{rest}");
    s.stop();

    // The other way round: idle longer than the header timeout, still served.
    let mut cfg = config();
    cfg.header_timeout = Duration::from_secs(1);
    cfg.idle_timeout = Duration::from_secs(600);
    let mut s = start(cfg, fixture(), false).await;
    let mut c = connect(&s);
    c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    assert_eq!(read_response(&mut c, "first").0, 200);
    tokio::time::sleep(Duration::from_secs(3)).await;
    c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    assert_eq!(read_response(&mut c, "after idling").0, 200);
    s.stop();
}

/// A shutdown (what SIGTERM starts) completes while a client's body never finishes:
/// past the drain deadline the request is answered 503 and its connection closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_completes_while_a_slow_body_is_open() {
    let mut cfg = config();
    cfg.drain_timeout = Duration::from_secs(1);
    let mut s = start(cfg, fixture(), false).await;
    let mut c = connect(&s);
    c.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{",
    )
    .unwrap();
    // The request is in (its headers read) before the shutdown starts.
    s.wait_metric("sluice_requests_total{endpoint=\"completions\"}", |v| {
        v >= 1.0
    })
    .await;
    let srv = s.srv.take().unwrap();
    srv.shutdown();
    let waited = tokio::time::timeout(WATCHDOG, tokio::task::spawn_blocking(move || srv.wait()))
        .await
        .expect("the shutdown never completed while a slow body was open");
    waited.unwrap().unwrap();
    let text = read_to_close(&mut c, "slow body at shutdown");
    assert!(
        text.is_empty() || text.starts_with("HTTP/1.1 503"),
        "{text}"
    );
}

/// `sluice_connections` is the number of open connections: two silent sockets and the
/// one asking make 3, read after read (before: mostly 4, the permit taken by the accept
/// waiting for the next connection counted as one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_gauge_is_exact() {
    let mut s = start(config(), fixture(), false).await;
    // The readiness probe's pooled connection: closed with its client.
    s.client = reqwest::Client::builder().timeout(TIMEOUT).build().unwrap();
    let a = connect(&s);
    let b = connect(&s);
    let mut m = connect(&s);
    let mut read = || {
        m.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let (st, text) = read_response(&mut m, "/metrics");
        assert_eq!(st, 200);
        metric_in(&text, "sluice_connections")
    };
    // Until the probe's connection is gone (the server notices its close on its own time).
    let t0 = std::time::Instant::now();
    while read() != 3.0 {
        assert!(
            t0.elapsed() < WATCHDOG,
            "sluice_connections never 3 with 3 open"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(read(), 3.0, "3 connections open");
    }
    drop((a, b, m));
    s.stop();
}
