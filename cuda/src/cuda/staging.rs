//! A page-locked host buffer that large uploads and downloads pass through.
//!
//! Copies from or to pageable memory go through the driver's own small bounce buffer and block
//! the host for their whole length; on the H100 machine the ViT's outputs at 896x896 (four
//! 12.8 MB matrices) took ~10 ms each that way, with the GPU idle. Through page-locked memory
//! the copy engine runs at PCIe speed and the host only copies to or from its own `Vec`.

use std::sync::{Arc, Mutex};

use bytemuck::Pod;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DeviceRepr, PinnedHostSlice};
use rayon::prelude::*;

use super::error::cuda_err;
use crate::{Error, Result};

/// Makes glibc's malloc keep freed memory for reuse instead of handing it back to the kernel.
/// Every download returns a fresh `Vec` (the ViT's four outputs at 896x896 are 51 MB), and
/// glibc by default maps such blocks afresh and unmaps them when freed (or trims them off
/// its heap), so each page is faulted in again on every request: on the H100 machine (a
/// gVisor sandbox) a 12.8 MB block took 8.9 ms to fill fresh against 1.6 ms reused, and ViT
/// 896x896 ran 57 ms instead of 35. Blocks up to 32 MiB (glibc's largest threshold) now come
/// from the heap, and up to 512 MiB of free heap stays mapped. Process-wide and idempotent;
/// other C libraries are left alone.
pub(super) fn keep_freed_host_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            // SAFETY: mallopt only sets malloc parameters (it takes malloc's own locks).
            let ok = unsafe {
                libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20) == 1
                    && libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20) == 1
            };
            if !ok {
                tracing::debug!(
                    "glibc refused the malloc thresholds; large downloads fault pages in afresh"
                );
            }
        });
    }
}

/// Transfers smaller than this go straight from or to pageable memory (no lock, no copy).
const STAGED_MIN_BYTES: usize = 256 << 10;

/// Copies past this size are split across threads.
const PARALLEL_COPY_BYTES: usize = 4 << 20;

/// `dst = src` (same length), in 1 MiB pieces on the thread pool for large copies: one thread
/// copies a few GB/s, and the ViT's patches or an image's embeddings at 1344x1344 are 40-60
/// MB (a fresh destination's pages are then also faulted in by many threads at once).
fn copy<T: Pod + Send + Sync>(dst: &mut [T], src: &[T]) {
    if std::mem::size_of_val(src) < PARALLEL_COPY_BYTES {
        dst.copy_from_slice(src);
        return;
    }
    let piece = (1 << 20) / std::mem::size_of::<T>().max(1);
    dst.par_chunks_mut(piece)
        .zip(src.par_chunks(piece))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

/// Grown to the largest transfer seen (a batch's logits, an image's embeddings), kept after.
/// Bytes, viewed as whatever element type a transfer moves (the buffer is page-aligned).
pub(super) struct Staging {
    buf: Mutex<Slot>,
}

#[derive(Default)]
struct Slot {
    pinned: Option<PinnedHostSlice<u8>>,
    /// Recorded on the stream after the last upload's copy out of `pinned`: the buffer is not
    /// written again (nor freed) before it completes. An upload returns once its copy is
    /// queued, so the host goes on queueing work (the next image's pass) while the GPU still
    /// runs what came before; it used to wait for the whole stream after every upload.
    copy_done: Option<CudaEvent>,
}

impl Drop for Slot {
    /// The page-locked memory outlives the copy out of it that may still be queued.
    fn drop(&mut self) {
        if let Some(event) = &self.copy_done {
            let _ = event.synchronize();
        }
    }
}

impl Staging {
    pub(super) fn new() -> Self {
        Self {
            buf: Mutex::new(Slot::default()),
        }
    }

    /// The first `len` elements of `src` to a fresh `Vec`: through the page-locked buffer,
    /// or straight from the device below [`STAGED_MIN_BYTES`].
    pub(super) fn download<T: DeviceRepr + Pod + Send + Sync>(
        &self,
        stream: &Arc<CudaStream>,
        src: &CudaSlice<T>,
        len: usize,
    ) -> Result<Vec<T>> {
        if len * std::mem::size_of::<T>() < STAGED_MIN_BYTES {
            let mut v = stream
                .clone_dtoh(src)
                .map_err(|e| cuda_err("download")(&e))?;
            v.truncate(len);
            return Ok(v);
        }
        let mut guard = self.buf.lock().unwrap_or_else(|e| e.into_inner());
        let host = Self::view::<T>(&mut guard, stream, len)?;
        // Into page-locked memory the copy is truly asynchronous (cudarc waits only for
        // pageable destinations, where the driver does): wait for it before reading. Stream
        // order puts it after any upload still reading the buffer.
        stream
            .memcpy_dtoh(&src.slice(..len), host)
            .and_then(|()| stream.synchronize())
            .map_err(|e| cuda_err("download")(&e))?;
        let mut out = vec![T::zeroed(); len];
        copy(&mut out, host);
        Ok(out)
    }

    /// `data` into a new device buffer: through the page-locked buffer, or straight from
    /// `data` below [`STAGED_MIN_BYTES`].
    pub(super) fn upload<T: DeviceRepr + Pod + Send + Sync>(
        &self,
        stream: &Arc<CudaStream>,
        data: &[T],
    ) -> Result<CudaSlice<T>> {
        if std::mem::size_of_val(data) < STAGED_MIN_BYTES {
            return stream.clone_htod(data).map_err(|e| cuda_err("upload")(&e));
        }
        // SAFETY: every element is written by `write` before anything reads it.
        let mut buf =
            unsafe { stream.alloc::<T>(data.len()) }.map_err(|e| cuda_err("upload")(&e))?;
        self.write(stream, data, &mut buf)?;
        Ok(buf)
    }

    /// `data` into the device buffer `dst` (of `data.len()` elements at least), as
    /// [`Self::upload`] moves it.
    pub(super) fn write<T: DeviceRepr + Pod + Send + Sync>(
        &self,
        stream: &Arc<CudaStream>,
        data: &[T],
        dst: &mut CudaSlice<T>,
    ) -> Result<()> {
        let mut dst = dst.slice_mut(..data.len());
        if std::mem::size_of_val(data) < STAGED_MIN_BYTES {
            return stream
                .memcpy_htod(data, &mut dst)
                .map_err(|e| cuda_err("upload")(&e));
        }
        let mut guard = self.buf.lock().unwrap_or_else(|e| e.into_inner());
        let host = Self::view::<T>(&mut guard, stream, data.len())?;
        copy(host, data);
        stream
            .memcpy_htod(&*host, &mut dst)
            .map_err(|e| cuda_err("upload")(&e))?;
        // The next transfer waits for this before it touches the buffer (see Slot).
        let done = match guard.copy_done.take() {
            Some(event) => event.record(stream).map(|()| event),
            None => stream.record_event(None),
        };
        guard.copy_done = Some(done.map_err(|e| cuda_err("upload")(&e))?);
        Ok(())
    }

    /// The first `len` elements of the buffer as `T`s, grown first if it is smaller, once the
    /// last upload's copy out of it is done.
    fn view<'a, T: Pod>(
        slot: &'a mut Slot,
        stream: &Arc<CudaStream>,
        len: usize,
    ) -> Result<&'a mut [T]> {
        if let Some(event) = &slot.copy_done {
            event
                .synchronize()
                .map_err(|e| cuda_err("waiting for the last upload")(&e))?;
        }
        let bytes = len * std::mem::size_of::<T>();
        let slot = &mut slot.pinned;
        if slot.as_ref().is_none_or(|p| p.len() < bytes) {
            // The old buffer is freed before the larger one is taken.
            *slot = None;
            // Flags 0: cached, readable by the host at full speed (cudarc's default is
            // write-combined, which the host reads very slowly).
            let ctx = stream.context();
            // SAFETY: bytes are valid for any bits; the buffer is written before it is read.
            let fresh = unsafe { ctx.alloc_pinned_with_flags::<u8>(bytes.next_power_of_two(), 0) }
                .map_err(|e| Error::Cuda {
                    what: format!(
                        "allocating {} MB of page-locked host memory: {e}",
                        bytes >> 20
                    ),
                })?;
            *slot = Some(fresh);
        }
        let pinned = slot.as_mut().expect("just set");
        let all = pinned.as_mut_slice().map_err(|e| cuda_err("staging")(&e))?;
        // Page-aligned, so any element type's alignment holds.
        Ok(bytemuck::cast_slice_mut(&mut all[..bytes]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_copies_split_across_threads_copy_every_element() {
        for n in [3, (PARALLEL_COPY_BYTES / 4) + 12_345] {
            let src: Vec<u32> = (0..n as u32)
                .map(|i| i.wrapping_mul(2_654_435_761))
                .collect();
            let mut dst = vec![0u32; n];
            copy(&mut dst, &src);
            assert_eq!(dst, src, "{n} elements");
        }
    }
}
