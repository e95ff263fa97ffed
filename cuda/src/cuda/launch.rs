//! How an op reaches the stream: kernel lookup, output allocation, launch results, the shape
//! checks the ops share and per-op timing (named events on the stream).

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};

use super::error::cuda_err;
use super::kernels::ROW_THREADS;
use super::{CudaBackend, CudaTensor};
use crate::{Error, Result};

impl CudaBackend {
    pub(super) fn kernel(&self, name: &str) -> &CudaFunction {
        &self.inner.kernels[name]
    }

    /// An op's output, not initialized: every op writes all of its output (the kernels and
    /// the twin tests hold to that), so zeroing it first would be a wasted launch per op.
    pub(super) fn alloc(&self, shape: Vec<usize>) -> Result<CudaTensor> {
        let n: usize = shape.iter().product();
        let buf = self.alloc_slice::<f32>(n)?;
        Ok(CudaTensor {
            shape,
            buf: Arc::new(buf),
        })
    }

    /// A zeroed tensor (for outputs some rows of which no kernel writes).
    pub(super) fn alloc_zeroed(&self, shape: Vec<usize>) -> Result<CudaTensor> {
        let n: usize = shape.iter().product();
        let mut buf = self.alloc_slice::<f32>(n)?;
        self.inner
            .stream
            .memset_zeros(&mut buf)
            .map_err(|e| cuda_err("zeroing device memory")(&e))?;
        Ok(CudaTensor {
            shape,
            buf: Arc::new(buf),
        })
    }

    pub(super) fn indices(&self, values: &[u32]) -> Result<CudaSlice<u32>> {
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

    pub(super) fn launched(
        &self,
        name: &'static str,
        r: std::result::Result<(), cudarc::driver::DriverError>,
    ) -> Result<()> {
        r.map_err(|e| Error::Cuda {
            what: format!("launching {name}: {e}"),
        })?;
        self.op_done(name)
    }

    /// Launches kernel `name` with `args`, pointers to each argument's value in the kernel's
    /// order. With `programmatic`, under programmatic dependent launch (sm_90): the kernel may
    /// start while the one before it on the stream still runs, so it must wait for it
    /// (common.cuh's grid_wait) before it reads anything a kernel writes. In a recording the
    /// edge from the kernel before becomes a programmatic one where that is a kernel.
    ///
    /// # Safety
    ///
    /// `args` must match the kernel's parameters in number, order and type, and every buffer
    /// behind them must hold what the kernel reads and writes.
    pub(super) unsafe fn launch_args(
        &self,
        name: &'static str,
        cfg: LaunchConfig,
        args: &mut [*mut std::ffi::c_void],
        programmatic: bool,
    ) -> std::result::Result<(), cudarc::driver::DriverError> {
        use cudarc::driver::sys;
        let stream = &self.inner.stream;
        stream.context().bind_to_thread()?;
        let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: programmatic as u32,
        };
        sys::cuLaunchKernelEx(
            &config,
            self.kernel(name).cu_function(),
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
        .result()
    }

    /// While ops are timed, marks the end of op `name` on the stream, and the start of the
    /// next op (every op is timed from a start mark to its own end).
    pub(super) fn op_done(&self, name: &'static str) -> Result<()> {
        self.mark(name)?;
        self.mark("start")
    }

    /// While ops are timed, records a named event on the stream.
    pub(super) fn mark(&self, name: &'static str) -> Result<()> {
        let mut events = self
            .inner
            .op_events
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(events) = events.as_mut() {
            use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
            let e = self
                .inner
                .stream
                .record_event(Some(CU_EVENT_DEFAULT))
                .map_err(|e| cuda_err("recording a timing event")(&e))?;
            events.push((name, e));
        }
        Ok(())
    }

    /// An elementwise op `out = f(a[, b])` over `n` elements.
    pub(super) fn elementwise(
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

    /// A grid-stride loop over `n` elements.
    pub(super) fn fill_config(n: u64) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (n.div_ceil(ROW_THREADS as u64).clamp(1, 65_535) as u32, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    pub(super) fn row_config(rows: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (rows.max(1) as u32, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    pub(super) fn time_ops_impl(&self, on: bool) -> Result<bool> {
        self.synchronize()?;
        let mut events = self
            .inner
            .op_events
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        *events = on.then(Vec::new);
        drop(events);
        if on {
            self.mark("start")?;
        }
        Ok(true)
    }

    pub(super) fn op_times_impl(&self) -> Result<Vec<crate::backend::OpTime>> {
        self.synchronize()?;
        let mut guard = self
            .inner
            .op_events
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let Some(events) = guard.as_mut() else {
            return Ok(Vec::new());
        };
        let mut by_op: Vec<crate::backend::OpTime> = Vec::new();
        // Each op's end event follows the start mark set when the op before it had finished.
        for pair in events
            .windows(2)
            .filter(|p| p[0].0 == "start" && p[1].0 != "start")
        {
            let ms = pair[0]
                .1
                .elapsed_ms(&pair[1].1)
                .map_err(|e| cuda_err("reading a timing event")(&e))? as f64;
            let name = pair[1].0;
            match by_op.iter_mut().find(|o| o.op == name) {
                Some(o) => {
                    o.launches += 1;
                    o.ms += ms;
                }
                None => by_op.push(crate::backend::OpTime {
                    op: name,
                    launches: 1,
                    ms,
                }),
            }
        }
        events.clear();
        drop(guard);
        self.mark("start")?;
        by_op.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        Ok(by_op)
    }
}

pub(super) fn same_shape(op: &'static str, a: &CudaTensor, b: &CudaTensor) -> Result<()> {
    if a.shape != b.shape {
        return Err(Error::shape(
            op,
            format!("shapes differ: {:?} vs {:?}", a.shape, b.shape),
        ));
    }
    Ok(())
}

pub(super) fn width_of(op: &'static str, x: &CudaTensor, w: &CudaTensor) -> Result<()> {
    if w.len() != x.cols() {
        return Err(Error::shape(
            op,
            format!("weight of {} for rows of {:?}", w.len(), x.shape),
        ));
    }
    Ok(())
}

/// A kernel argument for [`CudaBackend::launch_args`]: a pointer to its value.
pub(super) fn arg<T>(v: &T) -> *mut std::ffi::c_void {
    v as *const T as *mut std::ffi::c_void
}

/// Runs `f` with this thread's `cell` set to `value`, then back to what it held, even if `f`
/// panics: how `with_fp8_gemm`, `with_int_gemm_rows` and `with_decode_attention` force a
/// choice on one thread's launches (queued on the calling thread, so no other thread's change).
pub(super) fn with_forced<V: Copy + 'static, T>(
    cell: &'static std::thread::LocalKey<std::cell::Cell<Option<V>>>,
    value: Option<V>,
    f: impl FnOnce() -> T,
) -> T {
    struct Restore<V: Copy + 'static> {
        cell: &'static std::thread::LocalKey<std::cell::Cell<Option<V>>>,
        before: Option<V>,
    }
    impl<V: Copy + 'static> Drop for Restore<V> {
        fn drop(&mut self) {
            self.cell.set(self.before);
        }
    }
    let _restore = Restore {
        cell,
        before: cell.replace(value),
    };
    f()
}

/// A kernel choice: this thread's forced one ([`with_forced`] on `forced`), else `var`'s value
/// read once into `from_env` and parsed by `parse` (`None` for a value it does not know:
/// `default`, with a warning naming `known`), else `default`.
pub(super) fn forced_or_env<V: Copy + Send + Sync + 'static>(
    forced: &'static std::thread::LocalKey<std::cell::Cell<Option<V>>>,
    from_env: &'static std::sync::OnceLock<V>,
    var: &str,
    parse: fn(&str) -> Option<V>,
    default: V,
    known: &str,
) -> V {
    forced.get().unwrap_or_else(|| {
        *from_env.get_or_init(|| match std::env::var(var) {
            Err(_) => default,
            Ok(v) => parse(&v).unwrap_or_else(|| {
                tracing::warn!("{var}={v} is not {known}: using the default");
                default
            }),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::{forced_or_env, with_forced};
    use std::cell::Cell;

    thread_local! {
        static FORCED: Cell<Option<u8>> = const { Cell::new(None) };
    }

    /// Nested settings see the innermost; each is undone on the way out, a panic too.
    #[test]
    fn a_forced_value_holds_inside_and_is_undone_after() {
        with_forced(&FORCED, Some(1), || {
            assert_eq!(FORCED.get(), Some(1));
            with_forced(&FORCED, Some(2), || assert_eq!(FORCED.get(), Some(2)));
            assert_eq!(FORCED.get(), Some(1));
            let panicked = std::panic::catch_unwind(|| {
                with_forced(&FORCED, None, || panic!("inside"));
            });
            assert!(panicked.is_err());
            assert_eq!(FORCED.get(), Some(1));
        });
        assert_eq!(FORCED.get(), None);
    }

    /// With the variable unset, the default; a forced value over it on its thread only.
    #[test]
    fn a_choice_is_the_forced_one_else_the_variables_else_the_default() {
        static FROM_ENV: std::sync::OnceLock<u8> = std::sync::OnceLock::new();
        let choice = || {
            let parse = |v: &str| v.parse::<u8>().ok();
            forced_or_env(&FORCED, &FROM_ENV, "VLM_TEST_NEVER_SET", parse, 7, "a u8")
        };
        assert_eq!(choice(), 7);
        with_forced(&FORCED, Some(3), || {
            assert_eq!(choice(), 3);
            assert_eq!(std::thread::spawn(choice).join().unwrap(), 7);
        });
        assert_eq!(choice(), 7);
    }
}
