//! Worker sequences and the bounded queue in front of them.
//!
//! Owns: [`Scheduler`] (admission: at most `parallel + queue` requests in the system,
//! beyond that the caller answers 503), the `parallel` worker threads (each owns one
//! [`Session`] over the shared `Arc<Loaded>`; `Model::forward` is `&self` and the streaming
//! tier is safe for several sequences at once), a job's run (prefix reuse from the
//! worker's own sequence or a snapshot, prefill, the generate loop with hooks for stop
//! strings, cancellation and timing) and the [`Event`]s streamed back to the handler.

use std::collections::VecDeque;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use sluice_engine::load::Loaded;
use sluice_engine::sampler::{Sampler, SamplerConfig};
use sluice_engine::session::{GenerateOptions, HookError, Hooks, Session, StopReason};
use sluice_engine::text::tokenizer::{StreamDecoder, Tokenizer};
use sluice_engine::Logits;
use tokio::sync::mpsc::UnboundedSender;

use crate::metrics::Metrics;
use crate::prefix::PrefixCache;

/// How a sequence is set up (the CLI's `--ctx`, `--kv-f32`, `--batch`).
#[derive(Debug, Clone, Copy)]
pub struct SessionParams {
    pub ctx: usize,
    pub kv_f32: bool,
    pub batch: usize,
}

/// Why generation ended, in API terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-generation token.
    EndToken,
    /// `max_tokens` reached (or the context filled up).
    Length,
    /// A stop string matched (which one).
    StopString(String),
    /// The client went away or the server is shutting down.
    Cancelled,
}

/// What a job reports back, in order: `Started`, any number of `Text`, then `Done` or
/// `Error`.
#[derive(Debug)]
pub enum Event {
    /// Prompt evaluated from here on; `cached` tokens were reused.
    Started {
        cached: usize,
    },
    /// Newly generated text (never half a UTF-8 character, never part of a stop string),
    /// with the OpenAI `logprobs.content` entries of the tokens it completes (when asked).
    Text(String, Vec<serde_json::Value>),
    Done(Done),
    Error(String),
    /// Stopped by the server's shutdown (the drain deadline passed, or the job never
    /// started before it): never a normal finish (a 503, or an error event on a stream).
    Cut(String),
}

#[derive(Debug, Clone)]
pub struct Done {
    pub finish: Finish,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
}

/// One generation request.
pub struct Job {
    pub prompt: Vec<u32>,
    pub sampler: SamplerConfig,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// Set by the handler when its client goes away.
    pub cancel: Arc<AtomicBool>,
    pub events: UnboundedSender<Event>,
    pub admitted: Instant,
    /// Whether a prompt snapshot may be kept for prefix reuse (chat-style prompts).
    pub snapshot: bool,
    /// Report each token's log-probability and this many alternatives (None = off).
    pub logprobs: Option<usize>,
    /// The grammar sampling is constrained by (taken by the worker).
    pub constraint: Mutex<Option<crate::constrain::JobConstraint>>,
    /// Control tokens written out as their text (reasoning and tool-call markers that a
    /// vocabulary marks as control, e.g. Gemma 4's `<|channel>`), so the answer's reader
    /// sees them.
    pub show: Vec<u32>,
    /// Releases the job's admission slot when dropped.
    pub _slot: Slot,
}

/// A gate workers pass before each job; while closed they wait (tests use it to keep
/// requests in the system without relying on timing).
#[derive(Debug, Default)]
pub struct Gate {
    closed: Mutex<bool>,
    cv: Condvar,
}

impl Gate {
    pub fn close(&self) {
        *self.closed.lock().unwrap_or_else(|e| e.into_inner()) = true;
    }

    pub fn open(&self) {
        *self.closed.lock().unwrap_or_else(|e| e.into_inner()) = false;
        self.cv.notify_all();
    }

    fn pass(&self) {
        let mut c = self.closed.lock().unwrap_or_else(|e| e.into_inner());
        while *c {
            c = self.cv.wait(c).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// An admission slot; dropping it frees room in the queue.
pub struct Slot {
    inflight: Arc<AtomicUsize>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}

struct Queue {
    jobs: VecDeque<Job>,
    closed: bool,
}

/// Admission, the queue and the worker threads.
pub struct Scheduler {
    queue: Arc<(Mutex<Queue>, Condvar)>,
    inflight: Arc<AtomicUsize>,
    running: Arc<AtomicUsize>,
    capacity: usize,
    parallel: usize,
    workers: Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// Abort generations (shutdown after the drain deadline).
    pub abort: Arc<AtomicBool>,
}

/// What workers share.
pub struct Shared {
    pub loaded: Arc<Loaded>,
    pub tok: Arc<Tokenizer>,
    pub params: SessionParams,
    pub metrics: Arc<Metrics>,
    pub prefix: Arc<Mutex<PrefixCache>>,
    /// The snapshots on disk (`--prefix-cache-dir`).
    pub disk: Option<Arc<crate::prefix_disk::DiskCache>>,
    /// Workers wait at this gate before each job while it is closed (tests).
    pub gate: Option<Arc<Gate>>,
}

impl Scheduler {
    /// Start `parallel` workers; up to `queue` more requests may wait.
    pub fn start(shared: Arc<Shared>, parallel: usize, queue: usize) -> Scheduler {
        let parallel = parallel.max(1);
        let q = Arc::new((
            Mutex::new(Queue {
                jobs: VecDeque::new(),
                closed: false,
            }),
            Condvar::new(),
        ));
        let running = Arc::new(AtomicUsize::new(0));
        let abort = Arc::new(AtomicBool::new(false));
        let mut workers = Vec::new();
        for i in 0..parallel {
            let q = q.clone();
            let shared = shared.clone();
            let running = running.clone();
            let abort = abort.clone();
            let h = std::thread::Builder::new()
                .name(format!("sluice-seq-{i}"))
                .spawn(move || worker(&shared, &q, &running, &abort))
                .expect("spawn a worker thread");
            workers.push(h);
        }
        Scheduler {
            queue: q,
            inflight: Arc::new(AtomicUsize::new(0)),
            running,
            capacity: parallel + queue,
            parallel,
            workers: Mutex::new(workers),
            abort,
        }
    }

    /// A slot for one more request, or None when `parallel + queue` are in the system.
    pub fn admit(&self) -> Option<Slot> {
        let mut cur = self.inflight.load(Ordering::SeqCst);
        loop {
            if cur >= self.capacity {
                return None;
            }
            match self
                .inflight
                .compare_exchange(cur, cur + 1, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => {
                    return Some(Slot {
                        inflight: self.inflight.clone(),
                    })
                }
                Err(now) => cur = now,
            }
        }
    }

    /// Queue a job (it holds its slot).
    pub fn submit(&self, job: Job) {
        let (m, cv) = &*self.queue;
        let mut q = m.lock().unwrap_or_else(|e| e.into_inner());
        if q.closed {
            let _ = job
                .events
                .send(Event::Error("the server is shutting down".into()));
            return;
        }
        q.jobs.push_back(job);
        cv.notify_one();
    }

    pub fn queued(&self) -> usize {
        let (m, _) = &*self.queue;
        m.lock().unwrap_or_else(|e| e.into_inner()).jobs.len()
    }

    pub fn running(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }

    pub fn parallel(&self) -> usize {
        self.parallel
    }

    /// Let the workers finish what is queued, then stop them and wait.
    pub fn shutdown(&self) {
        {
            let (m, cv) = &*self.queue;
            let mut q = m.lock().unwrap_or_else(|e| e.into_inner());
            q.closed = true;
            cv.notify_all();
        }
        let workers = std::mem::take(&mut *self.workers.lock().unwrap_or_else(|e| e.into_inner()));
        for w in workers {
            let _ = w.join();
        }
    }
}

fn worker(shared: &Shared, q: &(Mutex<Queue>, Condvar), running: &AtomicUsize, abort: &AtomicBool) {
    let p = shared.params;
    let mut session = Session::new(&shared.loaded, p.ctx, p.kv_f32, p.batch);
    loop {
        let job = {
            let (m, cv) = q;
            let mut g = m.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if let Some(j) = g.jobs.pop_front() {
                    break j;
                }
                if g.closed {
                    return;
                }
                g = cv.wait(g).unwrap_or_else(|e| e.into_inner());
            }
        };
        running.fetch_add(1, Ordering::SeqCst);
        if let Some(g) = &shared.gate {
            g.pass();
        }
        let events = job.events.clone();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run_job(shared, &mut session, &job, abort)
        }));
        match result {
            Ok(Ok(done)) => {
                let m = &shared.metrics;
                let by_client = job.cancel.load(Ordering::SeqCst) || job.events.is_closed();
                if done.finish == Finish::Cancelled {
                    m.cancelled.fetch_add(1, Ordering::Relaxed);
                } else {
                    m.completed.fetch_add(1, Ordering::Relaxed);
                }
                if done.finish == Finish::Cancelled && !by_client && abort.load(Ordering::SeqCst) {
                    let _ = events.send(Event::Cut(format!(
                        "the server is shutting down: the answer was cut after {} generated tokens",
                        done.completion_tokens
                    )));
                } else {
                    let _ = events.send(Event::Done(done));
                }
            }
            Ok(Err(e)) => {
                session.reset();
                let _ = events.send(Event::Error(e));
            }
            Err(_) => {
                session.reset();
                let _ = events.send(Event::Error("internal error while generating".into()));
            }
        }
        running.fetch_sub(1, Ordering::SeqCst);
        drop(job);
        if let Some(d) = &shared.disk {
            d.flush();
        }
    }
}

/// Longest common prefix of two token lists.
fn lcp(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Reuse what can be reused for `prompt` (all but its last token): the worker's own
/// sequence (truncated where the state allows) or a snapshot, whichever covers more.
/// Returns the number of prompt tokens already evaluated.
fn reuse(shared: &Shared, session: &mut Session<'_>, prompt: &[u32]) -> usize {
    let head = &prompt[..prompt.len() - 1];
    let common = lcp(session.history(), head);
    let truncatable = session.state.extra.is_none();
    let own = if truncatable || common == session.history().len() {
        common
    } else {
        0
    };
    let found = {
        let mut pc = shared.prefix.lock().unwrap_or_else(|e| e.into_inner());
        pc.lookup(head, head.len())
    };
    let ram = found.as_ref().map_or(0, |f| f.tokens.len());
    if let Some(n) = reuse_from_disk(shared, session, head, ram.max(own)) {
        return n;
    }
    match found {
        Some(f) if f.tokens.len() > own => {
            session.restore(&f.snap, &f.tokens);
            f.tokens.len()
        }
        _ => session.reuse_prefix(&head[..own]),
    }
}

/// Restore the longest snapshot on disk that covers more than `longer_than` tokens of
/// `head` (and keep it in the RAM cache too); None when there is none or it was refused.
fn reuse_from_disk(
    shared: &Shared,
    session: &mut Session<'_>,
    head: &[u32],
    longer_than: usize,
) -> Option<usize> {
    let disk = shared.disk.as_ref()?;
    let found = disk.lookup(head, longer_than, head.len())?;
    let p = shared.params;
    let mut fresh = session.model().new_state(p.ctx, p.kv_f32);
    disk.load(&found, &mut fresh)?;
    let snap = fresh.snapshot();
    drop(fresh);
    session.restore(&snap, &found.tokens);
    let cfg = &shared.loaded.model.cfg;
    let bytes = cfg.kv_bytes_per_pos * found.tokens.len() as u64 + cfg.state_bytes;
    let mut pc = shared.prefix.lock().unwrap_or_else(|e| e.into_inner());
    pc.insert(found.tokens.to_vec(), snap, bytes);
    Some(found.tokens.len())
}

fn run_job(
    shared: &Shared,
    session: &mut Session<'_>,
    job: &Job,
    abort: &AtomicBool,
) -> Result<Done, String> {
    let prompt = &job.prompt;
    let n = prompt.len();
    if n == 0 {
        return Err("the prompt is empty".into());
    }
    let cancelled = || {
        job.cancel.load(Ordering::SeqCst) || job.events.is_closed() || abort.load(Ordering::SeqCst)
    };
    let metrics = &shared.metrics;
    let done = |finish, completion_tokens, cached_tokens| Done {
        finish,
        prompt_tokens: n,
        completion_tokens,
        cached_tokens,
    };
    if cancelled() {
        return Ok(done(Finish::Cancelled, 0, 0));
    }
    let cached = reuse(shared, session, prompt);
    if cached > 0 {
        metrics
            .prefix_reused_tokens
            .fetch_add(cached as u64, Ordering::Relaxed);
        metrics.prefix_hits.fetch_add(1, Ordering::Relaxed);
    }
    let _ = job.events.send(Event::Started { cached });
    // Prefill all but the last prompt token in batches, checking for cancellation.
    let head = &prompt[..n - 1];
    let batch = shared.params.batch.max(1);
    let mut at = cached;
    while at < head.len() {
        if cancelled() {
            session.reset();
            return Ok(done(Finish::Cancelled, 0, cached));
        }
        let end = (at + batch).min(head.len());
        session
            .prefill(&head[at..end], Logits::None)
            .map_err(|e| e.to_string())?;
        at = end;
    }
    // Snapshot at the message boundary for later requests extending this prompt.
    if job.snapshot && head.len() > cached {
        let cfg = &shared.loaded.model.cfg;
        let bytes = cfg.kv_bytes_per_pos * head.len() as u64 + cfg.state_bytes;
        let fits = {
            let pc = shared.prefix.lock().unwrap_or_else(|e| e.into_inner());
            pc.fits(bytes) && !pc.contains(head)
        };
        let disk = (shared.disk.as_ref()).filter(|d| d.fits(bytes) && !d.contains(head));
        if fits || disk.is_some() {
            let (snap, hist) = session.snapshot();
            let snap = Arc::new(snap);
            if let Some(d) = disk {
                // Written by the worker once the answer is sent (`DiskCache::flush`).
                d.queue(hist.clone(), snap.clone());
            }
            if fits {
                let mut pc = shared.prefix.lock().unwrap_or_else(|e| e.into_inner());
                pc.insert(hist, snap, bytes);
            }
        }
    }

    let tok = &*shared.tok;
    let mut hooks = JobHooks {
        tok,
        decoder: StreamDecoder::new(tok),
        job,
        abort,
        text: String::new(),
        emitted: 0,
        stopped: None,
        last: None,
        metrics,
        n_tokens: 0,
        prev: Vec::new(),
        pending: Vec::new(),
        constraint: job
            .constraint
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take(),
        grammar_done: false,
    };
    let opts = GenerateOptions {
        max_tokens: job.max_tokens,
        all_logits: false,
    };
    let mut sampler = Sampler::new(job.sampler);
    let g = session
        .generate(&prompt[n - 1..], &mut sampler, &opts, &mut hooks)
        .map_err(|e| e.to_string())?;
    // Flush what the decoder and the stop-string hold-back still have.
    if hooks.stopped.is_none() {
        let tail = hooks.decoder.finish();
        hooks.text.push_str(&tail);
        hooks.flush(true);
    }
    if !hooks.pending.is_empty() {
        let lp = std::mem::take(&mut hooks.pending);
        let _ = job.events.send(Event::Text(String::new(), lp));
    }
    let finish = if let Some(s) = hooks.stopped.take() {
        Finish::StopString(s)
    } else if hooks.grammar_done {
        // The grammar ended the answer (it accepts nothing more): a normal end.
        Finish::EndToken
    } else {
        match g.stop {
            Some(StopReason::EndToken(_)) => Finish::EndToken,
            Some(StopReason::Cancelled) => Finish::Cancelled,
            _ => Finish::Length,
        }
    };
    let completion = g.tokens.len();
    metrics
        .completion_tokens
        .fetch_add(completion as u64, Ordering::Relaxed);
    Ok(done(finish, completion, cached))
}

/// The generate loop's hooks for one job: decode pieces, hold back text that may start a
/// stop string, stop on a match, on cancellation; time tokens.
struct JobHooks<'a> {
    tok: &'a Tokenizer,
    decoder: StreamDecoder<'a>,
    job: &'a Job,
    abort: &'a AtomicBool,
    /// Text generated so far (up to a stop string when one matched).
    text: String,
    /// Bytes of `text` already sent.
    emitted: usize,
    stopped: Option<String>,
    last: Option<Instant>,
    metrics: &'a Metrics,
    n_tokens: usize,
    /// Logits the next token is sampled from (kept only when logprobs are asked for).
    prev: Vec<f32>,
    /// Logprob entries not sent yet.
    pending: Vec<serde_json::Value>,
    /// Constrained decoding: masks before each sample, told each token.
    constraint: Option<crate::constrain::JobConstraint>,
    /// The grammar completed (generation stopped there).
    grammar_done: bool,
}

impl JobHooks<'_> {
    /// Send what can be sent: everything when `all`, else what cannot be the start of a
    /// stop string.
    fn flush(&mut self, all: bool) {
        let mut end = self.text.len();
        if !all {
            end = sluice_engine::text::stop::safe_end(&self.text, &self.job.stop);
        }
        end = end.max(self.emitted);
        if end > self.emitted {
            let piece = self.text[self.emitted..end].to_string();
            self.emitted = end;
            let lp = std::mem::take(&mut self.pending);
            let _ = self.job.events.send(Event::Text(piece, lp));
        }
    }
}

/// OpenAI's `logprobs.content` entry for `id` sampled from `logits` (raw model
/// distribution, before temperature and truncation), with the `top` most likely tokens.
fn logprob_entry(tok: &Tokenizer, logits: &[f32], id: u32, top: usize) -> serde_json::Value {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + logits.iter().map(|&l| (l - max).exp()).sum::<f32>().ln();
    let entry = |i: u32| {
        let bytes = tok.piece(i).to_vec();
        serde_json::json!({
            "token": String::from_utf8_lossy(&bytes),
            "logprob": logits.get(i as usize).map(|&l| l - lse).unwrap_or(f32::NEG_INFINITY).max(-9999.0),
            "bytes": bytes,
        })
    };
    let mut best: Vec<u32> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if best.len() < top || l > logits[best[best.len() - 1] as usize] {
                let pos = best
                    .iter()
                    .position(|&b| l > logits[b as usize])
                    .unwrap_or(best.len());
                best.insert(pos, i as u32);
                best.truncate(top);
            }
        }
    }
    let mut e = entry(id);
    e["top_logprobs"] = serde_json::Value::Array(best.into_iter().map(entry).collect());
    e
}

impl Hooks for JobHooks<'_> {
    fn prefill_chunk(&mut self, _tokens: &[u32], logits: &[f32]) -> Result<(), HookError> {
        if self.job.logprobs.is_some() {
            self.prev = logits.to_vec();
        }
        Ok(())
    }

    fn step(&mut self, _id: u32, logits: &[f32]) -> Result<(), HookError> {
        if self.job.logprobs.is_some() {
            self.prev.clear();
            self.prev.extend_from_slice(logits);
        }
        Ok(())
    }

    fn should_stop(&mut self) -> bool {
        self.job.cancel.load(Ordering::SeqCst)
            || self.job.events.is_closed()
            || self.abort.load(Ordering::SeqCst)
    }

    fn constrain(&mut self, logits: &mut [f32]) -> Result<(), HookError> {
        if let Some(c) = &mut self.constraint {
            c.apply(logits)?;
        }
        Ok(())
    }

    fn is_end(&mut self, id: u32) -> bool {
        self.tok.is_eog(id)
    }

    fn token(&mut self, id: u32) -> Result<ControlFlow<()>, HookError> {
        let now = Instant::now();
        match self.last {
            None => self
                .metrics
                .ttft
                .observe(now.duration_since(self.job.admitted).as_secs_f64()),
            Some(t) => self
                .metrics
                .token_latency
                .observe(now.duration_since(t).as_secs_f64()),
        }
        self.last = Some(now);
        self.n_tokens += 1;
        if let Some(c) = &mut self.constraint {
            c.commit(id)?;
            self.grammar_done = c.done();
        }
        if let Some(top) = self.job.logprobs {
            if !self.prev.is_empty() {
                let e = logprob_entry(self.tok, &self.prev, id, top);
                self.pending.push(e);
            }
        }
        let mut piece = self.decoder.push(id);
        if self.job.show.contains(&id) {
            piece.push_str(self.tok.token_text(id).unwrap_or(""));
        }
        if piece.is_empty() {
            return Ok(if self.grammar_done {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            });
        }
        let before = self.text.len();
        self.text.push_str(&piece);
        if !self.job.stop.is_empty() {
            // A match may start in text already held back (never in text already sent).
            let from =
                before.saturating_sub(self.job.stop.iter().map(|s| s.len()).max().unwrap_or(0));
            let best = sluice_engine::text::stop::first_match(&self.text, from, &self.job.stop)
                .map(|(pos, k)| (pos, &self.job.stop[k]));
            if let Some((pos, s)) = best {
                let s = s.clone();
                self.text.truncate(pos.max(self.emitted));
                self.flush(true);
                self.stopped = Some(s);
                return Ok(ControlFlow::Break(()));
            }
        }
        self.flush(false);
        if self.grammar_done {
            return Ok(ControlFlow::Break(()));
        }
        Ok(ControlFlow::Continue(()))
    }
}
