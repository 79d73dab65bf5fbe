//! `sluice run`: generate text from a prompt, or chat interactively.

use std::io::{BufRead, Write};
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result};
use sluice_engine::eval::write_npy_f32;
use sluice_engine::sampler::{Sampler, SamplerConfig};
use sluice_engine::session::{GenerateOptions, HookError, Hooks, Session, StopReason};
use sluice_engine::text::chat::{ChatMessage, ChatTemplate};
use sluice_engine::text::tokenizer::{StreamDecoder, Tokenizer};
use sluice_engine::Model;

use crate::common::{Interrupted, Loaded, MeasureArgs, ModelArgs, PrintStats, Terminated};
use crate::signals::RunSignals;

/// Generate text. With -p: answer one prompt and exit. Without: interactive chat
/// (Ctrl-C stops the current answer, Ctrl-D exits).
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub measure: MeasureArgs,
    /// The prompt. Without it (and without --tokens) sluice starts an interactive chat.
    #[arg(short = 'p', long = "prompt")]
    pub prompt: Option<String>,
    /// Token ids to evaluate instead of a prompt, e.g. `--tokens 2,651,6037`.
    #[arg(long = "tokens", value_delimiter = ',', conflicts_with = "prompt")]
    pub tokens: Option<Vec<u32>>,
    /// Tokens to generate at most.
    #[arg(short = 'n', long = "n-predict", default_value_t = 256)]
    pub n_predict: usize,
    /// Use the prompt as is, without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// System prompt for the chat template.
    #[arg(long)]
    pub system: Option<String>,
    /// Write DIR/logits.npy (float32 [positions, n_vocab], every evaluated position) and
    /// DIR/tokens.json, for byte-for-byte comparison of runs.
    #[arg(long = "dump-logits", value_name = "DIR")]
    pub dump_logits: Option<PathBuf>,
    /// Stop the answer where this text appears (not printed; repeatable). `\n`, `\t` and
    /// `\\` are read as newline, tab and backslash, e.g. `--stop '\n'` ends at the line's end.
    #[arg(long = "stop", value_name = "TEXT", value_parser = stop_text)]
    pub stop: Vec<String>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

/// A `--stop` value with its escapes read; an empty one would stop before any text.
fn stop_text(s: &str) -> Result<String, String> {
    let mut out = String::new();
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('\\') => out.push('\\'),
            Some(o) => {
                return Err(format!(
                    "unknown escape \\{o} (\\n, \\t and \\\\ are known)"
                ))
            }
            None => out.push('\\'),
        }
    }
    if out.is_empty() {
        return Err("must not be empty".into());
    }
    Ok(out)
}

/// Sampling flags (llama.cpp's defaults; `--temp 0` is greedy).
#[derive(clap::Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Temperature; 0 = greedy (always the most likely token).
    #[arg(long = "temp", default_value_t = 0.8, value_parser = finite, allow_negative_numbers = true)]
    pub temp: f32,
    /// Keep only the K most likely tokens (0 = off).
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches P (1.0 = off).
    #[arg(long = "top-p", default_value_t = 0.95, value_parser = finite, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Drop tokens less likely than P times the most likely one (0 = off).
    #[arg(long = "min-p", default_value_t = 0.05, value_parser = finite, allow_negative_numbers = true)]
    pub min_p: f32,
    /// Penalise tokens seen in the last --repeat-last-n tokens (1.0 = off).
    #[arg(long = "repeat-penalty", default_value_t = 1.0, value_parser = positive, allow_negative_numbers = true)]
    pub repeat_penalty: f32,
    #[arg(long = "repeat-last-n", default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Random seed (default: from the clock; printed with the stats).
    #[arg(long)]
    pub seed: Option<u64>,
}

/// A finite number (NaN or Inf would make every draw the same garbage).
fn finite(s: &str) -> Result<f32, String> {
    let v: f32 = s.parse().map_err(|e| format!("{e}"))?;
    if !v.is_finite() {
        return Err("must be a finite number".into());
    }
    Ok(v)
}

/// A finite number > 0 (a penalty of 0 divides by zero, a negative one flips signs).
fn positive(s: &str) -> Result<f32, String> {
    let v = finite(s)?;
    if v <= 0.0 {
        return Err("must be > 0 (1.0 = off)".into());
    }
    Ok(v)
}

impl SamplingArgs {
    pub fn config(&self) -> SamplerConfig {
        let seed = self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        });
        SamplerConfig {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            repeat_last_n: self.repeat_last_n,
            seed,
        }
    }
}

/// Timings of one answer.
#[derive(Default)]
struct Timing {
    prompt_tokens: usize,
    prefill_secs: f64,
    generated: usize,
    decode_secs: f64,
}

/// Logits of every evaluated position, kept for `--dump-logits`.
struct Dump {
    dir: PathBuf,
    logits: Vec<f32>,
    evaluated: Vec<u32>,
}

pub fn main(mut args: RunArgs) -> Result<()> {
    // Installed before loading so an early signal is seen too (never the default kill).
    let signals = RunSignals::install()?;
    let stop = signals.stop.clone();
    args.measure.adjust(&mut args.model);
    let mut loaded = args.model.load()?;
    let tok = Tokenizer::from_gguf(&loaded.model.gguf)?;
    eprintln!(
        "loaded {} ({}, {} layers) in {:.2} s, {} threads",
        args.model.model.display(),
        loaded.model.cfg.arch,
        loaded.model.cfg.n_layer,
        loaded.load_secs,
        loaded.pool.current_num_threads()
    );
    let mut sampler = Sampler::new(args.sampling.config());
    let mut session = loaded.session(&args.model);
    let mut dump = args.dump_logits.as_ref().map(|dir| Dump {
        dir: dir.clone(),
        logits: Vec::new(),
        evaluated: Vec::new(),
    });
    if let Some(d) = &dump {
        std::fs::create_dir_all(&d.dir)
            .with_context(|| format!("{}: cannot create", d.dir.display()))?;
    }

    let one_shot = args.prompt.is_some() || args.tokens.is_some();
    if one_shot {
        let prompt_tokens = match (&args.tokens, &args.prompt) {
            (Some(t), _) => t.clone(),
            (None, Some(p)) if args.raw => tok.encode(p, true, false),
            (None, Some(p)) => {
                prompt_ids(&loaded.model, &tok, &args, &[ChatMessage::new("user", p)])?
            }
            (None, None) => unreachable!(),
        };
        let (timing, _) = generate(
            &loaded,
            &tok,
            &mut sampler,
            &mut session,
            &prompt_tokens,
            &args,
            &stop,
            dump.as_mut(),
        )?;
        report(&loaded, &args, &timing);
        if let Some(d) = &dump {
            write_dump(d, &loaded.model)?;
        }
        drop(session);
        loaded.finish()?;
        if signals.terminating() {
            eprintln!("[terminated after {} generated tokens]", timing.generated);
            return Err(Terminated.into());
        }
        if stop.load(Ordering::SeqCst) {
            eprintln!("[interrupted after {} generated tokens]", timing.generated);
            return Err(Interrupted.into());
        }
        return Ok(());
    }

    // Interactive chat: the whole conversation is re-rendered each turn and only the new
    // suffix is evaluated (the KV cache keeps the common prefix).
    let mut messages: Vec<ChatMessage> = Vec::new();
    if let Some(s) = &args.system {
        messages.push(ChatMessage::new("system", s));
    }
    let mut history: Vec<u32> = Vec::new();
    let stdin = std::io::stdin();
    let n_ctx = session.state.n_ctx();
    loop {
        eprint!("\n> ");
        std::io::stderr().flush().ok();
        let mut raw = Vec::new();
        signals.set_idle(true);
        let read = stdin.lock().read_until(b'\n', &mut raw);
        signals.set_idle(false);
        if read? == 0 {
            eprintln!();
            drop(session);
            return loaded.finish();
        }
        // One bad line never ends the conversation: say what was wrong and skip it.
        let line = match String::from_utf8(raw) {
            Ok(l) => l,
            Err(e) => {
                eprintln!(
                    "[this line is not valid UTF-8 text (invalid byte at byte {}); skipped]",
                    e.utf8_error().valid_up_to()
                );
                continue;
            }
        };
        let line = line.trim_end_matches(['\n', '\r']).to_string();
        if line.is_empty() {
            continue;
        }
        messages.push(ChatMessage::new("user", &line));
        // The whole conversation must fit the context with room to answer: drop the
        // oldest turns (never the system prompt) until it does, and say so.
        let keep_from = usize::from(args.system.is_some());
        let mut dropped = 0;
        let all = loop {
            let all = prompt_ids(&loaded.model, &tok, &args, &messages)?;
            if all.len() < n_ctx || messages.len() <= keep_from + 1 {
                break all;
            }
            let n = 2.min(messages.len() - keep_from - 1);
            messages.drain(keep_from..keep_from + n);
            dropped += n;
        };
        if dropped > 0 {
            eprintln!(
                "[the conversation outgrew the context of {n_ctx} tokens: dropped the {dropped} oldest messages]"
            );
        }
        if all.len() >= n_ctx {
            messages.pop();
            eprintln!(
                "[this message is {} tokens with the template; the context holds {n_ctx} (raise --ctx); skipped]",
                all.len()
            );
            continue;
        }
        // Reuse the cached prefix.
        let common = session.reuse_prefix(&all);
        history.truncate(common);
        stop.store(false, Ordering::SeqCst);
        let new = all[common..].to_vec();
        let (timing, reply) = generate(
            &loaded,
            &tok,
            &mut sampler,
            &mut session,
            &new,
            &args,
            &stop,
            None,
        )?;
        history.extend_from_slice(&new);
        history.extend_from_slice(&reply.1);
        crate::common::emit("\n")?;
        report(&loaded, &args, &timing);
        if signals.terminating() {
            drop(session);
            loaded.finish()?;
            return Err(Terminated.into());
        }
        messages.push(ChatMessage::new("assistant", &reply.0));
    }
}

/// The conversation rendered with the chat template and encoded with one BOS: a template
/// that writes the BOS text itself is not given a second one (as llama.cpp's
/// `common_chat_templates_apply` strips the template's leading BOS when the vocabulary
/// adds one).
fn prompt_ids(
    model: &Model,
    tok: &Tokenizer,
    args: &RunArgs,
    messages: &[ChatMessage],
) -> Result<Vec<u32>> {
    let mut all = Vec::new();
    if let Some(s) = &args.system {
        if messages.first().map(|m| m.role.as_str()) != Some("system") {
            all.push(ChatMessage::new("system", s));
        }
    }
    all.extend_from_slice(messages);
    let template = ChatTemplate::from_gguf(&model.gguf, tok);
    Ok(template.encode_prompt(tok, &all, true)?)
}

/// What `run` plugs into the session's generate loop: print each piece as it decodes,
/// keep logits for `--dump-logits`, run `--measure`, stop on Ctrl-C.
struct RunHooks<'a, 'm> {
    tok: &'a Tokenizer,
    all: bool,
    decoder: StreamDecoder<'a>,
    text: String,
    /// Bytes of `text` printed so far (the rest may be the start of a `--stop` string).
    shown: usize,
    /// `--stop` strings; `stopped` once one was found (the text then ends before it).
    stops: &'a [String],
    stopped: bool,
    stop: &'a AtomicBool,
    dump: Option<&'a mut Dump>,
    loaded: &'m Loaded,
    measure_args: &'a crate::common::MeasureArgs,
    measure: Option<crate::measure::Measure<'m>>,
}

impl RunHooks<'_, '_> {
    /// Prints `text` up to byte `end` (what was not printed yet).
    fn show(&mut self, end: usize) -> std::io::Result<()> {
        if end > self.shown {
            let mut out = std::io::stdout().lock();
            out.write_all(&self.text.as_bytes()[self.shown..end])?;
            out.flush()?;
            self.shown = end;
        }
        Ok(())
    }
}

impl Hooks for RunHooks<'_, '_> {
    fn prefill_chunk(&mut self, tokens: &[u32], logits: &[f32]) -> Result<(), HookError> {
        if let Some(d) = self.dump.as_deref_mut() {
            d.evaluated.extend_from_slice(tokens);
            d.logits.extend_from_slice(logits);
        }
        Ok(())
    }
    fn decode_start(&mut self) -> Result<(), HookError> {
        self.measure = self.loaded.start_measure(self.measure_args)?;
        Ok(())
    }
    fn should_stop(&mut self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }
    fn is_end(&mut self, id: u32) -> bool {
        self.tok.is_eog(id)
    }
    fn token(&mut self, id: u32) -> Result<ControlFlow<()>, HookError> {
        let piece = self.decoder.push(id);
        if piece.is_empty() {
            return Ok(ControlFlow::Continue(()));
        }
        let before = self.text.len();
        self.text.push_str(&piece);
        let longest = self.stops.iter().map(|s| s.len()).max().unwrap_or(0);
        if let Some((pos, _)) = sluice_engine::text::stop::first_match(
            &self.text,
            before.saturating_sub(longest),
            self.stops,
        ) {
            let pos = pos.max(self.shown);
            self.text.truncate(pos);
            self.stopped = true;
            self.show(pos)?;
            return Ok(ControlFlow::Break(()));
        }
        self.show(sluice_engine::text::stop::safe_end(&self.text, self.stops))?;
        Ok(ControlFlow::Continue(()))
    }
    fn step(&mut self, id: u32, logits: &[f32]) -> Result<(), HookError> {
        if let Some(d) = self.dump.as_deref_mut() {
            d.evaluated.push(id);
            d.logits.extend_from_slice(logits);
        }
        if let Some(m) = self.measure.as_mut() {
            m.token()?;
        }
        Ok(())
    }
}

/// Prefill `prompt`, then sample and stream up to `n_predict` tokens to stdout.
/// Returns the timing and the generated (text, ids) (the final token is evaluated too,
/// so the sequence holds everything that was printed).
#[allow(clippy::too_many_arguments)]
fn generate(
    loaded: &Loaded,
    tok: &Tokenizer,
    sampler: &mut Sampler,
    session: &mut Session<'_>,
    prompt: &[u32],
    args: &RunArgs,
    stop: &AtomicBool,
    dump: Option<&mut Dump>,
) -> Result<(Timing, (String, Vec<u32>))> {
    if prompt.is_empty() {
        anyhow::bail!("the prompt is empty");
    }
    session
        .state
        .kv
        .check_room(prompt.len())
        .map_err(|e| anyhow::anyhow!("prompt of {} tokens: {e}", prompt.len()))?;
    let mut hooks = RunHooks {
        tok,
        decoder: StreamDecoder::new(tok),
        text: String::new(),
        shown: 0,
        stops: &args.stop,
        stopped: false,
        stop,
        all: dump.is_some(),
        dump,
        loaded,
        measure_args: &args.measure,
        measure: None,
    };
    let opts = GenerateOptions {
        max_tokens: args.n_predict,
        all_logits: hooks.all,
    };
    let g = session.generate(prompt, sampler, &opts, &mut hooks)?;
    if g.stop == Some(StopReason::ContextFull) {
        eprintln!(
            "\n[context full after {} tokens; stopping]",
            session.state.len()
        );
    }
    if !hooks.stopped {
        let tail = hooks.decoder.finish();
        hooks.text.push_str(&tail);
        hooks.show(hooks.text.len())?;
    }
    crate::common::emit("\n")?;
    let timing = Timing {
        prompt_tokens: g.prompt_tokens,
        prefill_secs: g.prefill_secs,
        generated: g.tokens.len(),
        decode_secs: g.decode_secs,
    };
    if let Some(m) = &hooks.measure {
        m.finish(timing.generated, timing.decode_secs).print();
    }
    Ok((timing, (hooks.text, g.tokens)))
}

/// Timing line, and the streaming statistics when `--stats` asks for them.
fn report(loaded: &Loaded, args: &RunArgs, t: &Timing) {
    print_timing(t);
    if args.model.stream.stats {
        loaded.print_stats(t.prefill_secs + t.decode_secs);
    }
}

fn print_timing(t: &Timing) {
    eprintln!(
        "prefill: {} tokens in {:.2} s ({:.1} tok/s) | decode: {} tokens in {:.2} s ({:.1} tok/s)",
        t.prompt_tokens,
        t.prefill_secs,
        t.prompt_tokens as f64 / t.prefill_secs.max(1e-9),
        t.generated,
        t.decode_secs,
        t.generated as f64 / t.decode_secs.max(1e-9)
    );
}

fn write_dump(d: &Dump, model: &Model) -> Result<()> {
    let n_vocab = model.cfg.n_vocab;
    let rows = d.logits.len() / n_vocab;
    let npy = d.dir.join("logits.npy");
    write_npy_f32(&npy, &d.logits, rows, n_vocab)
        .with_context(|| format!("{}: cannot write", npy.display()))?;
    let json = serde_json::json!({ "tokens": d.evaluated, "n_positions": rows });
    let path = d.dir.join("tokens.json");
    let tmp = d.dir.join("tokens.json.tmp");
    std::fs::write(&tmp, serde_json::to_string(&json)?)
        .with_context(|| format!("{}: cannot write", tmp.display()))?;
    std::fs::rename(&tmp, &path)?;
    eprintln!(
        "wrote {} ({rows} x {n_vocab}) and {}",
        npy.display(),
        path.display()
    );
    Ok(())
}
