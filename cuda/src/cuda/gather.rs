//! Rows moved by index: the embedding lookup, gathers (plain and weighted), row slices,
//! scatters and adds into rows, and the ViT's patches
//! gathered from an image's bytes.

use std::sync::Arc;

use cudarc::driver::PushKernelArg;

use super::error::cuda_err;
use super::{CudaBackend, CudaIds, CudaTensor, CudaWeight};
use crate::patches::PatchLayout;
use crate::{Error, Result};

impl CudaBackend {
    pub(super) fn embedding_impl(&self, table: &CudaWeight, ids: &CudaIds) -> Result<CudaTensor> {
        let [vocab, h] = table.shape[..] else {
            return Err(Error::shape(
                "embedding",
                format!("table must be 2-D, got {:?}", table.shape),
            ));
        };
        let Some(table_buf) = table.as_f16() else {
            return Err(Error::shape(
                "embedding",
                "the embedding table is quantized; tables stay f16",
            ));
        };
        let n = ids.len;
        let mut out = self.alloc(vec![n, h])?;
        if n == 0 {
            return Ok(out);
        }
        let (hh, vv) = (h as i32, vocab as u32);
        let name = "embedding_f16w";
        let mut l = self.inner.stream.launch_builder(self.kernel(name));
        l.arg(&**table_buf)
            .arg(&ids.buf)
            .arg(Arc::get_mut(&mut out.buf).expect("fresh"))
            .arg(&hh)
            .arg(&vv);
        // SAFETY: matches embedding_f16w; the kernel bounds-checks every id.
        self.launched(name, unsafe { l.launch(Self::row_config(n)) }.map(|_| ()))?;
        Ok(out)
    }

    pub(super) fn gather_rows_impl(&self, x: &CudaTensor, rows: &CudaIds) -> Result<CudaTensor> {
        let c = x.cols();
        let mut out = self.alloc(vec![rows.len, c])?;
        if rows.len == 0 {
            return Ok(out);
        }
        let (cc, nr) = (c as i32, x.rows() as u32);
        let name = "gather_rows_f32";
        let mut l = self.inner.stream.launch_builder(self.kernel(name));
        l.arg(&*x.buf)
            .arg(&rows.buf)
            .arg(Arc::get_mut(&mut out.buf).expect("fresh"))
            .arg(&cc)
            .arg(&nr);
        // SAFETY: matches gather_rows_f32; rows outside x give NaN rows, never a stray read.
        self.launched(
            name,
            unsafe { l.launch(Self::row_config(rows.len)) }.map(|_| ()),
        )?;
        Ok(out)
    }

    pub(super) fn patchify_impl(
        &self,
        rgb: &[u8],
        height: usize,
        width: usize,
        table: &[f32],
        layout: PatchLayout,
    ) -> Result<CudaTensor> {
        let (gh, gw) = layout.grid(height, width, rgb.len(), table.len())?;
        let stream = &self.inner.stream;
        let rgb = self.inner.staging.upload(stream, rgb)?;
        let table = stream
            .clone_htod(table)
            .map_err(|e| cuda_err("uploading a patch table")(&e))?;
        let mut out = self.alloc(vec![gh * gw, layout.patch_dim()])?;
        let (w, gw_i) = (width as i32, gw as i32);
        let (p, m, t) = (
            layout.patch as i32,
            layout.merge as i32,
            layout.temporal as i32,
        );
        let name = "patchify_rgb_f32";
        let mut l = self.inner.stream.launch_builder(self.kernel(name));
        l.arg(&rgb)
            .arg(&table)
            .arg(Arc::get_mut(&mut out.buf).expect("fresh"))
            .arg(&w)
            .arg(&gw_i)
            .arg(&p)
            .arg(&m)
            .arg(&t);
        // SAFETY: matches patchify_rgb_f32; grid() checked that rgb holds every pixel's bytes,
        // that the grid is whole merge windows and that the table has 3 x 256 entries.
        self.launched(
            name,
            unsafe { l.launch(Self::row_config(gh * gw)) }.map(|_| ()),
        )?;
        Ok(out)
    }

    pub(super) fn weighted_gather_impl(
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

    pub(super) fn slice_rows_impl(
        &self,
        x: &CudaTensor,
        start: usize,
        end: usize,
    ) -> Result<CudaTensor> {
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

    /// `dst[rows[i]] (+)= src[i]` with rows of `width` elements.
    pub(super) fn scatter(
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
        let buf = self.unshared(dst)?;
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
