//! The CUDA backend: every op of [`Backend`] on an NVIDIA GPU, f32 throughout, so that each
//! op can be checked against its CPU twin to f32 rounding (`cuda/tests/cuda_twin.rs`).
//!
//! Kernels are `cuda/kernels/*.cu`, embedded with `include_str!`, compiled at first use by
//! NVRTC for the GPU present (see [`compile`]) and loaded once per backend; GEMMs go to cuBLAS.
//! The CUDA libraries are loaded dynamically, so the binary builds and runs without CUDA, and
//! [`CudaBackend::new`] answers "no GPU" with an error instead of a crash.
//!
//! This is the correctness baseline; the fp16 and fused kernels of the seed reports replace
//! these op by op, each checked against the same twins.

pub mod compile;

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::{CompileOptions, Ptx};

use crate::backend::{AttnMask, Backend, GeluKind};
use crate::{Error, HostTensor, Result};

const OPS_SOURCE: &str = include_str!("../../kernels/ops_f32.cu");
const OPS_KERNELS: [&str; 13] = [
    "add_f32",
    "gelu_tanh_f32",
    "gelu_erf_f32",
    "silu_mul_f32",
    "layer_norm_f32",
    "rms_norm_f32",
    "rope_f32",
    "attention_f32",
    "embedding_f32",
    "weighted_gather_f32",
    "scatter_rows_f32",
    "broadcast_rows_f32",
    "fill_uniform_f32",
];
/// Threads per block for row-wise kernels.
const ROW_THREADS: u32 = 256;
/// Largest head dim the attention kernel holds in registers (32 lanes x 8).
const MAX_HEAD_DIM: usize = 256;

/// A tensor in device memory. Clones share the buffer; the in-place row ops copy it first when
/// it is shared, so a clone never sees another's writes.
#[derive(Clone)]
pub struct CudaTensor {
    shape: Vec<usize>,
    buf: Arc<CudaSlice<f32>>,
}

impl CudaTensor {
    fn len(&self) -> usize {
        self.shape.iter().product()
    }
    fn cols(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }
    fn rows(&self) -> usize {
        self.len().checked_div(self.cols()).unwrap_or(0)
    }
}

struct Inner {
    /// Holds the context (and with it the device) alive.
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    kernels: HashMap<&'static str, CudaFunction>,
    device_name: String,
    compute_capability: (i32, i32),
}

/// An NVIDIA GPU; cheap to clone (all clones share the context, stream and kernels).
#[derive(Clone)]
pub struct CudaBackend {
    inner: Arc<Inner>,
}

fn cuda_err(op: &str) -> impl Fn(&dyn std::fmt::Display) -> Error + '_ {
    move |e| Error::Cuda {
        what: format!("{op}: {e}"),
    }
}

fn nvrtc_version() -> (i32, i32) {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: nvrtcVersion writes two ints through the pointers; the library is loaded (checked
    // by the caller with is_culib_present).
    unsafe {
        cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor);
    }
    (major, minor)
}

/// The gate every `--device cuda` goes through. The backend stays off until `cuda_twin.rs` and
/// the golden stage tests have passed on a GPU; enabling it is this one function.
pub fn ensure_enabled() -> Result<()> {
    Err(Error::Cuda {
        what: "--device cuda is not enabled yet: the CUDA backend (cuda/src/cuda) awaits verification on a GPU; use --device cpu".into(),
    })
}

/// Whether NVRTC can be loaded (it needs no GPU: kernels can be compiled anywhere it is).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles the f32 op kernels to PTX for compute capability `cc` with NVRTC.
pub fn compile_ops_ptx(cc: (i32, i32)) -> Result<String> {
    let arch: &'static str = Box::leak(format!("compute_{}{}", cc.0, cc.1).into_boxed_str());
    let opts = CompileOptions {
        arch: Some(arch),
        // These f32 kernels include nothing; the header directory is passed when present, for
        // the kernels that will.
        include_paths: compile::cuda_include_dir()
            .map(|p| vec![p.display().to_string()])
            .unwrap_or_default(),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(OPS_SOURCE, opts)
        .map(|p| p.to_src())
        .map_err(|e| Error::KernelCompile {
            kernel: format!("ops_f32.cu for compute_{}{}", cc.0, cc.1),
            log: match e {
                cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                    log.to_string_lossy().into_owned()
                }
                other => other.to_string(),
            },
        })
}

impl CudaBackend {
    /// Opens GPU `ordinal`, compiling (or loading from the disk cache) every kernel.
    pub fn new(ordinal: usize) -> Result<Self> {
        // SAFETY: these only try to dlopen the libraries.
        let (driver, nvrtc, cublas) = unsafe {
            (
                cudarc::driver::sys::is_culib_present(),
                cudarc::nvrtc::sys::is_culib_present(),
                cudarc::cublas::sys::is_culib_present(),
            )
        };
        for (present, lib, hint) in [
            (
                driver,
                "libcuda (the NVIDIA driver)",
                "is there an NVIDIA GPU and driver on this machine?",
            ),
            (
                nvrtc,
                "libnvrtc",
                "install the CUDA toolkit and set CUDA_HOME or LD_LIBRARY_PATH",
            ),
            (
                cublas,
                "libcublas",
                "install the CUDA toolkit and set CUDA_HOME or LD_LIBRARY_PATH",
            ),
        ] {
            if !present {
                return Err(Error::Cuda {
                    what: format!("{lib} could not be loaded: {hint}"),
                });
            }
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda_err("opening the GPU")(&e))?;
        let device_name = ctx.name().map_err(|e| cuda_err("device name")(&e))?;
        let cc = ctx
            .compute_capability()
            .map_err(|e| cuda_err("compute capability")(&e))?;
        let stream = ctx.default_stream();

        let nv = nvrtc_version();
        let path = compile::cache_path(&compile::cache_dir(), "ops_f32", OPS_SOURCE, cc, nv);
        let (ptx, cached) = compile::cached_or_compile(&path, || {
            // NVRTC takes seconds; show that something is happening (hidden off a terminal).
            let spinner = indicatif::ProgressBar::new_spinner().with_message(format!(
                "compiling CUDA kernels for sm_{}{} (cached afterwards)",
                cc.0, cc.1
            ));
            spinner.enable_steady_tick(std::time::Duration::from_millis(120));
            let ptx = compile_ops_ptx(cc);
            spinner.finish_and_clear();
            ptx
        })?;
        tracing::info!(device = %device_name, sm = format!("{}.{}", cc.0, cc.1), cached, cache = %path.display(), "CUDA kernels ready");
        let module = ctx
            .load_module(Ptx::from_src(ptx))
            .map_err(|e| cuda_err("loading ops_f32.cu")(&e))?;
        let mut kernels = HashMap::new();
        for k in OPS_KERNELS {
            let f = module.load_function(k).map_err(|e| Error::KernelCompile {
                kernel: k.into(),
                log: e.to_string(),
            })?;
            kernels.insert(k, f);
        }
        let blas = CudaBlas::new(stream.clone()).map_err(|e| cuda_err("cuBLAS")(&e))?;
        Ok(Self {
            inner: Arc::new(Inner {
                stream,
                blas,
                kernels,
                device_name,
                compute_capability: cc,
            }),
        })
    }

    pub fn device_name(&self) -> &str {
        &self.inner.device_name
    }

    pub fn compute_capability(&self) -> (i32, i32) {
        self.inner.compute_capability
    }

    /// Waits for all queued work (for timing and tests).
    pub fn synchronize(&self) -> Result<()> {
        self.inner
            .stream
            .synchronize()
            .map_err(|e| cuda_err("synchronize")(&e))
    }

    fn kernel(&self, name: &str) -> &CudaFunction {
        &self.inner.kernels[name]
    }

    fn alloc(&self, shape: Vec<usize>) -> Result<CudaTensor> {
        let n: usize = shape.iter().product();
        let buf = self
            .inner
            .stream
            .alloc_zeros::<f32>(n.max(1))
            .map_err(|e| cuda_err("allocating device memory")(&e))?;
        Ok(CudaTensor {
            shape,
            buf: Arc::new(buf),
        })
    }

    fn indices(&self, values: &[u32]) -> Result<CudaSlice<u32>> {
        let v = if values.is_empty() {
            &[0u32][..]
        } else {
            values
        };
        self.inner
            .stream
            .clone_htod(v)
            .map_err(|e| cuda_err("uploading indices")(&e))
    }

    fn launched(
        &self,
        name: &str,
        r: std::result::Result<(), cudarc::driver::DriverError>,
    ) -> Result<()> {
        r.map_err(|e| Error::Cuda {
            what: format!("launching {name}: {e}"),
        })
    }

    /// An elementwise op `out = f(a[, b])` over `n` elements.
    fn elementwise(
        &self,
        name: &'static str,
        a: &CudaTensor,
        b: Option<&CudaTensor>,
    ) -> Result<CudaTensor> {
        let mut out = self.alloc(a.shape.clone())?;
        let n = a.len() as i32;
        let cfg = LaunchConfig::for_num_elems(n.max(1) as u32);
        let stream = &self.inner.stream;
        let mut l = stream.launch_builder(self.kernel(name));
        l.arg(&*a.buf);
        if let Some(b) = b {
            l.arg(&*b.buf);
        }
        let out_buf = Arc::get_mut(&mut out.buf).expect("fresh buffer");
        l.arg(out_buf).arg(&n);
        // SAFETY: argument types and count match the kernel's signature in ops_f32.cu.
        self.launched(name, unsafe { l.launch(cfg) }.map(|_| ()))?;
        Ok(out)
    }

    fn row_config(rows: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (rows.max(1) as u32, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// `dst[rows[i]] (+)= src[i]` with rows of `width` elements.
    fn scatter(
        &self,
        dst: &mut CudaTensor,
        rows: &[usize],
        src: &CudaTensor,
        accumulate: bool,
    ) -> Result<()> {
        let slots = dst.shape.first().copied().unwrap_or(0);
        let width = dst.len().checked_div(slots).unwrap_or(0);
        if src.len() != rows.len() * width || rows.iter().any(|&r| r >= slots) {
            return Err(Error::shape(
                "scatter_rows",
                format!(
                    "{} rows of width {width} into {:?} from {:?}",
                    rows.len(),
                    dst.shape,
                    src.shape
                ),
            ));
        }
        if rows.is_empty() {
            return Ok(());
        }
        let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let idx = self.indices(&idx)?;
        let buf = Arc::make_mut(&mut dst.buf);
        let (w, acc) = (width as i32, accumulate as i32);
        let mut l = self
            .inner
            .stream
            .launch_builder(self.kernel("scatter_rows_f32"));
        l.arg(buf).arg(&idx).arg(&*src.buf).arg(&w).arg(&acc);
        // SAFETY: matches scatter_rows_f32; rows were checked against the destination.
        self.launched(
            "scatter_rows_f32",
            unsafe { l.launch(Self::row_config(rows.len())) }.map(|_| ()),
        )
    }
}

fn same_shape(op: &'static str, a: &CudaTensor, b: &CudaTensor) -> Result<()> {
    if a.shape != b.shape {
        return Err(Error::shape(
            op,
            format!("shapes differ: {:?} vs {:?}", a.shape, b.shape),
        ));
    }
    Ok(())
}

fn width_of(op: &'static str, x: &CudaTensor, w: &CudaTensor) -> Result<()> {
    if w.len() != x.cols() {
        return Err(Error::shape(
            op,
            format!("weight of {} for rows of {:?}", w.len(), x.shape),
        ));
    }
    Ok(())
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn upload(&self, t: &HostTensor) -> Result<CudaTensor> {
        let data = if t.is_empty() { &[0f32][..] } else { t.data() };
        let buf = self
            .inner
            .stream
            .clone_htod(data)
            .map_err(|e| cuda_err("upload")(&e))?;
        Ok(CudaTensor {
            shape: t.shape().to_vec(),
            buf: Arc::new(buf),
        })
    }

    fn download(&self, t: &CudaTensor) -> Result<HostTensor> {
        let mut v = self
            .inner
            .stream
            .clone_dtoh(&*t.buf)
            .map_err(|e| cuda_err("download")(&e))?;
        v.truncate(t.len());
        HostTensor::new(t.shape.clone(), v)
    }

    fn zeros(&self, shape: &[usize]) -> Result<CudaTensor> {
        self.alloc(shape.to_vec())
    }

    fn random_uniform(&self, shape: &[usize], key: u64, bound: f32) -> Result<CudaTensor> {
        let mut out = self.alloc(shape.to_vec())?;
        let n = out.len() as u64;
        let name = "fill_uniform_f32";
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(ROW_THREADS as u64).clamp(1, 65_535) as u32, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let buf = Arc::get_mut(&mut out.buf).expect("fresh buffer");
        let mut l = self.inner.stream.launch_builder(self.kernel(name));
        l.arg(buf).arg(&n).arg(&key).arg(&bound);
        // SAFETY: argument types and count match fill_uniform_f32 in ops_f32.cu.
        self.launched(name, unsafe { l.launch(cfg) }.map(|_| ()))?;
        Ok(out)
    }

    fn shape<'a>(&self, t: &'a CudaTensor) -> &'a [usize] {
        &t.shape
    }

    fn reshape(&self, mut t: CudaTensor, shape: &[usize]) -> Result<CudaTensor> {
        if shape.iter().product::<usize>() != t.len() {
            return Err(Error::shape(
                "reshape",
                format!("cannot view {:?} as {shape:?}", t.shape),
            ));
        }
        t.shape = shape.to_vec();
        Ok(t)
    }

    fn linear(&self, x: &CudaTensor, w: &CudaTensor, b: Option<&CudaTensor>) -> Result<CudaTensor> {
        let (n, k) = (x.rows(), x.cols());
        let [m, wk] = w.shape[..] else {
            return Err(Error::shape(
                "linear",
                format!("weight must be 2-D, got {:?}", w.shape),
            ));
        };
        if wk != k || b.is_some_and(|b| b.len() != m) {
            return Err(Error::shape(
                "linear",
                format!(
                    "input {:?}, weight {:?}, bias {:?}",
                    x.shape,
                    w.shape,
                    b.map(|b| &b.shape)
                ),
            ));
        }
        let mut shape = x.shape[..x.shape.len() - 1].to_vec();
        shape.push(m);
        let mut out = self.alloc(shape)?;
        if n == 0 || m == 0 {
            return Ok(out);
        }
        let out_buf = Arc::get_mut(&mut out.buf).expect("fresh buffer");
        if let Some(b) = b {
            let (cols, rows) = (m as i32, n as i32);
            let mut l = self
                .inner
                .stream
                .launch_builder(self.kernel("broadcast_rows_f32"));
            l.arg(&*b.buf).arg(&mut *out_buf).arg(&cols).arg(&rows);
            // SAFETY: matches broadcast_rows_f32.
            self.launched(
                "broadcast_rows_f32",
                unsafe { l.launch(LaunchConfig::for_num_elems((n * m) as u32)) }.map(|_| ()),
            )?;
        }
        // Row-major out[n, m] = x[n, k] · w[m, k]ᵀ is column-major outᵀ[m, n] = w · xᵀ, with w
        // read transposed from its row-major [m, k] storage.
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: m as i32,
            n: n as i32,
            k: k as i32,
            alpha: 1.0f32,
            lda: k as i32,
            ldb: k as i32,
            beta: if b.is_some() { 1.0 } else { 0.0 },
            ldc: m as i32,
        };
        // SAFETY: the buffers hold m*k, n*k and n*m f32s as the config describes.
        unsafe { self.inner.blas.gemm(cfg, &*w.buf, &*x.buf, out_buf) }
            .map_err(|e| cuda_err("cuBLAS sgemm")(&e))?;
        Ok(out)
    }

    fn add(&self, a: &CudaTensor, b: &CudaTensor) -> Result<CudaTensor> {
        same_shape("add", a, b)?;
        self.elementwise("add_f32", a, Some(b))
    }

    fn layer_norm(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        b: &CudaTensor,
        eps: f32,
    ) -> Result<CudaTensor> {
        width_of("layer_norm", x, w)?;
        width_of("layer_norm", x, b)?;
        let mut out = self.alloc(x.shape.clone())?;
        let cols = x.cols() as i32;
        let mut l = self
            .inner
            .stream
            .launch_builder(self.kernel("layer_norm_f32"));
        l.arg(&*x.buf)
            .arg(&*w.buf)
            .arg(&*b.buf)
            .arg(Arc::get_mut(&mut out.buf).expect("fresh"))
            .arg(&cols)
            .arg(&eps);
        // SAFETY: matches layer_norm_f32, one block per row.
        self.launched(
            "layer_norm_f32",
            unsafe { l.launch(Self::row_config(x.rows())) }.map(|_| ()),
        )?;
        Ok(out)
    }

    fn rms_norm(&self, x: &CudaTensor, w: &CudaTensor, eps: f32) -> Result<CudaTensor> {
        width_of("rms_norm", x, w)?;
        let mut out = self.alloc(x.shape.clone())?;
        let cols = x.cols() as i32;
        let mut l = self
            .inner
            .stream
            .launch_builder(self.kernel("rms_norm_f32"));
        l.arg(&*x.buf)
            .arg(&*w.buf)
            .arg(Arc::get_mut(&mut out.buf).expect("fresh"))
            .arg(&cols)
            .arg(&eps);
        // SAFETY: matches rms_norm_f32, one block per row.
        self.launched(
            "rms_norm_f32",
            unsafe { l.launch(Self::row_config(x.rows())) }.map(|_| ()),
        )?;
        Ok(out)
    }

    fn gelu(&self, x: &CudaTensor, kind: GeluKind) -> Result<CudaTensor> {
        match kind {
            GeluKind::Tanh => self.elementwise("gelu_tanh_f32", x, None),
            GeluKind::Erf => self.elementwise("gelu_erf_f32", x, None),
        }
    }

    fn silu_mul(&self, gate: &CudaTensor, up: &CudaTensor) -> Result<CudaTensor> {
        same_shape("silu_mul", gate, up)?;
        self.elementwise("silu_mul_f32", gate, Some(up))
    }

    fn rope(&self, x: &CudaTensor, cos: &CudaTensor, sin: &CudaTensor) -> Result<CudaTensor> {
        let [n, h, d] = x.shape[..] else {
            return Err(Error::shape(
                "rope",
                format!("x must be [tokens, heads, head_dim], got {:?}", x.shape),
            ));
        };
        if cos.shape != [n, d] || sin.shape != [n, d] || d % 2 != 0 {
            return Err(Error::shape(
                "rope",
                format!(
                    "x {:?} with cos {:?}, sin {:?}",
                    x.shape, cos.shape, sin.shape
                ),
            ));
        }
        let mut out = self.alloc(x.shape.clone())?;
        let (hh, dd) = (h as i32, d as i32);
        let mut l = self.inner.stream.launch_builder(self.kernel("rope_f32"));
        l.arg(&*x.buf)
            .arg(&*cos.buf)
            .arg(&*sin.buf)
            .arg(Arc::get_mut(&mut out.buf).expect("fresh"))
            .arg(&hh)
            .arg(&dd);
        // SAFETY: matches rope_f32, one block per token.
        self.launched(
            "rope_f32",
            unsafe { l.launch(Self::row_config(n)) }.map(|_| ()),
        )?;
        Ok(out)
    }

    fn attention(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        kv_len: usize,
        mask: AttnMask,
    ) -> Result<CudaTensor> {
        let [nq, hq, d] = q.shape[..] else {
            return Err(Error::shape(
                "attention",
                format!("q must be 3-D, got {:?}", q.shape),
            ));
        };
        let [slots, hkv, dk] = k.shape[..] else {
            return Err(Error::shape(
                "attention",
                format!("k must be 3-D, got {:?}", k.shape),
            ));
        };
        let first = match mask {
            AttnMask::Full => 0,
            AttnMask::Causal { first_query_slot } => first_query_slot,
        };
        let causal = matches!(mask, AttnMask::Causal { .. });
        if v.shape != k.shape
            || dk != d
            || d > MAX_HEAD_DIM
            || hkv == 0
            || hq % hkv != 0
            || kv_len > slots
            || kv_len == 0
            || (causal && first + nq > kv_len)
        {
            return Err(Error::shape(
                "attention",
                format!(
                    "q {:?}, k {:?}, v {:?}, kv_len {kv_len}, {mask:?}",
                    q.shape, k.shape, v.shape
                ),
            ));
        }
        let mut out = self.alloc(vec![nq, hq * d])?;
        let (hq_i, hkv_i, d_i, len_i, causal_i, first_i) = (
            hq as i32,
            hkv as i32,
            d as i32,
            kv_len as i32,
            causal as i32,
            first as i32,
        );
        let scale = 1.0f32 / (d as f32).sqrt();
        let mut l = self
            .inner
            .stream
            .launch_builder(self.kernel("attention_f32"));
        l.arg(&*q.buf)
            .arg(&*k.buf)
            .arg(&*v.buf)
            .arg(Arc::get_mut(&mut out.buf).expect("fresh"))
            .arg(&hq_i)
            .arg(&hkv_i)
            .arg(&d_i)
            .arg(&len_i)
            .arg(&causal_i)
            .arg(&first_i)
            .arg(&scale);
        let cfg = LaunchConfig {
            grid_dim: ((nq * hq).max(1) as u32, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches attention_f32: one warp per (query, head), shapes checked above.
        self.launched("attention_f32", unsafe { l.launch(cfg) }.map(|_| ()))?;
        Ok(out)
    }

    fn embedding(&self, table: &CudaTensor, ids: &[u32]) -> Result<CudaTensor> {
        let (vocab, h) = (table.rows(), table.cols());
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(Error::shape(
                "embedding",
                format!("token id {id} is outside the vocabulary of {vocab}"),
            ));
        }
        let mut out = self.alloc(vec![ids.len(), h])?;
        if ids.is_empty() {
            return Ok(out);
        }
        let idx = self.indices(ids)?;
        let hh = h as i32;
        let mut l = self
            .inner
            .stream
            .launch_builder(self.kernel("embedding_f32"));
        l.arg(&*table.buf)
            .arg(&idx)
            .arg(Arc::get_mut(&mut out.buf).expect("fresh"))
            .arg(&hh);
        // SAFETY: matches embedding_f32; ids checked against the table.
        self.launched(
            "embedding_f32",
            unsafe { l.launch(Self::row_config(ids.len())) }.map(|_| ()),
        )?;
        Ok(out)
    }

    fn weighted_gather(
        &self,
        table: &CudaTensor,
        index: &[u32],
        weights: &[f32],
        taps: usize,
    ) -> Result<CudaTensor> {
        if taps == 0
            || index.len() != weights.len()
            || index.len() % taps != 0
            || index.iter().any(|&i| i as usize >= table.rows())
        {
            return Err(Error::shape(
                "weighted_gather",
                format!(
                    "{} indices, {} weights, {taps} taps, table {:?}",
                    index.len(),
                    weights.len(),
                    table.shape
                ),
            ));
        }
        let n = index.len() / taps;
        let h = table.cols();
        let mut out = self.alloc(vec![n, h])?;
        if n == 0 {
            return Ok(out);
        }
        let idx = self.indices(index)?;
        let w = self
            .inner
            .stream
            .clone_htod(weights)
            .map_err(|e| cuda_err("uploading weights")(&e))?;
        let (t, hh) = (taps as i32, h as i32);
        let mut l = self
            .inner
            .stream
            .launch_builder(self.kernel("weighted_gather_f32"));
        l.arg(&*table.buf)
            .arg(&idx)
            .arg(&w)
            .arg(Arc::get_mut(&mut out.buf).expect("fresh"))
            .arg(&t)
            .arg(&hh);
        // SAFETY: matches weighted_gather_f32; indices checked against the table.
        self.launched(
            "weighted_gather_f32",
            unsafe { l.launch(Self::row_config(n)) }.map(|_| ()),
        )?;
        Ok(out)
    }

    fn slice_rows(&self, x: &CudaTensor, start: usize, end: usize) -> Result<CudaTensor> {
        let c = x.cols();
        if start > end || end > x.rows() {
            return Err(Error::shape(
                "slice_rows",
                format!("rows {start}..{end} of {:?}", x.shape),
            ));
        }
        let mut out = self.alloc(vec![end - start, c])?;
        if end > start {
            let src = x.buf.slice(start * c..end * c);
            self.inner
                .stream
                .memcpy_dtod(&src, Arc::get_mut(&mut out.buf).expect("fresh"))
                .map_err(|e| cuda_err("slice_rows")(&e))?;
        }
        Ok(out)
    }

    fn write_rows(&self, dst: &mut CudaTensor, start: usize, src: &CudaTensor) -> Result<()> {
        let n = src.shape.first().copied().unwrap_or(0);
        let slots = dst.shape.first().copied().unwrap_or(0);
        let width = dst.len().checked_div(slots).unwrap_or(0);
        if start + n > slots || src.len() != n * width {
            return Err(Error::shape(
                "write_rows",
                format!(
                    "{n} rows at {start} into {:?} from {:?}",
                    dst.shape, src.shape
                ),
            ));
        }
        if n == 0 {
            return Ok(());
        }
        let buf = Arc::make_mut(&mut dst.buf);
        let mut target = buf.slice_mut(start * width..(start + n) * width);
        self.inner
            .stream
            .memcpy_dtod(&*src.buf, &mut target)
            .map_err(|e| cuda_err("write_rows")(&e))
    }

    fn scatter_rows(&self, dst: &mut CudaTensor, rows: &[usize], src: &CudaTensor) -> Result<()> {
        self.scatter(dst, rows, src, false)
    }

    fn add_rows(&self, dst: &mut CudaTensor, rows: &[usize], src: &CudaTensor) -> Result<()> {
        self.scatter(dst, rows, src, true)
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Queued kernels may still read buffers about to be freed.
        let _ = self.stream.synchronize();
    }
}
