//! The memory pool a step's recording allocates from (recording.rs says why it has its own),
//! kept alive by the recorded graph as long as the graph lives.

use std::sync::Arc;

use cudarc::driver::{sys, CudaSlice, CudaStream};

use super::error::cuda_err;
use crate::Result;

/// The memory of one recording's buffers.
pub(super) struct RecordingPool {
    pool: sys::CUmemoryPool,
    /// Where the recording's buffers are allocated and freed (their slices' stream).
    side: Arc<CudaStream>,
    /// The backend's stream, which replays the graph.
    main: Arc<CudaStream>,
}

// SAFETY: the pool is a plain driver handle, usable from any thread; the streams are cudarc's
// (Send + Sync).
unsafe impl Send for RecordingPool {}
unsafe impl Sync for RecordingPool {}

impl RecordingPool {
    pub(super) fn new(main: &Arc<CudaStream>, side: &Arc<CudaStream>) -> Result<Self> {
        let err = |what| move |e: &dyn std::fmt::Display| cuda_err(what)(e);
        // SAFETY: zeroed props are "no handle types, no maximum"; the fields set say device
        // memory of this stream's GPU. The attribute is a u64, as the driver reads it.
        unsafe {
            let mut props: sys::CUmemPoolProps = std::mem::zeroed();
            props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
            props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            props.location.id = main.context().ordinal() as i32;
            let mut pool = std::ptr::null_mut();
            sys::cuMemPoolCreate(&mut pool, &props)
                .result()
                .map_err(|e| err("creating a recording's memory pool")(&e))?;
            let made = Self {
                pool,
                side: side.clone(),
                main: main.clone(),
            };
            // Freed memory stays in the pool (the graph's buffers) until the pool goes.
            let mut keep = u64::MAX;
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut keep) as *mut u64 as *mut std::ffi::c_void,
            )
            .result()
            .map_err(|e| err("keeping a recording's memory")(&e))?;
            Ok(made)
        }
    }

    pub(super) fn alloc<T>(&self, len: usize) -> Result<CudaSlice<T>> {
        let len = len.max(1);
        let mut ptr = 0;
        // SAFETY: the pool and stream are live; the slice made of the pointer is freed on the
        // same stream, into the same pool, when dropped.
        unsafe {
            sys::cuMemAllocFromPoolAsync(
                &mut ptr,
                len * std::mem::size_of::<T>(),
                self.pool,
                self.side.cu_stream(),
            )
            .result()
            .map_err(|e| cuda_err("allocating a recorded step's buffer")(&e))?;
            Ok(self.side.upgrade_device_ptr(ptr, len))
        }
    }

    /// Bytes of the pool's buffers not freed yet.
    pub(super) fn in_use(&self) -> u64 {
        let mut used = 0u64;
        // SAFETY: the attribute is a u64.
        unsafe {
            sys::cuMemPoolGetAttribute(
                self.pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
                (&mut used) as *mut u64 as *mut std::ffi::c_void,
            );
        }
        used
    }
}

impl Drop for RecordingPool {
    fn drop(&mut self) {
        // A replay may still be running, and what the recording freed is freed on the side.
        let _ = self.main.synchronize();
        let _ = self.side.synchronize();
        // SAFETY: nothing is allocated from the pool any more (record_impl checked that every
        // buffer of the recording was freed in it).
        unsafe { sys::cuMemPoolDestroy(self.pool) };
    }
}
