//! `sluice pack MODEL.gguf [-o SIDECAR]`: writes the packed-experts sidecar (each routed
//! expert's matrices contiguous and 4 KiB aligned) that streaming reads one expert at a
//! time from. The model file is not modified.
//!
//! Owns: flags and messages only; the format and writer are `sluice_engine::tier::pack`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use sluice_engine::tier::pack::{default_path, write_pack};
use sluice_engine::Model;

#[derive(Debug, clap::Args)]
pub struct PackArgs {
    /// The model (.gguf).
    pub model: PathBuf,
    /// Sidecar to write (default: MODEL.gguf.slpack next to the model, where streaming
    /// finds it). Written as FILE.tmp and renamed when complete.
    #[arg(short, long)]
    pub output: Option<PathBuf>,
}

pub fn main(args: PackArgs) -> anyhow::Result<()> {
    if !args.model.is_file() {
        bail!("{}: no such file", args.model.display());
    }
    let out = args
        .output
        .clone()
        .unwrap_or_else(|| default_path(&args.model));
    if out == args.model {
        bail!("{}: the sidecar cannot replace the model", out.display());
    }
    let model = Model::load(&args.model).with_context(|| args.model.display().to_string())?;
    let t0 = Instant::now();
    let n = write_pack(
        &args.model,
        model.map.bytes(),
        model.gguf.data_offset,
        &model.groups.experts,
        &out,
    )?;
    let s = t0.elapsed().as_secs_f64();
    eprintln!(
        "wrote {} ({n} bytes) in {s:.1} s: {:.2} GB/s",
        out.display(),
        n as f64 / 1e9 / s.max(1e-9)
    );
    Ok(())
}
