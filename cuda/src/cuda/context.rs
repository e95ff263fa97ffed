//! Opening a GPU: the CUDA libraries loaded at run time, the context, stream, cuBLAS handles
//! and kernels a [`CudaBackend`] holds, and what tests use to find a GPU or skip.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nvrtc::Ptx;

use super::compile::{self, compile_cubin};
use super::error::cuda_err;
use super::kernels::{
    flash_smem_bytes, flash_wgmma_smem_bytes, kernel_source, paged_flash_wgmma_smem_bytes,
    COUNTERS, DEFAULT_SMEM, FLASH_DIMS, FLASH_KERNELS, FLASH_QUERIES, FLASH_WGMMA_KERNELS,
    FLASH_WIDE_DIMS, FLASH_WIDE_KERNELS, FLASH_WIDE_QUERIES, GEMV_MAX_ROWS, PAGED_FLASH_F8_KERNELS,
    PAGED_FLASH_KERNELS, PAGED_FLASH_WGMMA_KERNEL, SOURCES,
};
use super::kernels::{
    Arch, Gemv, KernelSource, GEMV_STATIC_SMEM, INT_GEMM_KERNELS, INT_GEMM_WGMMA_KERNELS,
};
use super::kernels::{
    DECODE_F8_KERNELS, DECODE_KERNELS, DECODE_MMA_F8_KERNELS, DECODE_MMA_KERNELS, DECODE_WARPS,
};
use super::tensor::IntFormat;
use super::{lt, staging};
use crate::{Error, Result};

/// The cuBLAS workspace, set once so that GEMMs recorded into a CUDA graph never allocate.
const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;

pub(super) struct Inner {
    /// Holds the context (and with it the device) alive.
    pub(super) stream: Arc<CudaStream>,
    pub(super) blas: CudaBlas,
    pub(super) kernels: HashMap<&'static str, CudaFunction>,
    device_name: String,
    compute_capability: (i32, i32),
    /// Whether the flash-attention kernels could be given their shared memory.
    pub(super) flash: bool,
    /// Whether the wgmma flash kernel (sm_90) is loaded and could be given its shared memory.
    pub(super) wgmma_flash: bool,
    /// Whether the prefill chunks' wgmma kernel is loaded (sm_90) with its shared memory.
    pub(super) paged_wgmma_flash: bool,
    /// Whether the integer GEMM runs on wgmma: its kernels are loaded (sm_90) with the same
    /// shared memory as the mma.sync ones, and `VLM_INT_GEMM` is not `mma`.
    pub(super) int_gemm_wgmma: bool,
    /// Multiprocessors: how many blocks it takes to fill the GPU.
    pub(super) sm_count: usize,
    /// cuBLAS's workspace (set on the handle), kept alive with it; cuBLASLt's GEMMs use it
    /// too (`workspace`: its address and size), as everything runs on the one stream.
    _blas_workspace: CudaSlice<u8>,
    pub(super) workspace: (cudarc::driver::sys::CUdeviceptr, usize),
    /// cuBLASLt, for the GEMMs with epilogues (bias, GELU, f16 output).
    pub(super) lt: lt::Lt,
    /// Per-op timing ([`Backend::time_ops`](crate::Backend::time_ops)): an event recorded
    /// after each op, named.
    pub(super) op_events: std::sync::Mutex<Option<Vec<(&'static str, cudarc::driver::CudaEvent)>>>,
    /// Page-locked memory for large uploads and downloads.
    pub(super) staging: staging::Staging,
    /// Shared memory a normed GEMV may stage its input rows in (bytes).
    pub(super) gemv_smem: usize,
    /// One counter per (sequence, KV head) of a decode attention launch: how many of its
    /// splits have finished (the last merges them). Each launch leaves them at 0 again, and
    /// launches on this backend's one stream run one after another.
    pub(super) counters: CudaSlice<u32>,
    /// Blocks of each decode attention kernel an SM holds at once (the driver's occupancy,
    /// from its registers and shared memory): how many splits fill the GPU.
    pub(super) decode_blocks_per_sm: HashMap<&'static str, usize>,
    /// Whether decode's kernels go out under programmatic dependent launch (the streamed
    /// GEMVs of weights_f16.cu, the q/k step, decode attention; [`programmatic_capable`],
    /// unless `VLM_PDL=0`), and the two counters the streamed GEMVs hand rows out with (each
    /// launch leaves them at 0 again).
    pub(super) programmatic: std::sync::atomic::AtomicBool,
    pub(super) gemv_ticket: CudaSlice<u32>,
    /// While a step is recorded, the memory its buffers come from (recording.rs), and the
    /// stream that allocates them there.
    pub(super) recording: std::sync::Mutex<Option<Arc<super::pool::RecordingPool>>>,
    pub(super) side_stream: Arc<cudarc::driver::CudaStream>,
    /// Where an integer weight is dequantized to f16 for a GEMM (int_weights.rs): as large as
    /// the largest integer weight uploaded.
    pub(super) dequant_scratch: std::sync::Mutex<Option<CudaSlice<half::f16>>>,
    /// One lock per m-block of the integer GEMM (int_weights.rs, `launch_int_gemm`):
    /// how many of its k splits have written their partial sums. Each launch leaves them at 0
    /// again.
    pub(super) int_gemm_locks: CudaSlice<i32>,
    /// The integer GEMM's partial sums of split k: one tile (64 rows x 256 columns, f32) per
    /// block of a launch, at most one block an SM.
    pub(super) int_gemm_partials: CudaSlice<f32>,
    /// Which FP8 GEMMs quantize their activations (w8a8.rs, an `Fp8Gemm` as u8).
    pub(super) fp8_gemm: std::sync::atomic::AtomicU8,
}

/// An NVIDIA GPU; cheap to clone (all clones share the context, stream and kernels).
#[derive(Clone)]
pub struct CudaBackend {
    pub(super) inner: Arc<Inner>,
}

/// Whether a GPU of capability `cc` and this driver have programmatic dependent launch: sm_90
/// and later, and a CUDA 12.3 driver or later (the first to capture it into graphs).
fn programmatic_capable(cc: (i32, i32)) -> bool {
    let mut driver = 0;
    // SAFETY: writes one int; the driver library is loaded (a context exists).
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) };
    cc.0 >= 9 && driver >= 12_030
}

pub(super) fn nvrtc_version() -> (i32, i32) {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: nvrtcVersion writes two ints through the pointers; the library is loaded (checked
    // by the caller with is_culib_present).
    unsafe {
        cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor);
    }
    (major, minor)
}

/// A CUDA library the backend loads at run time: whether it could be, and what to do if not.
pub struct CudaLibrary {
    pub name: &'static str,
    pub present: bool,
    pub hint: &'static str,
}

/// The driver, NVRTC, cuBLAS and cuBLASLt, each tried with dlopen only: what
/// [`CudaBackend::new`] needs before it touches a GPU, and the first lines of `vlm doctor`.
pub fn cuda_libraries() -> [CudaLibrary; 4] {
    let toolkit = "install the CUDA toolkit's libraries (or the nvidia-*-cu12 wheels) and put them on LD_LIBRARY_PATH";
    // SAFETY: these only try to dlopen the libraries.
    unsafe {
        [
            CudaLibrary {
                name: "NVIDIA driver (libcuda)",
                present: cudarc::driver::sys::is_culib_present(),
                hint: "is there an NVIDIA GPU and driver here (and, in a container, the NVIDIA runtime)?",
            },
            CudaLibrary {
                name: "NVRTC (libnvrtc)",
                present: cudarc::nvrtc::sys::is_culib_present(),
                hint: toolkit,
            },
            CudaLibrary {
                name: "cuBLAS (libcublas)",
                present: cudarc::cublas::sys::is_culib_present(),
                hint: toolkit,
            },
            CudaLibrary {
                name: "cuBLASLt (libcublasLt)",
                present: cudarc::cublaslt::sys::is_culib_present(),
                hint: toolkit,
            },
        ]
    }
}

/// Tests that need a GPU (or NVRTC) skip where there is none, saying so on stderr (past the
/// harness's capture, so CI logs show it). With `VLM_REQUIRE_GPU=1`, as GPU runs set it, a skip
/// is a failure instead: a missing driver or library cannot pass as "no GPU here".
pub fn skip_test(why: &dyn std::fmt::Display) {
    if std::env::var("VLM_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        panic!("VLM_REQUIRE_GPU=1 but this test cannot run: {why}");
    }
    crate::skip::note(why);
}

/// The GPU a test runs on, or `None` after [`skip_test`] when none can be opened.
pub fn test_gpu() -> Option<CudaBackend> {
    CudaBackend::new(0)
        .map_err(|e| skip_test(&format!("no GPU: {e}")))
        .ok()
}

/// Whether the self-check is skipped: with `VLM_UNCHECKED=1` and kernels read from disk
/// (`VLM_KERNEL_DIR`), never for the built-in ones. Timing what a kernel costs a step means
/// timing the step with it made empty, which the check would refuse.
fn self_check_skipped(kernel_dir: Option<&std::ffi::OsStr>, unchecked: Option<&str>) -> bool {
    kernel_dir.is_some_and(|d| !d.is_empty()) && unchecked == Some("1")
}

/// Whether NVRTC can be loaded (it needs no GPU: kernels can be compiled anywhere it is).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

impl CudaBackend {
    /// Opens GPU `ordinal` for serving: [`CudaBackend::new`], then the self-check
    /// ([`crate::twin::self_check`]) that runs every kernel against the CPU reference on this
    /// GPU, with this driver, and refuses the device if any disagrees. About a second; what
    /// `--device cuda` does everywhere. Once per GPU per process (`vlm serve` opens it twice).
    pub fn open_verified(ordinal: usize) -> Result<Self> {
        static VERIFIED: std::sync::Mutex<Vec<usize>> = std::sync::Mutex::new(Vec::new());
        // Held through the check: a second opener waits for the first's verdict.
        let mut verified = VERIFIED.lock().unwrap_or_else(|e| e.into_inner());
        let gpu = Self::new(ordinal)?;
        if verified.contains(&ordinal) {
            return Ok(gpu);
        }
        if self_check_skipped(
            std::env::var_os("VLM_KERNEL_DIR").as_deref(),
            std::env::var("VLM_UNCHECKED").ok().as_deref(),
        ) {
            tracing::warn!(
                device = %gpu.device_name(),
                "VLM_UNCHECKED=1 with VLM_KERNEL_DIR: the self-check is skipped; results may be wrong"
            );
            verified.push(ordinal);
            return Ok(gpu);
        }
        self_check_with_progress(&gpu)?;
        verified.push(ordinal);
        Ok(gpu)
    }

    /// Opens GPU `ordinal`, compiling (or loading from the disk cache) every kernel. Unchecked:
    /// tests compare it with the CPU themselves; serving goes through
    /// [`CudaBackend::open_verified`].
    pub fn new(ordinal: usize) -> Result<Self> {
        require_libraries()?;
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda_err("opening the GPU")(&e))?;
        staging::keep_freed_host_memory();
        let device_name = ctx.name().map_err(|e| cuda_err("device name")(&e))?;
        let cc = ctx
            .compute_capability()
            .map_err(|e| cuda_err("compute capability")(&e))?;
        keep_freed_device_memory(&ctx);
        let (stream, side_stream) = streams(&ctx)?;
        let kernels = load_kernels(&ctx, cc, &device_name)?;
        let flash = opt_in_flash(&kernels);
        // The same for Hopper's wgmma flash kernel, where it was compiled (sm_90).
        let wgmma_flash = flash
            && opt_in_smem(
                &kernels,
                &FLASH_WGMMA_KERNELS,
                flash_wgmma_smem_bytes(),
                "wgmma flash attention unavailable; using the mma.sync kernels",
            );
        let paged_wgmma_flash = wgmma_flash
            && opt_in_smem(
                &kernels,
                &[PAGED_FLASH_WGMMA_KERNEL],
                paged_flash_wgmma_smem_bytes(),
                "wgmma prefill attention unavailable; using mma.sync",
            );
        let gemv_smem = opt_in_gemv(&ctx, &kernels)?;
        // The integer GEMM on wgmma takes the shared memory the mma.sync one has.
        let int_gemm_wgmma = super::int_weights::wgmma_gemm_allowed()
            && opt_in_smem(
                &kernels,
                &INT_GEMM_WGMMA_KERNELS,
                gemv_smem,
                "the integer GEMM on wgmma unavailable; using mma.sync",
            );
        let (blas, workspace, workspace_ptr) = cublas(&stream)?;
        let lt = lt::Lt::new()?;
        let counters = stream
            .alloc_zeros::<u32>(COUNTERS)
            .map_err(|e| cuda_err("allocating completion counters")(&e))?;
        let decode_blocks_per_sm = decode_occupancy(&kernels)?;
        use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT as SMS;
        let sm_count = ctx.attribute(SMS).map_err(|e| cuda_err("SM count")(&e))? as usize;
        let gemv_ticket = stream
            .alloc_zeros::<u32>(2)
            .map_err(|e| cuda_err("allocating the GEMV ticket")(&e))?;
        let int_gemm_locks = stream
            .alloc_zeros::<i32>(super::int_weights::INT_GEMM_LOCKS)
            .map_err(|e| cuda_err("allocating the integer GEMM's locks")(&e))?;
        let int_gemm_partials = stream
            .alloc_zeros::<f32>(sm_count * super::int_weights::INT_GEMM_PARTIAL_TILE)
            .map_err(|e| cuda_err("allocating the integer GEMM's partial sums")(&e))?;
        // `VLM_PDL=0` turns programmatic dependent launch off (to compare).
        let programmatic =
            programmatic_capable(cc) && std::env::var("VLM_PDL").map_or(true, |v| v != "0");
        Ok(Self {
            inner: Arc::new(Inner {
                stream,
                blas,
                kernels,
                device_name,
                compute_capability: cc,
                flash,
                wgmma_flash,
                paged_wgmma_flash,
                int_gemm_wgmma,
                sm_count,
                _blas_workspace: workspace,
                workspace: (workspace_ptr, CUBLAS_WORKSPACE_BYTES),
                lt,
                op_events: std::sync::Mutex::new(None),
                staging: staging::Staging::new(),
                gemv_smem,
                counters,
                decode_blocks_per_sm,
                programmatic: programmatic.into(),
                gemv_ticket,
                recording: std::sync::Mutex::new(None),
                side_stream,
                dequant_scratch: std::sync::Mutex::new(None),
                int_gemm_locks,
                int_gemm_partials,
                fp8_gemm: (super::w8a8::Fp8Gemm::from_env() as u8).into(),
            }),
        })
    }

    pub fn device_name(&self) -> &str {
        &self.inner.device_name
    }

    /// The CUDA version the driver supports, e.g. "13.0".
    pub fn driver_version(&self) -> String {
        let mut v = 0;
        // SAFETY: writes one int; the driver library is loaded (this backend exists).
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
        format!("{}.{}", v / 1000, (v % 1000) / 10)
    }

    pub fn compute_capability(&self) -> (i32, i32) {
        self.inner.compute_capability
    }

    /// Whether decode's kernels, those that wait for the one before them (common.cuh's
    /// grid_wait), run under programmatic dependent launch (sm_90 and a CUDA 12.3+ driver,
    /// unless `VLM_PDL=0`).
    pub fn programmatic_launch(&self) -> bool {
        self.inner
            .programmatic
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Turns programmatic dependent launch off, or on again where the GPU has it (sm_90 and
    /// later); returns whether it is on. For tests that check both paths on one GPU; a step
    /// already recorded keeps the launches it was recorded with.
    pub fn set_programmatic_launch(&self, on: bool) -> bool {
        let on = on && programmatic_capable(self.inner.compute_capability);
        self.inner
            .programmatic
            .store(on, std::sync::atomic::Ordering::Relaxed);
        on
    }

    /// Waits for all queued work (for timing and tests).
    pub fn synchronize(&self) -> Result<()> {
        self.inner
            .stream
            .synchronize()
            .map_err(|e| cuda_err("synchronize")(&e))
    }
}

// The steps of opening a GPU ([`CudaBackend::new`], then [`CudaBackend::open_verified`]'s
// self-check), in the order they run.

/// Every library of [`cuda_libraries`] loads, or an error naming the first that does not and
/// what to do about it.
fn require_libraries() -> Result<()> {
    if let Some(lib) = cuda_libraries().into_iter().find(|l| !l.present) {
        return Err(Error::Cuda {
            what: format!("{} could not be loaded: {}", lib.name, lib.hint),
        });
    }
    Ok(())
}

/// The device's default memory pool, where every op's output is allocated.
fn device_pool(
    ctx: &CudaContext,
) -> std::result::Result<cudarc::driver::sys::CUmemoryPool, cudarc::driver::DriverError> {
    let mut pool = std::ptr::null_mut();
    // SAFETY: the device handle is the live context's.
    unsafe { cudarc::driver::sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()).result()? };
    Ok(pool)
}

/// Keeps memory freed into the device's pool there (the default gives it back at every
/// synchronization, and each step's op outputs would then be mapped afresh: tens of
/// microseconds per allocation, more than many of the kernels take).
fn keep_freed_device_memory(ctx: &CudaContext) {
    use cudarc::driver::sys;
    let mut keep = u64::MAX;
    if let Ok(pool) = device_pool(ctx) {
        // SAFETY: the pool handle is the device's default, the attribute a u64.
        unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut keep) as *mut u64 as *mut std::ffi::c_void,
            );
        }
    }
}

/// Trims the device's default pool (where every op's output is allocated; see
/// [`keep_freed_device_memory`]) to `keep` bytes of cached memory beyond what its live
/// buffers hold, and returns the bytes it gave back.
pub(super) fn trim_device_pool(stream: &Arc<CudaStream>, keep: usize) -> Result<usize> {
    use cudarc::driver::sys;
    let err = |what| move |e: cudarc::driver::DriverError| cuda_err(what)(&e);
    let attribute = |pool, which| -> Result<u64> {
        let mut bytes = 0u64;
        // SAFETY: the pool is the device's default; both attributes read are u64s.
        unsafe {
            sys::cuMemPoolGetAttribute(pool, which, (&mut bytes) as *mut u64 as *mut _)
                .result()
                .map_err(err("reading the device pool's size"))?;
        }
        Ok(bytes)
    };
    use sys::CUmemPool_attribute::{
        CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT as RESERVED, CU_MEMPOOL_ATTR_USED_MEM_CURRENT as USED,
    };
    // SAFETY: the stream's context is bound to this thread first; the pool handle is the
    // device's default, which lives as long as the context.
    unsafe {
        stream
            .context()
            .bind_to_thread()
            .map_err(err("binding the context"))?;
        let pool = device_pool(stream.context()).map_err(err("finding the device pool"))?;
        // The pool's reserve counts the buffers alive (the weights among them) as well.
        let before = attribute(pool, RESERVED)?;
        let in_use = attribute(pool, USED)?;
        sys::cuMemPoolTrimTo(pool, (in_use as usize).saturating_add(keep))
            .result()
            .map_err(err("trimming the device pool"))?;
        Ok(before.saturating_sub(attribute(pool, RESERVED)?) as usize)
    }
}

/// The backend's stream and its side stream (which allocates a recorded step's buffers).
/// Our own stream, not the legacy default one, which cannot be captured into a graph.
/// Every op of this backend runs on it, so cudarc's cross-stream event tracking (which
/// records events around each use, also while capturing) has nothing to guard: it is
/// turned off first.
fn streams(ctx: &Arc<CudaContext>) -> Result<(Arc<CudaStream>, Arc<CudaStream>)> {
    // SAFETY: one stream per backend; buffers never cross to another backend's stream.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx
        .new_stream()
        .map_err(|e| cuda_err("creating a stream")(&e))?;
    let side_stream = ctx
        .new_stream()
        .map_err(|e| cuda_err("creating a stream")(&e))?;
    Ok((stream, side_stream))
}

/// Every kernel for a GPU of capability `cc`, by name: each source compiled by NVRTC (or
/// read from the disk cache) and loaded.
fn load_kernels(
    ctx: &Arc<CudaContext>,
    cc: (i32, i32),
    device_name: &str,
) -> Result<HashMap<&'static str, CudaFunction>> {
    let nv = nvrtc_version();
    let mut kernels = HashMap::new();
    for src in SOURCES.iter().filter(|s| s.for_cc(cc)) {
        let hopper = src.arch_specific(cc);
        match load_source(ctx, src, cc, hopper, nv, device_name, &mut kernels) {
            Ok(()) => {}
            // Hopper's own kernels are an extra: an NVRTC or driver too old for
            // compute_90a leaves the GPU on the kernels every GPU has (a file that has both
            // compiled for sm_90 as is).
            Err(e) if hopper => {
                tracing::warn!(file = src.file, error = %e, "Hopper-only kernels unavailable; using the portable ones");
                if src.arch == Arch::EveryHopperToo {
                    load_source(ctx, src, cc, false, nv, device_name, &mut kernels)?;
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(kernels)
}

/// Compiles `src` for `cc` (for sm_90a with its Hopper kernels where `hopper`) with NVRTC
/// `nv` (or reads it from the disk cache), loads the module and adds its kernels to `kernels`.
fn load_source(
    ctx: &Arc<CudaContext>,
    src: &KernelSource,
    cc: (i32, i32),
    hopper: bool,
    nv: (i32, i32),
    device_name: &str,
    kernels: &mut HashMap<&'static str, CudaFunction>,
) -> Result<()> {
    let stem = src.file.trim_end_matches(".cu");
    // The two forms of a file are cached apart (one source, two CUBINs).
    let stem = if hopper {
        format!("{stem}-sm90a")
    } else {
        stem.to_string()
    };
    let source = kernel_source(src)?;
    let path = compile::cache_path(&compile::cache_dir(), &stem, &source, cc, nv);
    let (cubin, cached) = compile::cached_or_compile(&path, || {
        // NVRTC takes seconds to a minute a file; show that something is happening (hidden off
        // a terminal).
        let spinner = indicatif::ProgressBar::new_spinner().with_message(format!(
            "compiling {} for sm_{}{} (cached afterwards)",
            src.file, cc.0, cc.1
        ));
        spinner.enable_steady_tick(std::time::Duration::from_millis(120));
        let cubin = compile_cubin(src.file, &source, cc, hopper);
        spinner.finish_and_clear();
        cubin
    })?;
    tracing::info!(device = %device_name, sm = format!("{}.{}", cc.0, cc.1), file = src.file, cached, cache = %path.display(), "CUDA kernels ready");
    // A cached file the driver refuses is named, so that it can be deleted (and compiled again).
    let what = if cached {
        format!(
            "loading {} from the kernel cache {}",
            src.file,
            path.display()
        )
    } else {
        format!("loading {}", src.file)
    };
    let module = ctx
        .load_module(Ptx::from_binary(cubin))
        .map_err(|e| cuda_err(&what)(&e))?;
    for k in src.all_kernels(hopper) {
        let f = module.load_function(k).map_err(|e| Error::KernelCompile {
            kernel: k.into(),
            log: e.to_string(),
        })?;
        kernels.insert(k, f);
    }
    Ok(())
}

/// Opts the flash kernels into the shared memory they need, more than the default 48 KB;
/// whether the GPU agreed for every one. A GPU that refuses falls back to the plain
/// attention kernel.
fn opt_in_flash(kernels: &HashMap<&'static str, CudaFunction>) -> bool {
    FLASH_KERNELS
        .iter()
        .chain(&PAGED_FLASH_KERNELS)
        .chain(&PAGED_FLASH_F8_KERNELS)
        .zip(FLASH_DIMS.iter().chain(&FLASH_DIMS).chain(&FLASH_DIMS))
        .map(|(k, &dp)| (k, flash_smem_bytes(dp, FLASH_QUERIES)))
        .chain(
            FLASH_WIDE_KERNELS
                .iter()
                .zip(FLASH_WIDE_DIMS)
                .map(|(k, dp)| (k, flash_smem_bytes(dp, FLASH_WIDE_QUERIES))),
        )
        .all(|(k, bytes)| {
            smem_opted_in(
                &kernels[k],
                k,
                bytes,
                "flash attention unavailable; using the plain kernel",
            )
        })
}

/// Whether every kernel of `names` is loaded (the Hopper-only ones are on sm_90 alone) and the
/// GPU gave it `bytes` of dynamic shared memory; `fallback` says, in the warning, what runs
/// instead where it refused.
fn opt_in_smem(
    kernels: &HashMap<&'static str, CudaFunction>,
    names: &[&'static str],
    bytes: usize,
    fallback: &str,
) -> bool {
    names.iter().all(|&name| {
        kernels
            .get(name)
            .is_some_and(|k| smem_opted_in(k, name, bytes, fallback))
    })
}

/// Whether the GPU gave kernel `k` (`name`) `bytes` of dynamic shared memory; a refusal is
/// logged with `fallback`, what runs instead.
fn smem_opted_in(k: &CudaFunction, name: &str, bytes: usize, fallback: &str) -> bool {
    use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_SMEM;
    let set = k.set_attribute(MAX_SMEM, bytes as i32);
    if let Err(e) = &set {
        tracing::warn!(kernel = name, error = %e, "{fallback}");
    }
    set.is_ok()
}

/// Blocks an SM holds of each decode attention kernel (of DECODE_WARPS warps, static shared
/// memory only).
fn decode_occupancy(
    kernels: &HashMap<&'static str, CudaFunction>,
) -> Result<HashMap<&'static str, usize>> {
    DECODE_KERNELS
        .iter()
        .chain(&DECODE_F8_KERNELS)
        .chain(&DECODE_MMA_KERNELS)
        .chain(&DECODE_MMA_F8_KERNELS)
        .filter_map(|&name| Some((name, kernels.get(name)?)))
        .map(|(name, f)| {
            let blocks = f
                .occupancy_max_active_blocks_per_multiprocessor(DECODE_WARPS * 32, 0, None)
                .map_err(|e| cuda_err("decode attention's occupancy")(&e))?;
            Ok((name, blocks.max(1) as usize))
        })
        .collect()
}

/// The normed GEMVs (f16 and integer), and every streamed one, stage their input rows in shared memory: lets
/// them have what the GPU gives one block (4 rows of 4,096 floats need 64 KB, past the
/// default 48), less what they declare statically. Returns the bytes they may use: that, or
/// the default's share where the GPU refused.
fn opt_in_gemv(ctx: &CudaContext, kernels: &HashMap<&'static str, CudaFunction>) -> Result<usize> {
    use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN as OPTIN;
    use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_SMEM;
    let optin = ctx
        .attribute(OPTIN)
        .map_err(|e| cuda_err("shared memory per block")(&e))?;
    let dynamic = (optin as usize).max(DEFAULT_SMEM) - GEMV_STATIC_SMEM;
    let streamed = [Gemv::Plain, Gemv::Normed, Gemv::Swiglu, Gemv::NormedSwiglu]
        .into_iter()
        .map(|g| (g, true));
    let int_normed = IntFormat::ALL.into_iter().flat_map(|format| {
        [Gemv::Normed, Gemv::NormedSwiglu]
            .into_iter()
            .flat_map(move |g| (1..=GEMV_MAX_ROWS).map(move |r| g.int_kernel(format, r)))
    });
    // The tensor-core integer GEMVs stage x whether normed or not.
    let int_mma = IntFormat::ALL.into_iter().flat_map(|format| {
        [Gemv::Plain, Gemv::Normed, Gemv::Swiglu, Gemv::NormedSwiglu]
            .into_iter()
            .flat_map(move |g| (1..=GEMV_MAX_ROWS).map(move |r| g.int_mma_kernel(format, r)))
    });
    let opted_in = [(Gemv::Normed, false), (Gemv::NormedSwiglu, false)]
        .into_iter()
        .chain(streamed)
        .flat_map(|(g, s)| (1..=GEMV_MAX_ROWS).map(move |r| g.kernel(r, s)))
        .chain(int_normed)
        .chain(int_mma)
        .chain(INT_GEMM_KERNELS)
        .all(|k| kernels[k].set_attribute(MAX_SMEM, dynamic as i32).is_ok());
    Ok(if opted_in {
        dynamic
    } else {
        DEFAULT_SMEM - GEMV_STATIC_SMEM
    })
}

/// The cuBLAS handle on `stream`, with a workspace of our own (returned with its address):
/// without one cuBLAS allocates on first use, which a GEMM being recorded into a CUDA graph
/// (a batched decode step) must not do.
fn cublas(
    stream: &Arc<CudaStream>,
) -> Result<(CudaBlas, CudaSlice<u8>, cudarc::driver::sys::CUdeviceptr)> {
    let blas = CudaBlas::new(stream.clone()).map_err(|e| cuda_err("cuBLAS")(&e))?;
    let mut workspace = stream
        .alloc_zeros::<u8>(CUBLAS_WORKSPACE_BYTES)
        .map_err(|e| cuda_err("allocating the cuBLAS workspace")(&e))?;
    {
        let (ptr, _guard) = workspace.device_ptr_mut(stream);
        // SAFETY: the workspace lives as long as the handle (both in Inner).
        unsafe {
            cudarc::cublas::sys::cublasSetWorkspace_v2(
                *blas.handle(),
                ptr as *mut _,
                CUBLAS_WORKSPACE_BYTES,
            )
        }
        .result()
        .map_err(|e| cuda_err("setting the cuBLAS workspace")(&e))?;
    }
    let workspace_ptr = workspace.device_ptr(stream).0;
    Ok((blas, workspace, workspace_ptr))
}

/// [`crate::twin::self_check`] on `gpu`, a progress bar counting the ops that match; logs the
/// worst difference found (as a share of what each op allows) once all do.
fn self_check_with_progress(gpu: &CudaBackend) -> Result<()> {
    let cases = crate::twin::self_check_cases().len();
    let bar = indicatif::ProgressBar::new(cases as u64).with_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:30}] {pos}/{len} ops match the CPU reference",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_message(format!("self-check on {}", gpu.device_name()));
    let started = std::time::Instant::now();
    let mut worst = 0.0f32;
    let checked = crate::twin::self_check(gpu, |outcome| {
        tracing::debug!(%outcome, "self-check");
        worst = worst.max(outcome.share_of_allowed());
        bar.inc(1);
    });
    bar.finish_and_clear();
    checked?;
    tracing::info!(
        device = %gpu.device_name(),
        ops = cases,
        worst_diff_over_allowed = worst,
        seconds = started.elapsed().as_secs_f32(),
        "CUDA self-check passed: every kernel matches the CPU reference"
    );
    Ok(())
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Queued kernels may still read buffers about to be freed.
        let _ = self.stream.synchronize();
    }
}

#[cfg(test)]
mod tests {
    use super::self_check_skipped;
    use std::ffi::OsStr;

    #[test]
    fn the_self_check_is_skipped_only_for_kernels_from_disk_and_on_request() {
        let dir = Some(OsStr::new("/tmp/kernels"));
        assert!(self_check_skipped(dir, Some("1")));
        assert!(!self_check_skipped(dir, None));
        assert!(!self_check_skipped(dir, Some("0")));
        assert!(
            !self_check_skipped(None, Some("1")),
            "built-in kernels are always checked"
        );
        assert!(
            !self_check_skipped(Some(OsStr::new("")), Some("1")),
            "empty counts as unset"
        );
    }
}
