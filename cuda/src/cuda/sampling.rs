//! Each row's next token on the device: the launches of `sampling_f32.cu`, the GPU twin of
//! [`crate::sampling`]. Three passes spread each row over several blocks (the processed
//! logits, a histogram of the candidates, the few that can be kept compacted), then one block
//! a row applies the exact rule to those few and draws.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::CudaBackend;
use crate::backend::SampleIo;
use crate::sampling::{
    mask_words, split_for, work_words, LOGPROB_COLS, MAX_TOP_LOGPROBS, SAMPLE_WORDS,
};
use crate::{Error, Result};

/// Threads of the last kernel's block, one a row (`S_THREADS`).
const SAMPLE_THREADS: u32 = 512;
/// Threads of the spread passes' blocks (`S_PREP_THREADS`).
const PREPARE_THREADS: u32 = 512;

impl CudaBackend {
    pub(super) fn sample_rows_impl(
        &self,
        logits: &super::CudaTensor,
        io: SampleIo<'_, Self>,
    ) -> Result<()> {
        let (rows, vocab) = (logits.rows(), logits.cols());
        if io.params.len < rows * SAMPLE_WORDS
            || io.masks.len < rows * mask_words(vocab)
            || io.picks.len < rows
            || io.logprobs.len() < rows * LOGPROB_COLS
            || io.top_ids.len < rows * MAX_TOP_LOGPROBS
            || io.scratch.len() < rows * vocab
            || io.work.len < work_words(rows)
            || vocab == 0
        {
            return Err(Error::shape(
                "sample_rows",
                format!("{rows} rows of {:?} into buffers too small", logits.shape),
            ));
        }
        if rows == 0 {
            return Ok(());
        }
        let split = split_for(rows);
        let (v, r, k) = (vocab as i32, rows as i32, split as i32);
        let scratch = self.unshared(io.scratch)?;
        let spread = LaunchConfig {
            grid_dim: ((rows * split) as u32, 1, 1),
            block_dim: (PREPARE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY (all four): each matches its kernel in sampling_f32.cu; every buffer was
        // checked against the rows above (the work buffer against work_words, which sizes the
        // kernels' SWork for these rows and split; the masks against a full row each). Bias
        // entries and count slots are the engine's: tokens it checked against the vocabulary,
        // slots of the table it allocated.
        let name = "sample_prepare_f32";
        let mut l = self.inner.stream.launch_builder(self.kernel(name));
        l.arg(&*logits.buf)
            .arg(&v)
            .arg(&io.params.buf)
            .arg(&io.bias.buf)
            .arg(&io.masks.buf)
            .arg(&io.counts.buf)
            .arg(&mut *scratch)
            .arg(&mut io.work.buf)
            .arg(&r)
            .arg(&k);
        self.launched(name, unsafe { l.launch(spread) }.map(|_| ()))?;
        for name in ["sample_histogram_f32", "sample_compact_f32"] {
            let mut l = self.inner.stream.launch_builder(self.kernel(name));
            l.arg(&v)
                .arg(&io.params.buf)
                .arg(&*scratch)
                .arg(&mut io.work.buf)
                .arg(&r)
                .arg(&k);
            self.launched(name, unsafe { l.launch(spread) }.map(|_| ()))?;
        }
        let name = "sample_rows_f32";
        let logprobs = self.unshared(io.logprobs)?;
        let mut l = self.inner.stream.launch_builder(self.kernel(name));
        l.arg(&*logits.buf)
            .arg(&v)
            .arg(&io.params.buf)
            .arg(&io.bias.buf)
            .arg(&mut io.counts.buf)
            .arg(&mut *scratch)
            .arg(&mut io.picks.buf)
            .arg(logprobs)
            .arg(&mut io.top_ids.buf)
            .arg(&mut io.work.buf)
            .arg(&r)
            .arg(&k);
        let one_a_row = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (SAMPLE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launched(name, unsafe { l.launch(one_a_row) }.map(|_| ()))
    }
}
