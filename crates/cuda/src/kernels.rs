//! Typed launches of the whole-forward kernels (`forward.cu`, `qwen4exp.cu`,
//! `glm5next.cu`): one struct per kernel whose fields are the kernel's parameters, named
//! as in the CUDA source and in its order, and whose `launch` is the only way the decoder
//! starts it (the threads per block are the kernel's own).
//!
//! Owns: those structs and the products' launch ([`Mv`]). Does not own: the one unsafe
//! launch (`GpuDecoder::launch_smem`, which also checks the parameter kinds against
//! `KERNEL_SIGNATURES`), nor what the kernels compute. A field is a device address (`u64`,
//! 0 a null pointer), an `i32` (C `int`), an `f32` or an `i64` (C `long long`). The tests
//! below check every struct's field names and kinds against the CUDA source and
//! `KERNEL_SIGNATURES` (which `no_gpu` checks against the compiled PTX), so a field out of
//! order fails on CI, without a GPU.

use sluice_models::ModelError;

use crate::blocks::deltanet::GDN_THREADS;
use crate::blocks::hyper_lowrank::GROUP_THREADS;
use crate::forward::{GpuDecoder, Kernel, ATT_THREADS};
use crate::launch::A;

/// The Rust type of a parameter kind of `KERNEL_SIGNATURES`.
macro_rules! kind_ty {
    (P) => {
        u64
    };
    (I) => {
        i32
    };
    (F) => {
        f32
    };
    (L) => {
        i64
    };
}

/// One kernel: `Name => funcs_field[selector], threads, "cuda name", "file" { params }`.
/// A selector (a `usize` field that is not a parameter) picks the kernel of a family
/// (per format or per cache type).
macro_rules! kernel {
    (
        $(#[$doc:meta])*
        $name:ident => $func:ident $([$sel:ident])?, $threads:expr, $cuda:literal, $file:literal {
            $($field:ident: $kind:ident,)*
        }
    ) => {
        $(#[$doc])*
        #[derive(Clone, Copy)]
        pub(crate) struct $name {
            $(pub(crate) $sel: usize,)?
            $(pub(crate) $field: kind_ty!($kind),)*
        }

        impl $name {
            /// Launch it over `grid` on the decoder's stream.
            #[allow(dead_code)]
            pub(crate) fn launch(&self, dec: &GpuDecoder, grid: (u32, u32, u32)) -> Result<(), ModelError> {
                self.launch_smem(dec, grid, 0)
            }

            /// [`Self::launch`] with `smem` bytes of dynamic shared memory.
            #[allow(dead_code)]
            pub(crate) fn launch_smem(
                &self,
                dec: &GpuDecoder,
                grid: (u32, u32, u32),
                smem: usize,
            ) -> Result<(), ModelError> {
                let k: &Kernel = &dec.f.$func $([self.$sel])?;
                dec.launch_smem(k, grid, $threads, smem, &[$(A::$kind(self.$field)),*])
            }
        }

        #[cfg(test)]
        impl tests::Described for $name {
            const CUDA: &'static str = $cuda;
            const FILE: &'static str = $file;
            const PARAMS: &'static [&'static str] = &[$(stringify!($field)),*];
            const KINDS: &'static str = concat!($(stringify!($kind)),*);
        }
    };
}

kernel! {
    /// Rows of the embedding `w` (format `format`) for `tokens`, times `scale`, into `x`.
    Embed => embed[format], 128, "embed_", "forward.cu" {
        w: P,
        row_bytes: L,
        tokens: P,
        x: P,
        cols: I,
        scale: F,
    }
}

kernel! {
    /// `out[i] = rms_norm(x[rows ? rows[i] : i]) * w` (`w` 0: unweighted).
    RmsNormRows => rms_norm_rows, 256, "rms_norm_rows", "forward.cu" {
        x: P,
        w: P,
        out: P,
        rows: P,
        cols: I,
        eps: F,
    }
}

kernel! {
    /// `x += post ? rms_norm(o) * post : o`, then `h = rms_norm(x) * next` if `next`;
    /// with `d` (0: none) `o` first becomes the MoE combine of `d`, `wts`, `sh`, `sg`
    /// (`k` slots), as [`MoeCombine`] writes it.
    ResidualNorm => residual_norm, 256, "residual_norm", "forward.cu" {
        x: P,
        o: P,
        post: P,
        next: P,
        h: P,
        cols: I,
        eps: F,
        d: P,
        wts: P,
        sh: P,
        sg: P,
        k: I,
    }
}

kernel! {
    /// Per-head q / k RMS norms (0: none) and NEOX RoPE of a token's query and key heads;
    /// with `kc` (0: none) also the key and value rows into the cache (`kv_store`'s work).
    QkNormRope => qk_norm_rope, 128, "qk_norm_rope", "forward.cu" {
        q: P,
        k: P,
        qn: P,
        kn: P,
        pos: P,
        inv_freq: P,
        nh: I,
        nkv: I,
        hd: I,
        eps: F,
        kc: P,
        vc: P,
        v: P,
        kv_f32: I,
        kdim: I,
        vdim: I,
    }
}

kernel! {
    /// A token's key and value rows into the cache rows its position names (`cache`: 0 f16, 1 f32).
    KvStore => kv_store[cache], 256, "kv_store_", "forward.cu" {
        k: P,
        v: P,
        kc: P,
        vc: P,
        pos: P,
        kdim: I,
        vdim: I,
    }
}

kernel! {
    /// Softmax attention of a token's query heads over the cache (`window` 0: global; `sel` 0: every position).
    Attention => attention[cache], ATT_THREADS, "attention_", "forward.cu" {
        q: P,
        kc: P,
        vc: P,
        out: P,
        pos: P,
        nh: I,
        nkv: I,
        hd: I,
        hdv: I,
        scale: F,
        window: I,
        sel: P,
        nsel: P,
        top_k: I,
    }
}

kernel! {
    /// A token's router scores, selection bias or hash table, top-k ids and weights; with
    /// `chunks` (0: none; one token) also `moe_chunks`' table of its pairs.
    TopkRoute => topk_route, 32, "topk_route", "forward.cu" {
        logits: P,
        bias: P,
        n_expert: I,
        k: I,
        score: I,
        norm: I,
        scale: F,
        ids: P,
        wts: P,
        table: P,
        tokens: P,
        chunks: P,
        n_chunks: P,
    }
}

kernel! {
    /// The (token, slot) pairs grouped by expert into chunk rows, on the device.
    MoeChunks => moe_chunks, 1024, "moe_chunks", "forward.cu" {
        gids: P,
        n_pairs: I,
        n_expert: I,
        chunks: P,
        n_chunks: P,
    }
}

kernel! {
    /// The int8 products' input: chunk row t of chunk c (input row `rows[t] / x_div`)
    /// quantized per 32 columns into row `c * MVG_N + t` of `xq`.
    QuantX8 => quant_x8, 256, "quant_x8", "forward.cu" {
        chunks: P,
        n_chunks: P,
        x: P,
        x_div: I,
        xq: P,
        cols: I,
    }
}

kernel! {
    /// `g = act(g) * u` over `n` values.
    GluAct => glu_act, 256, "glu_act", "forward.cu" {
        g: P,
        u: P,
        n: L,
        act: I,
        limit: F,
    }
}

kernel! {
    /// The weighted sum of a token's expert outputs plus the (gated) shared expert.
    MoeCombine => moe_combine, 256, "moe_combine", "forward.cu" {
        d: P,
        wts: P,
        sh: P,
        sg: P,
        o: P,
        k: I,
        cols: I,
    }
}

kernel! {
    /// Absorbed MLA: the normed latent and the roped shared key as a `[c | k_rope]` key row and a `c` value row.
    MlaKvPrep => mla_kv_prep, 256, "mla_kv_prep", "forward.cu" {
        kva: P,
        norm: P,
        pos: P,
        inv_freq: P,
        k: P,
        v: P,
        kl: I,
        rope: I,
        eps: F,
    }
}

kernel! {
    /// Absorbed MLA: the queries' nope parts gathered per head.
    MlaQSplit => mla_q_split, 64, "mla_q_split", "forward.cu" {
        q: P,
        qn: P,
        nh: I,
        nope: I,
        rope: I,
    }
}

kernel! {
    /// Absorbed MLA: `[q_abs | roped q_rope]` attention queries per head.
    MlaQJoin => mla_q_join, 128, "mla_q_join", "forward.cu" {
        qabs: P,
        q: P,
        pos: P,
        inv_freq: P,
        qatt: P,
        nh: I,
        nope: I,
        rope: I,
        kl: I,
    }
}

kernel! {
    /// The embedding copied into every hyper-connection stream.
    HcExpand => hc_expand, 256, "hc_expand", "forward.cu" {
        src: P,
        x: P,
        e: I,
        hc: I,
    }
}

kernel! {
    /// A hyper-connection mix: its segment sums, Sinkhorn, the collapsed input (and post / comb).
    HcPre => hc_pre, 256, "hc_pre", "forward.cu" {
        m: P,
        base: P,
        scale: P,
        x: P,
        pc: P,
        norm: P,
        h: P,
        hc: I,
        e: I,
        iters: I,
        nseg: I,
        eps: F,
        rms_eps: F,
    }
}

kernel! {
    /// `x[dst] = post[dst] y + sum_src comb[src][dst] x[src]`.
    HcPost => hc_post, 256, "hc_post", "forward.cu" {
        x: P,
        y: P,
        pc: P,
        hc: I,
        e: I,
    }
}

kernel! {
    /// Per-head RMS and partial interleaved RoPE (or the output's de-rotation, `flags`).
    Dsv4Heads => dsv4_heads, 128, "dsv4_heads", "forward.cu" {
        x: P,
        pos: P,
        inv_freq: P,
        n_heads: I,
        hd: I,
        n_rot: I,
        flags: I,
        eps: F,
    }
}

kernel! {
    /// GLM's DSA indexer keys: LayerNorm, RoPE on their first dims, stored per position.
    DsaKeyPrep => dsa_key_prep, 256, "dsa_key_prep", "forward.cu" {
        ik: P,
        w: P,
        b: P,
        pos: P,
        inv_freq: P,
        keys: P,
        d: I,
        n_rot: I,
        eps: F,
    }
}

kernel! {
    /// DeepSeek V4's KV row: RMS norm, partial RoPE, f16 rounding when `round`.
    Dsv4KvPrep => dsv4_kv_prep, 256, "dsv4_kv_prep", "forward.cu" {
        kv: P,
        norm: P,
        pos: P,
        inv_freq: P,
        hd: I,
        n_rot: I,
        round: I,
        eps: F,
    }
}

kernel! {
    /// DeepSeek V4's compressed rows from the batch and the carry ring.
    Dsv4Compress => dsv4_compress, 256, "dsv4_compress", "forward.cu" {
        c: P,
        z: P,
        rc: P,
        rz: P,
        ape: P,
        norm: P,
        pos: P,
        inv_freq: P,
        rows: P,
        ratio: I,
        hd: I,
        coff: I,
        n_rot: I,
        round: I,
        eps: F,
    }
}

kernel! {
    /// The batch's last `slots` rows into their ring slots.
    RingStore => ring_store, 256, "ring_store", "forward.cu" {
        c: P,
        z: P,
        rc: P,
        rz: P,
        pos: P,
        width: I,
        slots: I,
        n: I,
    }
}

kernel! {
    /// An indexer's scores of every row a token sees.
    Dsv4IndexScores => dsv4_index_scores, 256, "dsv4_index_scores", "forward.cu" {
        iq: P,
        wh: P,
        rows: P,
        pos: P,
        scores: P,
        n_head: I,
        ihd: I,
        ratio: I,
        stride: I,
    }
}

kernel! {
    /// An indexer's top-k rows per token (radix select, ties to the lower row, ascending).
    Dsv4Topk => dsv4_topk, 256, "dsv4_topk", "forward.cu" {
        scores: P,
        pos: P,
        sel: P,
        nsel: P,
        ratio: I,
        stride: I,
        k: I,
    }
}

kernel! {
    /// DeepSeek V4 attention: window rows, chosen compressed rows and the head's sink.
    Dsv4Attention => dsv4_attention, ATT_THREADS, "dsv4_attention", "forward.cu" {
        q: P,
        kb: P,
        ring: P,
        rows: P,
        sel: P,
        nsel: P,
        sinks: P,
        out: P,
        pos: P,
        nh: I,
        hd: I,
        window: I,
        ratio: I,
        top_k: I,
        scale: F,
    }
}

kernel! {
    /// A token's streams each RMS-normed with `w` (low-rank mixers, PLE).
    RmsGroups => rms_groups, GROUP_THREADS, "rms_groups", "qwen4exp.cu" {
        x: P,
        w: P,
        out: P,
        e: I,
        eps: F,
    }
}

kernel! {
    /// A low-rank mixer's segment sums, activation and injection weights.
    LrAct => lr_act, 128, "lr_act", "qwen4exp.cu" {
        part: P,
        u: P,
        inj: P,
        r: I,
        s: I,
        nseg: I,
        inv_s: F,
    }
}

kernel! {
    /// A low-rank mixer's block input from the normed streams.
    LrMix => lr_mix, 256, "lr_mix", "qwen4exp.cu" {
        gw: P,
        xn: P,
        m: P,
        e: I,
        s: I,
    }
}

kernel! {
    /// A low-rank residual's update of the streams by `y`.
    LrPost => lr_post, 256, "lr_post", "qwen4exp.cu" {
        x: P,
        y: P,
        inj: P,
        e: I,
        s: I,
    }
}

kernel! {
    /// The PLE layer's gated value rows.
    PleGate => ple_gate, GROUP_THREADS, "ple_gate", "qwen4exp.cu" {
        k: P,
        q: P,
        v: P,
        gv: P,
        e: I,
    }
}

kernel! {
    /// A causal depthwise convolution over the batch and the ring of earlier inputs.
    ConvRing => conv_ring, 256, "conv_ring", "qwen4exp.cu" {
        input: P,
        ring: P,
        w: P,
        gv: P,
        out: P,
        pos: P,
        width: I,
        kernel: I,
        dil: I,
    }
}

kernel! {
    /// The (gated or per-channel decayed) delta rule of a batch, a block per value head.
    DeltaRule => delta_rule, GDN_THREADS, "delta_rule", "qwen4exp.cu" {
        q: P,
        k: P,
        v: P,
        beta: P,
        g: P,
        z: P,
        a: P,
        dt_bias: P,
        norm: P,
        state: P,
        out: P,
        pos: P,
        ts: I,
        n: I,
        hk: I,
        dk: I,
        dv: I,
        gate_sigmoid: I,
        per_channel: I,
        eps: F,
    }
}

kernel! {
    /// QSA's heads: norms, RoPE, output gate, indexer queries and keys stored per position.
    QsaPrep => qsa_prep, 128, "qsa_prep", "qwen4exp.cu" {
        qg: P,
        q: P,
        gate: P,
        k: P,
        iq: P,
        ik: P,
        keys: P,
        qn: P,
        kn: P,
        iqn: P,
        pos: P,
        inv_freq: P,
        nh: I,
        nkv: I,
        hd: I,
        ih: I,
        id: I,
        n_rot: I,
        eps: F,
    }
}

kernel! {
    /// QSA's pooled block keys of every complete block.
    QsaPool => qsa_pool, 128, "qsa_pool", "qwen4exp.cu" {
        keys: P,
        pooled: P,
        norm: P,
        pos: P,
        inv_freq: P,
        id: I,
        ratio: I,
        n_rot: I,
        eps: F,
    }
}

kernel! {
    /// Chosen blocks to positions (with the incomplete block's tail).
    QsaExpand => qsa_expand, 128, "qsa_expand", "qwen4exp.cu" {
        bsel: P,
        nb: P,
        pos: P,
        psel: P,
        np: P,
        ratio: I,
        kb: I,
        kp: I,
        tail: I,
    }
}

kernel! {
    /// `out[i] = x[rows[i]]`.
    RowsGather => rows_gather, 256, "rows_gather", "qwen4exp.cu" {
        x: P,
        rows: P,
        out: P,
        cols: I,
    }
}

kernel! {
    /// Few-row f32 products, a block per token and row.
    DotRowsF32 => dot_rows_f32, 256, "dot_rows_f32", "qwen4exp.cu" {
        w: P,
        x: P,
        y: P,
        rows: I,
        cols: I,
    }
}

kernel! {
    /// The mean of a token's residual streams.
    StreamMean => stream_mean, 256, "stream_mean", "glm5next.cu" {
        x: P,
        h: P,
        e: I,
        s: I,
    }
}

kernel! {
    /// KDA's per-channel log-decay from its gate products.
    KdaGate => kda_gate, 256, "kda_gate", "glm5next.cu" {
        f: P,
        dt_bias: P,
        a: P,
        inner: I,
        d: I,
        lb: F,
        has_lb: I,
    }
}

kernel! {
    /// A k-pool indexer's keys and gates (LayerNorm) per position.
    PoolPrep => pool_prep, 128, "pool_prep", "glm5next.cu" {
        ik: P,
        gt: P,
        lnw: P,
        lnb: P,
        pos: P,
        keys: P,
        gates: P,
        id: I,
        eps: F,
        round: I,
    }
}

kernel! {
    /// A k-pool indexer's pooled keys of every complete pool.
    PoolMake => pool_make, 128, "pool_make", "glm5next.cu" {
        keys: P,
        gates: P,
        ape: P,
        pooled: P,
        pos: P,
        id: I,
        kp: I,
        round: I,
    }
}

/// The weight products `mvg_*` / `mvt_*` / `mvt1_*` (`MV_PARAMS` of `forward.cu`): up to
/// three matrices of one format and shape (pointer-table entries `w0..w2`, outputs
/// `y0..y2`, `rows0..rows2` rows; unused slots have no rows) over the chunk table
/// `chunks` (count at `n_chunks`), input rows `x` (`x_div` chunk rows per input row);
/// `staging` (`stages`, `step`, `stage_bytes`) only for the decode kernel `mvt1_*`.
#[derive(Clone, Copy)]
pub(crate) struct Mv {
    pub(crate) w0: u64,
    pub(crate) w1: u64,
    pub(crate) w2: u64,
    pub(crate) chunks: u64,
    pub(crate) n_chunks: u64,
    pub(crate) x: u64,
    pub(crate) x_div: i32,
    pub(crate) y0: u64,
    pub(crate) y1: u64,
    pub(crate) y2: u64,
    pub(crate) rows0: i32,
    pub(crate) rows1: i32,
    pub(crate) rows2: i32,
    pub(crate) cols: i32,
    pub(crate) row_bytes: i64,
    pub(crate) staging: Option<[i32; 3]>,
}

impl Mv {
    /// Launch the product kernel `k` (its form and format chosen by the caller) with
    /// `threads` a block and `smem` bytes of dynamic shared memory.
    pub(crate) fn launch(
        &self,
        dec: &GpuDecoder,
        k: &Kernel,
        grid: (u32, u32, u32),
        threads: u32,
        smem: usize,
    ) -> Result<(), ModelError> {
        let mut args = vec![
            A::P(self.w0),
            A::P(self.w1),
            A::P(self.w2),
            A::P(self.chunks),
            A::P(self.n_chunks),
            A::P(self.x),
            A::I(self.x_div),
            A::P(self.y0),
            A::P(self.y1),
            A::P(self.y2),
            A::I(self.rows0),
            A::I(self.rows1),
            A::I(self.rows2),
            A::I(self.cols),
            A::L(self.row_bytes),
        ];
        if let Some([stages, step, stage_bytes]) = self.staging {
            args.extend([A::I(stages), A::I(step), A::I(stage_bytes)]);
        }
        dec.launch_smem(k, grid, threads, smem, &args)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// What a typed launch says of its kernel.
    pub(crate) trait Described {
        const CUDA: &'static str;
        const FILE: &'static str;
        const PARAMS: &'static [&'static str];
        const KINDS: &'static str;
    }

    fn source(file: &str) -> String {
        let s = match file {
            "forward.cu" => include_str!("forward.cu"),
            "qwen4exp.cu" => include_str!("qwen4exp.cu"),
            "glm5next.cu" => include_str!("glm5next.cu"),
            _ => panic!("unknown source {file}"),
        };
        // Macro bodies continue over escaped line ends.
        s.replace("\\\n", " ")
    }

    /// The parameter names of `text` (`const float* __restrict__ x, int n` -> x, n).
    fn names(text: &str) -> Vec<String> {
        text.split(',')
            .map(|p| {
                let last = p
                    .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .rfind(|w| !w.is_empty())
                    .expect("a parameter name");
                match last {
                    // Rust keywords and upper-case names the structs rename.
                    "in" => "input".to_string(),
                    "X" | "W" => last.to_lowercase(),
                    _ => last.to_string(),
                }
            })
            .collect()
    }

    /// The parameter names of kernel `name` in `file` (a family's `name##suffix`).
    fn cuda_params(file: &str, name: &str) -> Vec<String> {
        let s = source(file);
        let pattern = if name.ends_with('_') {
            format!(" {name}##name(")
        } else {
            format!(" {name}(")
        };
        let at = s
            .match_indices(&pattern)
            .map(|(i, _)| i)
            .find(|&i| s[..i].trim_end().ends_with(')') || s[..i].trim_end().ends_with("void"))
            .unwrap_or_else(|| panic!("kernel {name} not found in {file}"));
        let open = at + pattern.len();
        let close = open + s[open..].find(')').expect("closing parenthesis");
        names(&s[open..close])
    }

    fn check<T: Described>() {
        let sig = crate::forward::kernel_signature(T::CUDA)
            .unwrap_or_else(|| panic!("{}: no signature", T::CUDA));
        assert_eq!(T::KINDS, sig, "{}: kinds", T::CUDA);
        assert_eq!(
            T::PARAMS,
            &cuda_params(T::FILE, T::CUDA)[..],
            "{}: parameter names and order",
            T::CUDA
        );
    }

    /// Checks `T` and gives its CUDA name.
    fn checked<T: Described>() -> &'static str {
        check::<T>();
        T::CUDA
    }

    #[test]
    fn typed_launches_match_the_cuda_source() {
        let typed = [
            checked::<Embed>(),
            checked::<RmsNormRows>(),
            checked::<ResidualNorm>(),
            checked::<QkNormRope>(),
            checked::<KvStore>(),
            checked::<Attention>(),
            checked::<TopkRoute>(),
            checked::<MoeChunks>(),
            checked::<QuantX8>(),
            checked::<GluAct>(),
            checked::<MoeCombine>(),
            checked::<MlaKvPrep>(),
            checked::<MlaQSplit>(),
            checked::<MlaQJoin>(),
            checked::<HcExpand>(),
            checked::<HcPre>(),
            checked::<HcPost>(),
            checked::<Dsv4Heads>(),
            checked::<DsaKeyPrep>(),
            checked::<Dsv4KvPrep>(),
            checked::<Dsv4Compress>(),
            checked::<RingStore>(),
            checked::<Dsv4IndexScores>(),
            checked::<Dsv4Topk>(),
            checked::<Dsv4Attention>(),
            checked::<RmsGroups>(),
            checked::<LrAct>(),
            checked::<LrMix>(),
            checked::<LrPost>(),
            checked::<PleGate>(),
            checked::<ConvRing>(),
            checked::<DeltaRule>(),
            checked::<QsaPrep>(),
            checked::<QsaPool>(),
            checked::<QsaExpand>(),
            checked::<RowsGather>(),
            checked::<DotRowsF32>(),
            checked::<StreamMean>(),
            checked::<KdaGate>(),
            checked::<PoolPrep>(),
            checked::<PoolMake>(),
        ];
        // Every kernel of KERNEL_SIGNATURES has a typed launch (the products' family is
        // `Mv`, checked below), and no two launches name one kernel.
        let mut want: Vec<&str> = crate::forward::KERNEL_SIGNATURES
            .iter()
            .map(|(k, _)| *k)
            .filter(|k| {
                ![
                    "mvg_", "mvt_", "mvt1_", "mvd_", "mvi_", "mvi1_", "mvid_", "mvq_",
                ]
                .contains(k)
            })
            .collect();
        let mut have = typed.to_vec();
        want.sort_unstable();
        have.sort_unstable();
        assert_eq!(have, want);
    }

    #[test]
    fn products_match_the_cuda_source() {
        let s = source("forward.cu");
        let at = s.find("#define MV_PARAMS").expect("MV_PARAMS");
        let body = &s[at + "#define MV_PARAMS".len()..];
        let body = &body[..body.find('\n').expect("one line")];
        let want = [
            "w0",
            "w1",
            "w2",
            "chunks",
            "n_chunks",
            "x",
            "x_div",
            "y0",
            "y1",
            "y2",
            "rows0",
            "rows1",
            "rows2",
            "cols",
            "row_bytes",
        ];
        assert_eq!(names(body), want);
        assert_eq!(
            crate::forward::kernel_signature("mvg_q8_0"),
            Some("PPPPPPIPPPIIIIL")
        );
        let open =
            s.find("mvt1_##name(MV_PARAMS,").expect("mvt1_") + "mvt1_##name(MV_PARAMS,".len();
        let close = open + s[open..].find(')').expect(")");
        assert_eq!(names(&s[open..close]), ["stages", "step", "stage_bytes"]);
        assert_eq!(
            crate::forward::kernel_signature("mvt1_q8_0"),
            Some("PPPPPPIPPPIIIILIII")
        );
        let open = s.find("mvd_##name(MV_PARAMS,").expect("mvd_") + "mvd_##name(MV_PARAMS,".len();
        let close = open + s[open..].find(')').expect(")");
        assert_eq!(names(&s[open..close]), ["stages", "step", "stage_bytes"]);
        assert_eq!(
            crate::forward::kernel_signature("mvd_q8_0"),
            Some("PPPPPPIPPPIIIILIII")
        );
    }
}
