//! The CUDA backend without a GPU: opening it is a clean error (no panic, no abort), and the
//! kernel source compiles with NVRTC where NVRTC is installed (no GPU needed for that).

use sluice_cuda::{compile_kernels, Cuda, CudaError};

/// Whether this machine shows an NVIDIA device node (then a GPU may be usable).
fn has_nvidia_node() -> bool {
    std::path::Path::new("/dev/nvidia0").exists()
}

#[test]
fn opening_without_a_gpu_is_a_clean_error() {
    let weights = vec![0u8; 64];
    match Cuda::new(&weights) {
        Ok(c) => {
            assert!(
                has_nvidia_node(),
                "Cuda::new succeeded ({}) on a machine without /dev/nvidia0",
                c.device()
            );
            assert!(!c.device().is_empty());
        }
        Err(e) => {
            let msg = e.to_string();
            eprintln!("Cuda::new: {msg}");
            assert!(!msg.is_empty());
            assert!(
                matches!(
                    e,
                    CudaError::NoDriver | CudaError::NoNvrtc | CudaError::NoDevice(_)
                ) || has_nvidia_node(),
                "without a GPU the error must say there is no driver / NVRTC / device: {msg}"
            );
            // Twice: the first failure leaves nothing half-initialised behind.
            assert!(Cuda::new(&weights).is_err());
        }
    }
}

/// Needs libnvrtc (e.g. the `nvidia-cuda-nvrtc` wheel's lib directory on LD_LIBRARY_PATH,
/// or a CUDA toolkit), no GPU: `cargo test -p sluice-cuda --test no_gpu -- --ignored`.
#[test]
#[ignore = "needs NVRTC (CUDA toolkit or the nvidia-cuda-nvrtc wheel), not a GPU"]
fn kernels_compile_with_nvrtc() {
    for arch in ["compute_80", "compute_90"] {
        let ptx = compile_kernels(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        for f in ["f32", "f16", "bf16", "q8_0", "q5_0", "q4_k", "q6_k"] {
            for k in ["mv", "mm"] {
                let name = format!(".entry {k}_{f}(");
                assert!(ptx.contains(&name), "{arch}: PTX lacks {name}");
            }
        }
    }
}
