//! Kernel launches: the one door every launch of this crate goes through ([`launch`],
//! which checks the arguments' kinds against the kernel's signature first), and the typed
//! launches of the products backend's kernels (`kernels.cu`, what `Cuda` runs for
//! architectures without a decoder plan): [`MvJob`] (one entry of `mv_*`'s job table),
//! [`MvLaunch`] (one `mv_*` launch over a run of the table) and [`Mm`] (`mm_*`, the tiled
//! product behind `SLUICE_CUDA_TILED=1`).
//!
//! Does not own: the whole-forward kernels' typed launches (`crate::kernels`, through
//! `GpuDecoder::launch_smem`), nor where the buffers the addresses point into live. The
//! unit tests check [`MvJob`] and [`Mm`] against `kernels.cu` (field names, order, the
//! table entry's bytes) and [`PRODUCT_SIGNATURES`] against them; `no_gpu` checks the
//! signatures against the compiled PTX.

use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

/// One kernel parameter.
#[derive(Clone, Copy)]
pub(crate) enum A {
    /// A device address (or 0 for a null pointer).
    P(u64),
    I(i32),
    F(f32),
    L(i64),
}

/// Parameter kinds of the products backend's kernels (`kernels.cu`), as
/// `forward::KERNEL_SIGNATURES` gives the whole forward pass's: `mv_*` takes its job table,
/// `mm_*` (W, X, Y, rows, cols, row_bytes, n).
pub const PRODUCT_SIGNATURES: &[(&str, &str)] = &[("mv_", "P"), ("mm_", "PPPIILI")];

/// The signature of a products kernel named `name` ([`PRODUCT_SIGNATURES`]).
pub(crate) fn product_signature(name: &str) -> &'static str {
    PRODUCT_SIGNATURES
        .iter()
        .find(|(k, _)| name.starts_with(k))
        .map_or("", |(_, s)| s)
}

/// Launch `f` (kernel `name`, parameter kinds `sig`) over `grid` with `block` threads and
/// `smem` bytes of dynamic shared memory, on `stream`. Arguments whose kinds differ from
/// `sig` are refused before anything reaches the driver. Errors: what went wrong, for the
/// caller to prefix.
///
/// # Safety
///
/// `sig` is the kernel's parameter list (kinds and order, `KERNEL_SIGNATURES` /
/// [`PRODUCT_SIGNATURES`], checked against the PTX by `no_gpu`); every address in `args`
/// points into a device buffer that stays alive and unmoved until the stream has run the
/// launch, sized for what the kernel reads and writes over `grid`; `smem` is within what
/// the kernel may have.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn launch(
    stream: &CudaStream,
    f: &CudaFunction,
    name: &str,
    sig: &str,
    grid: (u32, u32, u32),
    block: u32,
    smem: usize,
    args: &[A],
) -> Result<(), String> {
    let kinds: String = args
        .iter()
        .map(|a| match a {
            A::P(_) => 'P',
            A::I(_) => 'I',
            A::F(_) => 'F',
            A::L(_) => 'L',
        })
        .collect();
    if kinds != sig {
        return Err(format!(
            "kernel {name} takes ({sig}), launched with ({kinds})"
        ));
    }
    let mut b = stream.launch_builder(f);
    for a in args {
        match a {
            A::P(v) => b.arg(v),
            A::I(v) => b.arg(v),
            A::F(v) => b.arg(v),
            A::L(v) => b.arg(v),
        };
    }
    let cfg = LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    // SAFETY: the arguments are the kernel's parameters in its order and types (checked
    // above against `sig`, which the caller vouches for); the addresses, sizes and shared
    // memory are the caller's contract (this function's `# Safety`).
    unsafe { b.launch(cfg) }.map_err(|e| format!("launch: {e}"))?;
    Ok(())
}

/// One product of `mv_*`'s job table (`MvJob` of kernels.cu, [`MvJob::BYTES`] bytes):
/// `y[n][rows] = W x[n][cols]`, W `rows` rows of `row_bytes` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MvJob {
    pub(crate) w: u64,
    pub(crate) x: u64,
    pub(crate) y: u64,
    pub(crate) row_bytes: i64,
    pub(crate) rows: i32,
    pub(crate) cols: i32,
    pub(crate) n: i32,
}

impl MvJob {
    /// Bytes of one entry (the CUDA struct's, its last int padding).
    pub(crate) const BYTES: usize = 48;

    /// Append the entry in the CUDA struct's layout.
    pub(crate) fn write(&self, table: &mut Vec<u8>) {
        table.extend_from_slice(&self.w.to_le_bytes());
        table.extend_from_slice(&self.x.to_le_bytes());
        table.extend_from_slice(&self.y.to_le_bytes());
        table.extend_from_slice(&self.row_bytes.to_le_bytes());
        table.extend_from_slice(&self.rows.to_le_bytes());
        table.extend_from_slice(&self.cols.to_le_bytes());
        table.extend_from_slice(&self.n.to_le_bytes());
        table.extend_from_slice(&0i32.to_le_bytes());
    }
}

/// One `mv_*` launch: `count` jobs of the table from entry `first` (grid y: the job), of
/// format `format`, at most `max_rows` rows and `max_groups` token groups each; `uploaded`:
/// their weights are copied by this call (launched after the copies).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MvLaunch {
    pub(crate) format: usize,
    pub(crate) first: usize,
    pub(crate) count: usize,
    pub(crate) max_rows: usize,
    pub(crate) max_groups: usize,
    pub(crate) uploaded: bool,
}

impl MvLaunch {
    /// Launch `mv_*` (`f`, this launch's format) over the table at device address `table`.
    ///
    /// # Safety
    ///
    /// The table's entries `first..first + count` are on the device, each naming a W, X and
    /// Y inside live buffers of its sizes whose bytes are there before this launch runs.
    pub(crate) unsafe fn launch(
        &self,
        stream: &CudaStream,
        f: &CudaFunction,
        table: u64,
    ) -> Result<(), String> {
        let jobs = table + (self.first * MvJob::BYTES) as u64;
        let grid = (
            self.max_rows.div_ceil(4) as u32,
            self.count as u32,
            self.max_groups as u32,
        );
        // SAFETY: mv_* takes one parameter, a pointer to `count` jobs (the caller's
        // contract above); blocks past a job's rows or tokens return.
        unsafe {
            launch(
                stream,
                f,
                "mv_",
                product_signature("mv_"),
                grid,
                128,
                0,
                &[A::P(jobs)],
            )
        }
    }
}

/// One `mm_*` launch (64 rows x 64 tokens a block of 256 threads): `y[n][rows] = W x[n][cols]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mm {
    pub(crate) w: u64,
    pub(crate) x: u64,
    pub(crate) y: u64,
    pub(crate) rows: i32,
    pub(crate) cols: i32,
    pub(crate) row_bytes: i64,
    pub(crate) n: i32,
}

impl Mm {
    /// Launch `mm_*` (`f`, the weights' format).
    ///
    /// # Safety
    ///
    /// W, X and Y are device addresses inside live buffers of `rows * row_bytes` bytes,
    /// `n * cols` and `n * rows` floats, W's and X's bytes there before this launch runs.
    pub(crate) unsafe fn launch(
        &self,
        stream: &CudaStream,
        f: &CudaFunction,
    ) -> Result<(), String> {
        let grid = (
            (self.rows as u32).div_ceil(64),
            (self.n as u32).div_ceil(64),
            1,
        );
        let args = [
            A::P(self.w),
            A::P(self.x),
            A::P(self.y),
            A::I(self.rows),
            A::I(self.cols),
            A::L(self.row_bytes),
            A::I(self.n),
        ];
        // SAFETY: the parameters in mm_*'s order (checked against its signature); the
        // buffers are the caller's contract above; the grid covers the rows and tokens the
        // kernel guards.
        unsafe {
            launch(
                stream,
                f,
                "mm_",
                product_signature("mm_"),
                grid,
                256,
                0,
                &args,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source() -> String {
        include_str!("kernels.cu").replace("\\\n", " ")
    }

    /// The parameter or field names of a C list (`const u8* W, int n` -> w, n).
    fn names(text: &str, sep: char) -> Vec<String> {
        text.split(sep)
            .filter(|p| !p.trim().is_empty())
            .map(|p| {
                p.split(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .rfind(|w| !w.is_empty())
                    .expect("a name")
                    .to_lowercase()
            })
            .collect()
    }

    /// `MvJob`'s fields are the CUDA struct's, in order, and `write` lays them out as the
    /// struct does (8-byte pointers and long long, then the ints and the padding).
    #[test]
    fn mv_job_matches_kernels_cu() {
        let s = source();
        let at = s.find("struct MvJob {").expect("struct MvJob") + "struct MvJob {".len();
        let body = &s[at..at + s[at..].find('}').expect("}")];
        assert_eq!(
            names(body, ';'),
            ["w", "x", "y", "row_bytes", "rows", "cols", "n", "pad"]
        );
        let j = MvJob {
            w: 0x0102_0304_0506_0708,
            x: 0x1112_1314_1516_1718,
            y: 0x2122_2324_2526_2728,
            row_bytes: 1152,
            rows: 768,
            cols: 2048,
            n: 5,
        };
        let mut b = Vec::new();
        j.write(&mut b);
        assert_eq!(b.len(), MvJob::BYTES);
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        let i32_at = |o: usize| i32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        assert_eq!((u64_at(0), u64_at(8), u64_at(16)), (j.w, j.x, j.y));
        assert_eq!(u64_at(24), 1152);
        assert_eq!(
            (i32_at(32), i32_at(36), i32_at(40), i32_at(44)),
            (768, 2048, 5, 0)
        );
        let mv = s.find("void mv_##name(").expect("mv_") + "void mv_##name(".len();
        assert_eq!(
            names(&s[mv..mv + s[mv..].find(')').unwrap()], ','),
            ["jobs"]
        );
        assert_eq!(product_signature("mv_q4_k"), "P");
        assert!(s.contains(&format!("#define MV_MAX_N {}", crate::MATVEC_MAX_N)));
    }

    /// `Mm`'s fields are `mm_*`'s parameters by name and order, their kinds its signature.
    #[test]
    fn mm_matches_kernels_cu() {
        let s = source();
        let at = s.find(" mm_##name(").expect("mm_") + " mm_##name(".len();
        let params = names(&s[at..at + s[at..].find(')').unwrap()], ',');
        assert_eq!(params, ["w", "x", "y", "rows", "cols", "row_bytes", "n"]);
        assert_eq!(product_signature("mm_q8_0"), "PPPIILI");
        assert_eq!(product_signature("mvg_q8_0"), "");
    }
}
