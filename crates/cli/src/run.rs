//! `sluice run`: generate text from a prompt, or chat interactively.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use sluice_engine::chat::{ChatMessage, ChatTemplate};
use sluice_engine::eval::write_npy_f32;
use sluice_engine::kv::KvCache;
use sluice_engine::sampler::{Sampler, SamplerConfig};
use sluice_engine::tokenizer::{StreamDecoder, Tokenizer};
use sluice_engine::{Logits, Model};

use crate::common::{Loaded, ModelArgs};

/// Generate text. With -p: answer one prompt and exit. Without: interactive chat
/// (Ctrl-C stops the current answer, Ctrl-D exits).
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
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
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

/// Sampling flags (llama.cpp's defaults; `--temp 0` is greedy).
#[derive(clap::Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Temperature; 0 = greedy (always the most likely token).
    #[arg(long = "temp", default_value_t = 0.8)]
    pub temp: f32,
    /// Keep only the K most likely tokens (0 = off).
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches P (1.0 = off).
    #[arg(long = "top-p", default_value_t = 0.95)]
    pub top_p: f32,
    /// Drop tokens less likely than P times the most likely one (0 = off).
    #[arg(long = "min-p", default_value_t = 0.05)]
    pub min_p: f32,
    /// Penalise tokens seen in the last --repeat-last-n tokens (1.0 = off).
    #[arg(long = "repeat-penalty", default_value_t = 1.0)]
    pub repeat_penalty: f32,
    #[arg(long = "repeat-last-n", default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Random seed (default: from the clock; printed with the stats).
    #[arg(long)]
    pub seed: Option<u64>,
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

pub fn main(args: RunArgs) -> Result<()> {
    let mut loaded = args.model.load()?;
    let tok = Tokenizer::from_gguf(&loaded.model.gguf)?;
    eprintln!(
        "loaded {} ({}, {} layers) in {:.2} s, {} threads",
        args.model.model.display(),
        loaded.model.cfg.arch.name(),
        loaded.model.cfg.n_layer,
        loaded.load_secs,
        loaded.pool.current_num_threads()
    );
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        // Ctrl-C stops the current answer; a second Ctrl-C while idle exits.
        let _ = ctrlc::set_handler(move || {
            if stop.swap(true, Ordering::SeqCst) {
                std::process::exit(130);
            }
        });
    }
    let mut sampler = Sampler::new(args.sampling.config());
    let mut kv = loaded.new_kv(args.model.ctx, args.model.kv_f32);
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
            (None, Some(p)) => {
                let text = if args.raw {
                    p.clone()
                } else {
                    render(&loaded.model, &tok, &args, &[ChatMessage::new("user", p)])?
                };
                tok.encode(&text, true, !args.raw)
            }
            (None, None) => unreachable!(),
        };
        let (timing, _) = generate(
            &loaded,
            &tok,
            &mut sampler,
            &mut kv,
            &prompt_tokens,
            &args,
            &stop,
            dump.as_mut(),
        )?;
        report(&loaded, &args, &timing);
        if let Some(d) = &dump {
            write_dump(d, &loaded.model)?;
        }
        return loaded.finish();
    }

    // Interactive chat: the whole conversation is re-rendered each turn and only the new
    // suffix is evaluated (the KV cache keeps the common prefix).
    let mut messages: Vec<ChatMessage> = Vec::new();
    if let Some(s) = &args.system {
        messages.push(ChatMessage::new("system", s));
    }
    let mut history: Vec<u32> = Vec::new();
    let stdin = std::io::stdin();
    loop {
        eprint!("\n> ");
        std::io::stderr().flush().ok();
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            eprintln!();
            return loaded.finish();
        }
        let line = line.trim_end_matches(['\n', '\r']).to_string();
        if line.is_empty() {
            continue;
        }
        messages.push(ChatMessage::new("user", &line));
        let text = render(&loaded.model, &tok, &args, &messages)?;
        let all = tok.encode(&text, true, true);
        // Reuse the cached prefix.
        let common = history.iter().zip(&all).take_while(|(a, b)| a == b).count();
        kv.truncate(common);
        history.truncate(common);
        stop.store(false, Ordering::SeqCst);
        let new = all[common..].to_vec();
        let (timing, reply) = generate(
            &loaded,
            &tok,
            &mut sampler,
            &mut kv,
            &new,
            &args,
            &stop,
            None,
        )?;
        history.extend_from_slice(&new);
        history.extend_from_slice(&reply.1);
        println!();
        report(&loaded, &args, &timing);
        messages.push(ChatMessage::new("assistant", &reply.0));
    }
}

fn render(
    model: &Model,
    tok: &Tokenizer,
    args: &RunArgs,
    messages: &[ChatMessage],
) -> Result<String> {
    let mut all = Vec::new();
    if let Some(s) = &args.system {
        if messages.first().map(|m| m.role.as_str()) != Some("system") {
            all.push(ChatMessage::new("system", s));
        }
    }
    all.extend_from_slice(messages);
    let template = ChatTemplate::from_gguf(&model.gguf, tok);
    Ok(template.render(&all, true)?)
}

/// Prefill `prompt`, then sample and stream up to `n_predict` tokens to stdout.
/// Returns the timing and the generated (text, ids) (the final token is evaluated too,
/// so the KV cache holds everything that was printed).
#[allow(clippy::too_many_arguments)]
fn generate(
    loaded: &Loaded,
    tok: &Tokenizer,
    sampler: &mut Sampler,
    kv: &mut KvCache,
    prompt: &[u32],
    args: &RunArgs,
    stop: &AtomicBool,
    mut dump: Option<&mut Dump>,
) -> Result<(Timing, (String, Vec<u32>))> {
    let model = &loaded.model;
    let n_vocab = model.cfg.n_vocab;
    let mut timing = Timing {
        prompt_tokens: prompt.len(),
        ..Default::default()
    };
    if prompt.is_empty() {
        anyhow::bail!("the prompt is empty");
    }
    kv.check_room(prompt.len())
        .map_err(|e| anyhow::anyhow!("prompt of {} tokens: {e}", prompt.len()))?;
    let t0 = Instant::now();
    let mut last = Vec::new();
    let batch = args.model.batch;
    let n_chunks = prompt.len().div_ceil(batch);
    for (i, chunk) in prompt.chunks(batch).enumerate() {
        let mode = if dump.is_some() {
            Logits::All
        } else if i + 1 == n_chunks {
            Logits::Last
        } else {
            Logits::None
        };
        let logits = loaded.pool.install(|| model.forward(kv, chunk, mode))?;
        if let Some(d) = dump.as_deref_mut() {
            d.evaluated.extend_from_slice(chunk);
            d.logits.extend_from_slice(&logits);
        }
        if i + 1 == n_chunks {
            last = logits[logits.len() - n_vocab..].to_vec();
        }
    }
    timing.prefill_secs = t0.elapsed().as_secs_f64();

    let mut measure = loaded.start_measure(&args.model.stream)?;
    let t1 = Instant::now();
    let mut history: Vec<u32> = prompt.to_vec();
    let mut generated = Vec::new();
    let mut text = String::new();
    let mut decoder = StreamDecoder::new(tok);
    let stdout = std::io::stdout();
    for _ in 0..args.n_predict {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let id = sampler.sample(&last, &history);
        if tok.is_eog(id) {
            break;
        }
        let piece = decoder.push(id);
        if !piece.is_empty() {
            let mut out = stdout.lock();
            out.write_all(piece.as_bytes())?;
            out.flush()?;
            text.push_str(&piece);
        }
        history.push(id);
        generated.push(id);
        if kv.check_room(1).is_err() {
            eprintln!("\n[context full after {} tokens; stopping]", kv.len());
            break;
        }
        let logits = loaded
            .pool
            .install(|| model.forward(kv, &[id], Logits::Last))?;
        if let Some(d) = dump.as_deref_mut() {
            d.evaluated.push(id);
            d.logits.extend_from_slice(&logits);
        }
        if let Some(m) = measure.as_mut() {
            m.token()?;
        }
        last = logits;
    }
    let tail = decoder.finish();
    if !tail.is_empty() {
        print!("{tail}");
        text.push_str(&tail);
    }
    println!();
    timing.generated = generated.len();
    timing.decode_secs = t1.elapsed().as_secs_f64();
    if let Some(m) = &measure {
        m.finish(timing.generated, timing.decode_secs).print();
    }
    Ok((timing, (text, generated)))
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
