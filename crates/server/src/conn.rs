//! Connections: the accept loop, the connection cap, the per-connection timeouts, the drain.
//!
//! Owns: [`serve_connections`] (accept, serve each connection with hyper's HTTP/1 server,
//! stop accepting when the drain starts, return once every connection is closed),
//! [`Registry`] (the open connections, which `sluice_connections` counts exactly) and
//! the rules that keep idle or unauthenticated clients from starving the others:
//! - A connection is *busy* from the moment a request's headers have arrived until its
//!   response has been handed to hyper in full; otherwise it is *idle*.
//! - An idle connection is closed after `header_timeout` when a request's head is due
//!   (a new connection, counted from the accept, or bytes of a next request, counted from
//!   the first) and after `idle_timeout` of keep-alive silence between requests. A body
//!   has `body_timeout` (enforced where the handlers read it, `routes::read_body`).
//! - At `max_connections`, a new connection makes the connection idle the longest close
//!   (a silent socket, a keep-alive after its 401); only when every connection is busy
//!   does it wait. An unauthenticated request is answered 401 before its body is read, so
//!   it is busy only for that moment.
//! - Drain: stop accepting, close idle connections, let busy ones finish (past the drain
//!   deadline the routes answer bodies still arriving with 503 and generations are cut);
//!   [`FORCE_AFTER_DRAIN`] after the deadline the rest are dropped.
//!
//! hyper's own `header_read_timeout` is not used: hyper 1.x starts it as soon as a
//! keep-alive connection goes idle, so it cannot be both a short header timeout and a
//! longer keep-alive one.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::{Request, Response};
use axum::Router;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};

/// How long a connection asked to close may take to finish what hyper is writing before
/// it is dropped (only idle ones are: a busy one finishes its response first).
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// After the drain deadline, how long busy connections still get (a cut generation's
/// error event or 503 being written) before every connection is dropped.
pub(crate) const FORCE_AFTER_DRAIN: Duration = Duration::from_secs(10);

/// The connection limits of a server.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub idle_timeout: Duration,
}

/// Where the server is in its life: serving, draining (no new connections; idle ones
/// close), or past the drain's last deadline (every connection is dropped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Serve,
    Drain,
    Force,
}

struct Inner {
    accepted: Instant,
    /// Requests whose headers arrived and whose response is not yet handed over in full.
    in_flight: u32,
    served: u64,
    idle_since: Instant,
    /// First byte of the next request's head while idle (after a first request).
    head_started: Option<Instant>,
    /// The accept loop asked this connection to make room.
    evict: bool,
}

/// One open connection, as its own task, the accept loop and the metrics see it.
pub(crate) struct ConnState {
    inner: Mutex<Inner>,
    /// Wakes the connection's task when its state changes.
    wake: Notify,
    /// The registry's change signal (a connection became idle).
    changed: Arc<Notify>,
}

impl ConnState {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// When this connection, idle, must be closed (None while a request is in flight).
    fn deadline(&self, l: &Limits) -> Option<Instant> {
        let i = self.lock();
        if i.in_flight > 0 {
            return None;
        }
        Some(match (i.served, i.head_started) {
            (_, Some(t)) => t + l.header_timeout,
            (0, None) => i.accepted + l.header_timeout,
            (_, None) => i.idle_since + l.idle_timeout,
        })
    }
}

/// A request in flight on a connection: the connection is busy until this is dropped
/// (with the response body, once hyper has taken all of it).
struct Busy(Arc<ConnState>);

impl Busy {
    fn new(c: Arc<ConnState>) -> Busy {
        {
            let mut i = c.lock();
            i.in_flight += 1;
            i.head_started = None;
        }
        c.wake.notify_one();
        Busy(c)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        {
            let mut i = self.0.lock();
            i.in_flight = i.in_flight.saturating_sub(1);
            i.served += 1;
            i.idle_since = Instant::now();
        }
        self.0.wake.notify_one();
        self.0.changed.notify_waiters();
    }
}

/// The open connections.
pub(crate) struct Registry {
    conns: Mutex<Vec<Arc<ConnState>>>,
    /// Signalled when a connection closes or becomes idle.
    changed: Arc<Notify>,
}

impl Registry {
    pub fn new() -> Registry {
        Registry {
            conns: Mutex::new(Vec::new()),
            changed: Arc::new(Notify::new()),
        }
    }

    fn list(&self) -> MutexGuard<'_, Vec<Arc<ConnState>>> {
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Connections open now (`sluice_connections`).
    pub fn open(&self) -> usize {
        self.list().len()
    }

    fn add(&self) -> Arc<ConnState> {
        let now = Instant::now();
        let c = Arc::new(ConnState {
            inner: Mutex::new(Inner {
                accepted: now,
                in_flight: 0,
                served: 0,
                idle_since: now,
                head_started: None,
                evict: false,
            }),
            wake: Notify::new(),
            changed: self.changed.clone(),
        });
        self.list().push(c.clone());
        c
    }

    fn remove(&self, c: &Arc<ConnState>) {
        self.list().retain(|x| !Arc::ptr_eq(x, c));
        self.changed.notify_waiters();
    }

    /// Make room: ask the connection idle the longest to close. False when every
    /// connection is busy (nothing to close); true when one is closing.
    fn evict_oldest_idle(&self) -> bool {
        let list = self.list();
        let mut oldest: Option<(Instant, &Arc<ConnState>)> = None;
        for c in list.iter() {
            let i = c.lock();
            if i.in_flight > 0 {
                continue;
            }
            if i.evict {
                return true;
            }
            if oldest.is_none_or(|(t, _)| i.idle_since < t) {
                oldest = Some((i.idle_since, c));
            }
        }
        match oldest {
            Some((_, c)) => {
                c.lock().evict = true;
                c.wake.notify_one();
                true
            }
            None => false,
        }
    }

    /// Wait until every connection is closed.
    async fn all_closed(&self) {
        loop {
            let n = self.changed.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if self.open() == 0 {
                return;
            }
            n.await;
        }
    }
}

/// The socket, noting the first byte of a next request's head while the connection is
/// idle (so the header timeout, not the idle one, then applies).
struct Io {
    stream: TcpStream,
    state: Arc<ConnState>,
}

impl AsyncRead for Io {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.stream).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            let mut i = self.state.lock();
            if i.in_flight == 0 && i.served > 0 && i.head_started.is_none() {
                i.head_started = Some(Instant::now());
                drop(i);
                self.state.wake.notify_one();
            }
        }
        r
    }
}

impl AsyncWrite for Io {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// A response body that keeps its connection busy until hyper has taken all of it.
struct Tracked {
    body: Body,
    _busy: Busy,
}

impl hyper::body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }
    fn is_end_stream(&self) -> bool {
        hyper::body::Body::is_end_stream(&self.body)
    }
    fn size_hint(&self) -> SizeHint {
        hyper::body::Body::size_hint(&self.body)
    }
}

/// The router, marking its connection busy for each request.
#[derive(Clone)]
struct Svc {
    inner: TowerToHyperService<Router>,
    state: Arc<ConnState>,
}

impl hyper::service::Service<Request<Incoming>> for Svc {
    type Response = Response<Tracked>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Tracked>, Infallible>> + Send>>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        let busy = Busy::new(self.state.clone());
        let fut = self.inner.call(req);
        Box::pin(async move {
            let resp = fut.await?;
            Ok(resp.map(|body| Tracked { body, _busy: busy }))
        })
    }
}

/// Serve one connection until it ends, times out, is evicted or the drain drops it.
async fn run_conn(
    stream: TcpStream,
    state: Arc<ConnState>,
    router: Router,
    limits: Limits,
    mut phase: watch::Receiver<Phase>,
) {
    let io = TokioIo::new(Io {
        stream,
        state: state.clone(),
    });
    let svc = Svc {
        inner: TowerToHyperService::new(router),
        state: state.clone(),
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.keep_alive(true).header_read_timeout(None);
    let conn = builder.serve_connection(io, svc);
    tokio::pin!(conn);
    // Set once the connection was asked to close (hyper then ends it when it is idle).
    let mut closing: Option<Instant> = None;
    loop {
        let ph = *phase.borrow_and_update();
        if ph == Phase::Force {
            break;
        }
        let now = Instant::now();
        let deadline = state.deadline(&limits);
        let evict = state.lock().evict;
        let close = ph == Phase::Drain || evict || deadline.is_some_and(|d| d <= now);
        if close && closing.is_none() {
            conn.as_mut().graceful_shutdown();
            closing = Some(now + CLOSE_GRACE);
        }
        // An idle connection hyper did not end itself (a head still arriving): drop it.
        let drop_at = match (closing, deadline) {
            (Some(t), Some(_)) => Some(t),
            (None, d) => d,
            (Some(_), None) => None,
        };
        if closing.is_some() && drop_at.is_some_and(|t| t <= now) {
            break;
        }
        let sleep = async move {
            match drop_at {
                Some(t) => tokio::time::sleep_until(t.into()).await,
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = conn.as_mut() => break,
            _ = sleep => {}
            _ = state.wake.notified() => {}
            r = phase.changed() => {
                if r.is_err() {
                    break;
                }
            }
        }
    }
}

/// Accept and serve until the phase leaves [`Phase::Serve`]; then wait until every
/// connection has closed (the drain) or been dropped ([`Phase::Force`]).
pub(crate) async fn serve_connections(
    listener: TcpListener,
    router: Router,
    registry: Arc<Registry>,
    limits: Limits,
    phase: watch::Receiver<Phase>,
) {
    let mut stop = phase.clone();
    let stopped = async move {
        let _ = stop.wait_for(|p| *p != Phase::Serve).await;
    };
    tokio::pin!(stopped);
    'accept: loop {
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                // Out of file descriptors and the like: wait and try again.
                Err(_) => {
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_millis(50)) => continue,
                        _ = &mut stopped => break 'accept,
                    }
                }
            },
            _ = &mut stopped => break,
        };
        let _ = stream.set_nodelay(true);
        // Room for it: below the cap, or once an idle connection has closed.
        loop {
            let changed = registry.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if registry.open() < limits.max_connections {
                break;
            }
            registry.evict_oldest_idle();
            tokio::select! {
                _ = changed => {}
                _ = &mut stopped => break 'accept,
            }
        }
        let state = registry.add();
        let registry = registry.clone();
        let router = router.clone();
        let phase = phase.clone();
        tokio::spawn(async move {
            run_conn(stream, state.clone(), router, limits, phase).await;
            registry.remove(&state);
        });
    }
    drop(listener);
    registry.all_closed().await;
}
