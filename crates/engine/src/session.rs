//! One sequence through a loaded model: prefill, decode, sampling, stop conditions.
//!
//! Owns: [`Session`] (the sequence state, chunked prefill, one-token steps, the generate
//! loop with its stop conditions and timing, snapshots and prefix reuse) and the
//! [`Hooks`] a caller plugs into the loop (print a token, keep logits for a dump, run
//! measure mode's page-cache drops). `run`, `bench`, `perplexity` and the server use it,
//! so the loop exists once.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use sluice_models::{Logits, Model, SeqState, Snapshot};

use crate::load::Loaded;
use crate::sampler::Sampler;
use crate::EngineError;

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// `max_tokens` were generated.
    MaxTokens,
    /// The model produced an end-of-generation token (not evaluated, not returned).
    EndToken(u32),
    /// The context is full.
    ContextFull,
    /// A hook asked to stop (Ctrl-C, a client that went away, a stop string).
    Cancelled,
}

/// What one `generate` call did.
#[derive(Debug, Clone, Default)]
pub struct Generation {
    /// Generated token ids (each evaluated, so the state holds them, except the last one
    /// when the context filled up).
    pub tokens: Vec<u32>,
    /// Prompt tokens evaluated (fewer than the prompt's when a stop cut the prefill).
    pub prompt_tokens: usize,
    pub prefill_secs: f64,
    pub decode_secs: f64,
    pub stop: Option<StopReason>,
}

/// Limits of one `generate` call.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    /// Keep logits of every prefill position (for dumps); otherwise only the last.
    pub all_logits: bool,
}

/// Error type hooks return (anything that says what went wrong).
pub type HookError = Box<dyn std::error::Error + Send + Sync>;

/// Callbacks of the generate loop; every method has a do-nothing default.
pub trait Hooks {
    /// Logits of an evaluated prefill chunk (every position when `all_logits`).
    fn prefill_chunk(&mut self, _tokens: &[u32], _logits: &[f32]) -> Result<(), HookError> {
        Ok(())
    }
    /// Decoding starts (after the prompt).
    fn decode_start(&mut self) -> Result<(), HookError> {
        Ok(())
    }
    /// Whether to stop before sampling the next token.
    fn should_stop(&mut self) -> bool {
        false
    }
    /// Change the logits the next token is sampled from (constrained decoding sets the
    /// tokens a grammar forbids to -inf). Runs after `should_stop`, before sampling.
    fn constrain(&mut self, _logits: &mut [f32]) -> Result<(), HookError> {
        Ok(())
    }
    /// Whether `id` ends generation (end-of-generation tokens).
    fn is_end(&mut self, _id: u32) -> bool {
        false
    }
    /// A token was chosen (before it is evaluated). `Break` stops after it.
    fn token(&mut self, _id: u32) -> Result<ControlFlow<()>, HookError> {
        Ok(ControlFlow::Continue(()))
    }
    /// A generated token was evaluated; `logits` are the next position's.
    fn step(&mut self, _id: u32, _logits: &[f32]) -> Result<(), HookError> {
        Ok(())
    }
}

/// Called with each evaluated prefill chunk and its logits; `Break` stops the prefill
/// there (the chunks evaluated so far stay in the state).
type ChunkFn<'a> = dyn FnMut(&[u32], &[f32]) -> Result<ControlFlow<()>, HookError> + 'a;

/// No hooks.
pub struct NoHooks;
impl Hooks for NoHooks {}

/// The compute pool a session's forwards run in.
///
/// Sessions that compute at the same time never share a rayon pool: a pool worker waiting
/// in a join would steal another sequence's whole forward (an `install` is a job in the
/// pool's queue), and that forward could then wait in the expert tier for budget or units
/// that only the sequence below it on the same stack can release: a deadlock (issue 35,
/// item 1). The first session of a model takes the loaded pool; a session created while
/// that one is taken gets a pool of its own with the same thread count (built at its
/// first forward). Results never depend on which pool runs them.
enum SessionPool<'m> {
    /// The loaded model's pool, leased until the session is dropped.
    Leased {
        pool: &'m rayon::ThreadPool,
        lease: &'m AtomicBool,
    },
    /// A pool of this session's own (`None` until the first forward).
    Own {
        threads: usize,
        pool: Option<rayon::ThreadPool>,
    },
}

impl<'m> SessionPool<'m> {
    fn for_session(loaded: &'m Loaded) -> SessionPool<'m> {
        if loaded
            .pool_leased
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            SessionPool::Leased {
                pool: &loaded.pool,
                lease: &loaded.pool_leased,
            }
        } else {
            SessionPool::Own {
                threads: loaded.pool.current_num_threads(),
                pool: None,
            }
        }
    }

    fn get(&mut self) -> Result<&rayon::ThreadPool, EngineError> {
        match self {
            SessionPool::Leased { pool, .. } => Ok(pool),
            SessionPool::Own { threads, pool } => {
                if pool.is_none() {
                    let threads = *threads;
                    *pool = Some(
                        sluice_models::threads::compute_pool(threads)
                            .map_err(|source| EngineError::Threads { threads, source })?,
                    );
                }
                Ok(pool.as_ref().expect("built above"))
            }
        }
    }
}

impl Drop for SessionPool<'_> {
    fn drop(&mut self) {
        if let SessionPool::Leased { lease, .. } = self {
            lease.store(false, Ordering::Release);
        }
    }
}

/// One sequence over a loaded model.
pub struct Session<'m> {
    model: &'m Model,
    pool: SessionPool<'m>,
    pub state: SeqState,
    /// Prompt tokens per forward call during prefill.
    batch: usize,
    /// Every token the state holds, in order (for prefix reuse and penalties).
    history: Vec<u32>,
}

impl<'m> Session<'m> {
    /// A new, empty sequence of up to `n_ctx` positions (capped at the model's trained
    /// context), with the KV precision asked for.
    pub fn new(loaded: &'m Loaded, n_ctx: usize, kv_f32: bool, batch: usize) -> Session<'m> {
        Session {
            model: &loaded.model,
            pool: SessionPool::for_session(loaded),
            state: loaded.model.new_state(n_ctx, kv_f32),
            batch: batch.max(1),
            history: Vec::new(),
        }
    }

    pub fn model(&self) -> &'m Model {
        self.model
    }

    /// Tokens the state holds.
    pub fn history(&self) -> &[u32] {
        &self.history
    }

    /// Positions left in the context.
    pub fn room(&self) -> usize {
        self.state.n_ctx() - self.state.len()
    }

    /// Forget everything.
    pub fn reset(&mut self) {
        self.state.clear();
        self.history.clear();
    }

    /// Evaluate `tokens` in chunks of the batch size. Returns the logits `mode` asks for
    /// (for `Last`, the last position's).
    pub fn prefill(&mut self, tokens: &[u32], mode: Logits) -> Result<Vec<f32>, EngineError> {
        let all = self.prefill_with(tokens, mode, &mut |_, _| Ok(ControlFlow::Continue(())))?;
        Ok(all.unwrap_or_default())
    }

    fn prefill_with(
        &mut self,
        tokens: &[u32],
        mode: Logits,
        on_chunk: &mut ChunkFn<'_>,
    ) -> Result<Option<Vec<f32>>, EngineError> {
        self.state.kv.check_room(tokens.len())?;
        let n_chunks = tokens.len().div_ceil(self.batch);
        if n_chunks > 1 {
            // The whole prompt's certain units (hash-routed experts) start reading now;
            // each chunk's forward then finds them cached or in flight.
            self.model.prefetch_certain(tokens);
        }
        let mut out = Vec::new();
        for (i, chunk) in tokens.chunks(self.batch).enumerate() {
            let last = i + 1 == n_chunks;
            let m = match mode {
                Logits::All => Logits::All,
                Logits::Last if last => Logits::Last,
                _ => Logits::None,
            };
            let model = self.model;
            let state = &mut self.state;
            let logits = self
                .pool
                .get()?
                .install(|| model.forward(state, chunk, m))?;
            self.history.extend_from_slice(chunk);
            let flow = on_chunk(chunk, &logits).map_err(EngineError::Hook)?;
            match mode {
                Logits::All => out.extend_from_slice(&logits),
                Logits::Last if last => out = logits,
                _ => {}
            }
            if flow.is_break() && !last {
                return Ok(None);
            }
        }
        Ok(Some(out))
    }

    /// Evaluate one token; returns the next position's logits.
    pub fn step(&mut self, id: u32) -> Result<Vec<f32>, EngineError> {
        let model = self.model;
        let state = &mut self.state;
        let logits = self
            .pool
            .get()?
            .install(|| model.forward(state, &[id], Logits::Last))?;
        self.history.push(id);
        Ok(logits)
    }

    /// Copy the sequence as it is now.
    pub fn snapshot(&self) -> (Snapshot, Vec<u32>) {
        (self.state.snapshot(), self.history.clone())
    }

    /// Return to a snapshot of this model.
    pub fn restore(&mut self, snap: &Snapshot, history: &[u32]) {
        self.state.restore(snap);
        self.history = history.to_vec();
    }

    /// Keep the longest prefix of the current history shared with `tokens` (truncating
    /// where the state allows it, else starting over) and return how many tokens of
    /// `tokens` are already evaluated.
    pub fn reuse_prefix(&mut self, tokens: &[u32]) -> usize {
        let common = self
            .history
            .iter()
            .zip(tokens)
            .take_while(|(a, b)| a == b)
            .count();
        if self.state.truncate(common) {
            self.history.truncate(common);
            common
        } else {
            self.reset();
            0
        }
    }

    /// Prefill `prompt` (continuing the current state), then sample up to
    /// `opts.max_tokens` tokens with `sampler`, evaluating each so the state holds
    /// everything generated. Stops at an end token, a full context, a hook's request.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        sampler: &mut Sampler,
        opts: &GenerateOptions,
        hooks: &mut dyn Hooks,
    ) -> Result<Generation, EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::Option {
                flag: "prompt",
                what: "the prompt is empty".into(),
            });
        }
        let n_vocab = self.model.cfg.n_vocab;
        let mut g = Generation {
            prompt_tokens: prompt.len(),
            ..Default::default()
        };
        let t0 = Instant::now();
        let mode = if opts.all_logits {
            Logits::All
        } else {
            Logits::Last
        };
        // A stop asked for while loading or prefilling is honoured before the first chunk
        // and between chunks (a long prompt is many chunks), not only when decode starts.
        let before = self.history.len();
        let prefilled = if hooks.should_stop() {
            None
        } else {
            self.prefill_with(prompt, mode, &mut |c, l| {
                hooks.prefill_chunk(c, l)?;
                Ok(if hooks.should_stop() {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                })
            })?
        };
        g.prefill_secs = t0.elapsed().as_secs_f64();
        let Some(logits) = prefilled else {
            g.prompt_tokens = self.history.len() - before;
            g.stop = Some(StopReason::Cancelled);
            return Ok(g);
        };
        let mut last = logits[logits.len() - n_vocab..].to_vec();

        hooks.decode_start().map_err(EngineError::Hook)?;
        let t1 = Instant::now();
        let mut stop = StopReason::MaxTokens;
        for _ in 0..opts.max_tokens {
            if hooks.should_stop() {
                stop = StopReason::Cancelled;
                break;
            }
            hooks.constrain(&mut last).map_err(EngineError::Hook)?;
            let id = sampler.sample(&last, &self.history);
            if hooks.is_end(id) {
                stop = StopReason::EndToken(id);
                break;
            }
            let flow = hooks.token(id).map_err(EngineError::Hook)?;
            if self.room() == 0 {
                g.tokens.push(id);
                stop = StopReason::ContextFull;
                break;
            }
            last = self.step(id)?;
            g.tokens.push(id);
            hooks.step(id, &last).map_err(EngineError::Hook)?;
            if flow.is_break() {
                stop = StopReason::Cancelled;
                break;
            }
        }
        g.decode_secs = t1.elapsed().as_secs_f64();
        g.stop = Some(stop);
        Ok(g)
    }
}
