//! Recording a step (a decode step, a ViT pass) into a CUDA graph, and the memory its ops
//! allocate meanwhile.
//!
//! An op's output allocated the usual way (stream-ordered, on the stream being captured) is an
//! allocation node in the graph between the kernel before it and the kernel that writes it, and
//! a freed buffer a free node; only an edge from kernel to kernel can be programmatic (launch.rs,
//! `launch_args`), so every such node would cost the kernel after it its early start. While a
//! step is recorded its buffers therefore come from a memory pool of the recording's own,
//! allocated and freed on a second stream that is not captured: at once, in the host's order,
//! which is the order the ops are recorded in, so a buffer is reused within the step exactly
//! where a stream-ordered allocator would reuse it (and a kernel under programmatic launch
//! touches activations only after its wait, when every kernel before it has finished). The
//! pool keeps all it ever held while the graph lives and is never allocated from after the
//! recording, so the graph's buffers stay its own.

use std::sync::Arc;

use cudarc::driver::{sys, CudaSlice};

use super::error::cuda_err;
use super::pool::RecordingPool;
use super::{CudaBackend, CudaStepGraph, CudaTensor};
use crate::{Backend, Error, Result};

impl CudaBackend {
    /// `len` elements for an op's output, not initialized: from the recording's pool while a
    /// step is recorded, else stream-ordered on the backend's stream.
    pub(super) fn alloc_slice<T: cudarc::driver::DeviceRepr>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>> {
        let pool = self
            .inner
            .recording
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match pool.as_ref() {
            Some(pool) => pool.alloc(len),
            // SAFETY: callers write every element before any read (launch.rs, alloc).
            None => unsafe { self.inner.stream.alloc::<T>(len.max(1)) }
                .map_err(|e| cuda_err("allocating device memory")(&e)),
        }
    }

    /// `t`'s buffer to write in place: its own, or a copy of it first when a clone shares it.
    /// (Not `Arc::make_mut`: cudarc copies a buffer on the buffer's stream, which for a
    /// recorded step's is the recording pool's side stream, not the one being recorded.)
    pub(super) fn unshared<'a>(&self, t: &'a mut CudaTensor) -> Result<&'a mut CudaSlice<f32>> {
        if Arc::get_mut(&mut t.buf).is_none() {
            let mut copy = self.alloc_slice::<f32>(t.buf.len())?;
            self.inner
                .stream
                .memcpy_dtod(&*t.buf, &mut copy)
                .map_err(|e| cuda_err("copying a shared tensor")(&e))?;
            t.buf = Arc::new(copy);
        }
        Ok(Arc::get_mut(&mut t.buf).expect("unshared above"))
    }

    pub(super) fn record_impl(
        &self,
        ops: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Option<CudaStepGraph>> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        // Timing events cannot be recorded inside a graph: while ops are timed, steps run op
        // by op.
        if self.timing_ops() {
            return Ok(None);
        }
        let stream = &self.inner.stream;
        let pool = Arc::new(RecordingPool::new(stream, &self.inner.side_stream)?);
        *self
            .inner
            .recording
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(pool.clone());
        // Relaxed: other threads' CUDA calls (another service in the same process) go on, and
        // this one may allocate from the recording's pool on the side stream, which a
        // thread-local capture forbids ("operation not permitted when stream is capturing").
        let began = stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(|e| cuda_err("starting a graph capture")(&e));
        let recorded = began.and_then(|()| ops());
        // Ended whatever ops did, so the stream never stays in capture mode. Buffers the step
        // allocates the stream's way and does not free are freed at each launch.
        let graph = stream
            .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
        *self
            .inner
            .recording
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = None;
        // The side stream's allocations and frees are done (before the graph first runs, and
        // before the pool's count of what is still allocated).
        let settled = self
            .inner
            .side_stream
            .synchronize()
            .map_err(|e| cuda_err("allocating a recording's memory")(&e));
        let kept = pool.in_use();
        if kept > 0 {
            // A buffer made while recording outlives the recording: freed later on the side
            // stream, it would not wait for the backend's stream. Its pool is never destroyed.
            std::mem::forget(pool);
            recorded?;
            return Err(Error::Cuda {
                what: format!("recording a step: {kept} bytes of buffers made while recording outlive it (outputs must be allocated before recording)"),
            });
        }
        recorded?;
        settled?;
        let graph = graph.map_err(|e| cuda_err("capturing a recording")(&e))?;
        if let Some(graph) = graph.as_ref().filter(|_| self.programmatic_launch()) {
            if let Some((nodes, edges, programmatic)) = graph_edges(graph) {
                tracing::debug!(nodes, edges, programmatic, "step recorded");
            }
        }
        Ok(graph.map(|graph| CudaStepGraph { graph, _pool: pool }))
    }
}

/// A recorded graph's nodes, edges and programmatic edges (for the log: whether the GEMVs'
/// early starts made it into the graph). Needs a driver of CUDA 12.3 or later, as programmatic
/// launch does (context.rs).
fn graph_edges(graph: &cudarc::driver::CudaGraph) -> Option<(usize, usize, usize)> {
    use sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as PROGRAMMATIC;
    let g = graph.cu_graph();
    let (mut nodes, mut edges) = (0usize, 0usize);
    use std::ptr::null_mut as null;
    // SAFETY: null arrays ask for the counts; the arrays passed after hold `edges` entries.
    unsafe {
        sys::cuGraphGetNodes(g, null(), &mut nodes).result().ok()?;
        sys::cuGraphGetEdges_v2(g, null(), null(), null(), &mut edges)
            .result()
            .ok()?;
        let mut from = vec![null(); edges];
        let mut to = vec![null(); edges];
        let mut data: Vec<sys::CUgraphEdgeData> = vec![std::mem::zeroed(); edges];
        sys::cuGraphGetEdges_v2(
            g,
            from.as_mut_ptr(),
            to.as_mut_ptr(),
            data.as_mut_ptr(),
            &mut edges,
        )
        .result()
        .ok()?;
        let programmatic = data
            .iter()
            .filter(|d| d.type_ == PROGRAMMATIC as u8)
            .count();
        Some((nodes, edges, programmatic))
    }
}
