//! The crate's CUDA kernels: source (`kernels.cu`), their NVRTC build, and launch geometry.
//!
//! The source is compiled once per device on the first launch ([`CudaDevice::kernels`]), to
//! a CUBIN for the device's own architecture (`sm_XY`). Through CUDA's minor-version
//! compatibility a CUBIN loads on a driver of the same major version that is older than NVRTC,
//! where PTX would need a driver as new as NVRTC. The options `--fmad=false --ftz=false` make
//! the device round exactly as the CPU ops do. NVRTC is called through cudarc's `result` layer
//! rather than its safe wrapper, whose `Drop` unwraps the destroy call and could panic.

use std::collections::HashMap;
use std::ffi::CString;

use cudarc::driver::{CudaFunction, LaunchConfig};
use cudarc::nvrtc::Ptx;

use super::device::CudaDevice;
use super::error::{CudaError, CudaResult, Unavailable, driver, nvrtc};

/// The kernel source, kept in the crate.
pub(crate) const SOURCE: &str = include_str!("kernels.cu");

/// Every kernel the source defines (its `extern "C"` names).
pub const KERNEL_NAMES: &[&str] = &[
    "cast_f32_bf16",
    "cast_bf16_f32",
    "cast_f32_f16",
    "cast_f16_f32",
    "cast_bf16_f16",
    "cast_f16_bf16",
    "cast_f32_f64",
    "cast_f64_f32",
    "add_f32",
    "axpy_f32",
    "scale_f32",
    "add_bf16",
    "axpy_bf16",
    "scale_bf16",
    "add_f16",
    "axpy_f16",
    "scale_f16",
    "add_f64",
    "axpy_f64",
    "scale_f64",
    "relu_f32",
    "relu_grad_f32",
    "relu_bf16",
    "relu_grad_bf16",
    "relu_f16",
    "relu_grad_f16",
    "relu_f64",
    "relu_grad_f64",
    "layer_norm_f32",
    "layer_norm_backward_f32",
    "layer_norm_param_grad_f32",
    "gelu_f32",
    "gelu_grad_f32",
    "gelu_tanh_f32",
    "gelu_tanh_grad_f32",
    "silu_f32",
    "silu_grad_f32",
    "dropout_f32",
    "causal_softmax_f32",
    "causal_softmax_backward_f32",
    "cross_entropy_f32",
    "embedding_f32",
    "embedding_backward_f32",
    "position_backward_f32",
    "split_heads_f32",
    "merge_heads_f32",
    "adamw_f32",
    "sgd_f32",
    "flash_forward_f32",
    "flash_backward_delta_f32",
    "flash_backward_dq_f32",
    "flash_backward_dkv_f32",
];

/// Threads per block of every elementwise launch.
pub(crate) const BLOCK: u32 = 256;

/// The most blocks along x: the grid-stride loops cover any length with this many, and it
/// keeps the grid far below the hardware limit (2³¹ − 1).
pub(crate) const MAX_GRID_X: usize = 65_535;

/// The most blocks along y (the hardware limit).
pub(crate) const MAX_GRID_Y: usize = 65_535;

/// Threads per block of the row kernels (layer norm, softmax, cross-entropy): one block per
/// row, reducing in a shared-memory tree over this many slots. It must equal `ROW_THREADS` in
/// kernels.cu (a unit test checks) and be a power of two (the tree halves it).
pub(crate) const ROW_THREADS: u32 = 256;

/// The compiled module's functions, by name.
pub(crate) struct Kernels {
    functions: HashMap<&'static str, CudaFunction>,
}

/// Destroys an NVRTC program on every path out of [`compile`], ignoring (never panicking on)
/// a failed destroy.
struct Program(cudarc::nvrtc::sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by `create_program` and is destroyed only here, once.
        // Exercised by every kernel build (`tests/cuda.rs`, device tests).
        let _ = unsafe { cudarc::nvrtc::result::destroy_program(self.0) };
    }
}

/// What NVRTC produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelImage {
    /// PTX text for the virtual architecture `compute_XY`, which the driver compiles when it
    /// loads the module. It needs a driver at least as new as the NVRTC that made it.
    Ptx,
    /// A CUBIN (ELF machine code) for the real architecture `sm_XY`, which the driver loads as
    /// is. Through CUDA's minor-version compatibility it also loads on an older driver of the
    /// same major version, so it is what the device uses.
    Cubin,
}

/// The NVRTC options for compute capability `major.minor`.
pub(crate) fn compile_options(major: i32, minor: i32, image: KernelImage) -> Vec<String> {
    let arch = match image {
        KernelImage::Ptx => format!("--gpu-architecture=compute_{major}{minor}"),
        KernelImage::Cubin => format!("--gpu-architecture=sm_{major}{minor}"),
    };
    vec![
        arch,
        "--fmad=false".to_string(),
        "--ftz=false".to_string(),
        "--prec-div=true".to_string(),
        "--prec-sqrt=true".to_string(),
    ]
}

/// Compiles `source` to PTX text (NUL-free, without the terminating NUL) or to a CUBIN.
fn compile(
    op: &'static str,
    source: &str,
    options: Vec<String>,
    image: KernelImage,
) -> CudaResult<Vec<u8>> {
    let compile_error = |code: i32, log: String, options: &[String]| CudaError::Compile {
        op,
        code,
        options: options.to_vec(),
        log,
    };
    let source = CString::new(source)
        .map_err(|_| compile_error(-1, "the source holds a NUL byte".to_string(), &options))?;
    let name = c"hypershard_tensor_kernels.cu";
    let program = Program(
        cudarc::nvrtc::result::create_program(&source, Some(name))
            .map_err(nvrtc(op, "nvrtcCreateProgram"))?,
    );
    // SAFETY: `program.0` is a live program (destroyed only by `Program`'s drop, after this
    // function). Tested by `kernels_compile` in `tests/cuda.rs` (run here with pip's NVRTC).
    let compiled = unsafe { cudarc::nvrtc::result::compile_program(program.0, &options) };
    if let Err(error) = compiled {
        // SAFETY: as above; the log exists once compilation has been attempted.
        let log = unsafe { cudarc::nvrtc::result::get_program_log(program.0) }
            .map(|raw| c_chars_to_string(&raw))
            .unwrap_or_else(|_| "(no log)".to_string());
        return Err(compile_error(error.0 as i32, log, &options));
    }
    match image {
        KernelImage::Ptx => {
            // SAFETY: as above; the program compiled, so its PTX exists.
            let ptx = unsafe { cudarc::nvrtc::result::get_ptx(program.0) }
                .map_err(nvrtc(op, "nvrtcGetPTX"))?;
            let text = c_chars_to_string(&ptx);
            if text.contains('\0') {
                return Err(compile_error(
                    -1,
                    "NVRTC's PTX holds a NUL byte".to_string(),
                    &options,
                ));
            }
            Ok(text.into_bytes())
        }
        KernelImage::Cubin => {
            let mut size = 0usize;
            // SAFETY: as above; the program compiled for a real architecture, so its CUBIN
            // exists; `size` is a valid place for the size. Tested by `kernels_compile`.
            unsafe { cudarc::nvrtc::sys::nvrtcGetCUBINSize(program.0, &mut size) }
                .result()
                .map_err(nvrtc(op, "nvrtcGetCUBINSize"))?;
            let mut cubin = vec![0u8; size];
            // SAFETY: `cubin` has exactly the `size` bytes NVRTC reported for this program,
            // which is what nvrtcGetCUBIN writes. Tested by `kernels_compile`.
            unsafe { cudarc::nvrtc::sys::nvrtcGetCUBIN(program.0, cubin.as_mut_ptr().cast()) }
                .result()
                .map_err(nvrtc(op, "nvrtcGetCUBIN"))?;
            Ok(cubin)
        }
    }
}

/// Checks that NVRTC is present and compiles [`SOURCE`] for compute capability `major.minor`.
fn compile_for(
    op: &'static str,
    major: i32,
    minor: i32,
    image: KernelImage,
) -> CudaResult<Vec<u8>> {
    // SAFETY: `is_culib_present` only tries `dlopen` on NVRTC's names and drops the handles;
    // it touches no CUDA state. Tested by `tests/cuda.rs` (`kernels_compile`), with and without
    // libnvrtc.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::Unavailable {
            reason: Unavailable::LibraryNotFound {
                library: "libnvrtc",
                tried: cudarc::get_lib_name_candidates("nvrtc"),
            },
        });
    }
    compile(op, SOURCE, compile_options(major, minor, image), image)
}

/// Compiles the crate's kernels with NVRTC for compute capability `major.minor`, as the first
/// launch on a device does ([`KernelImage::Cubin`]), and returns the image: PTX text or CUBIN
/// bytes.
///
/// It needs libnvrtc but no GPU or driver, so a machine with only NVRTC installed (pip's
/// `nvidia-cuda-nvrtc-cu12`) can check that the source compiles; without libnvrtc it is
/// [`CudaError::Unavailable`].
pub fn compile_kernels(major: i32, minor: i32, image: KernelImage) -> CudaResult<Vec<u8>> {
    compile_for("cuda::compile_kernels", major, minor, image)
}

/// A NUL-terminated C string (as NVRTC returns logs and PTX) as text, without the NULs at the
/// end.
pub(crate) fn c_chars_to_string(raw: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = raw.iter().map(|&c| c as u8).collect();
    let end = bytes.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

impl Kernels {
    /// Compiles [`SOURCE`] for `device` (see [`compile_kernels`]) and loads every kernel.
    pub(crate) fn build(op: &'static str, device: &CudaDevice) -> CudaResult<Kernels> {
        let (major, minor) = device.compute_capability()?;
        let cubin = compile_for(op, major, minor, KernelImage::Cubin)?;
        let module = device
            .context()
            .load_module(Ptx::from_binary(cubin))
            .map_err(driver(op, "cuModuleLoadData"))?;
        let mut functions = HashMap::with_capacity(KERNEL_NAMES.len());
        for &name in KERNEL_NAMES {
            let function = module
                .load_function(name)
                .map_err(driver(op, "cuModuleGetFunction"))?;
            functions.insert(name, function);
        }
        Ok(Kernels { functions })
    }

    /// The kernel `name` (one of [`KERNEL_NAMES`]).
    pub(crate) fn function(
        &self,
        op: &'static str,
        name: &'static str,
    ) -> CudaResult<&CudaFunction> {
        // Every name the crate asks for is in KERNEL_NAMES (a unit test checks the source
        // defines them all); a miss would be a bug here, reported rather than panicked on.
        self.functions.get(name).ok_or(CudaError::Call {
            op,
            library: super::error::Library::Driver,
            call: "cuModuleGetFunction",
            code: 500, // CUDA_ERROR_NOT_FOUND
        })
    }
}

/// The grid of an elementwise launch over `n` elements with `rows` block rows; `None` when there is nothing to do (a zero-size grid is
/// an invalid launch).
pub(crate) fn launch_config(
    op: &'static str,
    n: usize,
    rows: usize,
) -> CudaResult<Option<LaunchConfig>> {
    if rows > MAX_GRID_Y {
        return Err(CudaError::TooLarge {
            op,
            what: "grid rows",
            value: rows,
            max: MAX_GRID_Y,
        });
    }
    if n == 0 || rows == 0 {
        return Ok(None);
    }
    let blocks = n.div_ceil(BLOCK as usize).min(MAX_GRID_X);
    // Both fit in u32: MAX_GRID_X and MAX_GRID_Y are below 2¹⁶.
    Ok(Some(LaunchConfig {
        grid_dim: (blocks as u32, rows as u32, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }))
}

/// The grid of a row kernel over `rows` rows: one block of [`ROW_THREADS`] threads per row, at
/// most [`MAX_GRID_X`] blocks (the kernels loop over rows with a stride of the grid); `None`
/// when there are no rows.
pub(crate) fn row_launch_config(rows: usize) -> Option<LaunchConfig> {
    if rows == 0 {
        return None;
    }
    // Fits in u32: at most MAX_GRID_X, below 2¹⁶.
    let blocks = rows.min(MAX_GRID_X) as u32;
    Some(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (ROW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_source_defines_every_kernel_name() {
        // The names come from macros, so look for the macro invocation or the literal name.
        for &name in KERNEL_NAMES {
            let defined = SOURCE.contains(&format!("void {name}("))
                || match name.split_once('_') {
                    Some(("cast", pair)) => {
                        let (from, to) = pair.split_once('_').unwrap();
                        SOURCE.contains(&format!("CAST({from}, "))
                            && SOURCE.contains(&format!(", {to}, "))
                    }
                    Some(("add" | "axpy" | "scale", ty)) => {
                        SOURCE.contains(&format!("ARITH({ty}, "))
                    }
                    Some(("relu", ty)) => {
                        let ty = ty.strip_prefix("grad_").unwrap_or(ty);
                        SOURCE.contains(&format!("RELU({ty}, "))
                    }
                    _ => false,
                };
            assert!(defined, "{name} is not defined in kernels.cu");
        }
        // Nothing in the source may need a header NVRTC does not ship by default.
        assert!(!SOURCE.contains("#include"));
        assert!(!SOURCE.contains('\0'));
    }

    #[test]
    fn row_kernels_use_the_sources_block_size() {
        assert!(SOURCE.contains(&format!("#define ROW_THREADS {ROW_THREADS}\n")));
        assert!(ROW_THREADS.is_power_of_two());
        // The reductions index `shared[tid + s]` for s < ROW_THREADS / 2: inside the array.
        assert!(SOURCE.contains("__shared__ float shared[ROW_THREADS];"));
        assert!(row_launch_config(0).is_none());
        let one = row_launch_config(1).unwrap();
        assert_eq!(
            (one.grid_dim, one.block_dim),
            ((1, 1, 1), (ROW_THREADS, 1, 1))
        );
        assert_eq!(row_launch_config(4097).unwrap().grid_dim.0, 4097);
        // Past the cap the kernels' loop over rows takes the rest.
        assert_eq!(
            row_launch_config(MAX_GRID_X + 5).unwrap().grid_dim.0 as usize,
            MAX_GRID_X
        );
        // Every row kernel loops over rows by the grid, so the capped grid covers them all.
        for name in [
            "layer_norm_f32",
            "layer_norm_backward_f32",
            "causal_softmax_f32",
            "causal_softmax_backward_f32",
            "cross_entropy_f32",
        ] {
            let start = SOURCE.find(&format!("void {name}(")).unwrap();
            let body = &SOURCE[start..];
            let end = body.find("\n}\n").unwrap();
            assert!(
                body[..end].contains("for (u64 row = blockIdx.x; row < rows; row += gridDim.x)"),
                "{name} does not loop over rows by the grid"
            );
        }
    }

    #[test]
    fn launch_geometry_covers_every_length() {
        assert!(launch_config("t", 0, 1).unwrap().is_none());
        assert!(launch_config("t", 5, 0).unwrap().is_none());
        let one = launch_config("t", 1, 1).unwrap().unwrap();
        assert_eq!(one.grid_dim, (1, 1, 1));
        assert_eq!(one.block_dim, (BLOCK, 1, 1));
        let exact = launch_config("t", 2 * BLOCK as usize, 3).unwrap().unwrap();
        assert_eq!(exact.grid_dim, (2, 3, 1));
        let ragged = launch_config("t", 2 * BLOCK as usize + 1, 1)
            .unwrap()
            .unwrap();
        assert_eq!(ragged.grid_dim.0, 3);
        // Past the cap the grid-stride loop takes over: the grid stays at the cap.
        let huge = launch_config("t", usize::MAX, 1).unwrap().unwrap();
        assert_eq!(huge.grid_dim.0 as usize, MAX_GRID_X);
        for n in [
            1usize,
            255,
            256,
            257,
            1 << 20,
            (MAX_GRID_X * BLOCK as usize) + 1,
        ] {
            let cfg = launch_config("t", n, 1).unwrap().unwrap();
            let threads = cfg.grid_dim.0 as usize * BLOCK as usize;
            // Either one thread per element, or the capped grid (grid-stride covers the rest).
            assert!(threads >= n || cfg.grid_dim.0 as usize == MAX_GRID_X);
            assert!(threads < n + BLOCK as usize || cfg.grid_dim.0 as usize == MAX_GRID_X);
        }
        assert!(matches!(
            launch_config("t", 10, MAX_GRID_Y + 1),
            Err(CudaError::TooLarge {
                what: "grid rows",
                ..
            })
        ));
    }

    #[test]
    fn options_and_c_strings() {
        let options = compile_options(9, 0, KernelImage::Ptx);
        assert_eq!(options[0], "--gpu-architecture=compute_90");
        let options = compile_options(8, 6, KernelImage::Cubin);
        assert_eq!(options[0], "--gpu-architecture=sm_86");
        assert!(options.contains(&"--fmad=false".to_string()));
        let raw: Vec<std::ffi::c_char> = b"ptx text\0\0"
            .iter()
            .map(|&b| b as std::ffi::c_char)
            .collect();
        assert_eq!(c_chars_to_string(&raw), "ptx text");
        assert_eq!(c_chars_to_string(&[]), "");
    }
}
