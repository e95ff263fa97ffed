//! Each row's next token on the device: the launch of `sampling_f32.cu`, the GPU twin of
//! [`crate::sampling`].

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::CudaBackend;
use crate::backend::SampleIo;
use crate::sampling::{LOGPROB_COLS, MAX_TOP_LOGPROBS, SAMPLE_WORDS};
use crate::{Error, Result};

/// Threads of a row's block (`S_THREADS` in the kernel).
const SAMPLE_THREADS: u32 = 1024;

impl CudaBackend {
    pub(super) fn sample_rows_impl(
        &self,
        logits: &super::CudaTensor,
        io: SampleIo<'_, Self>,
    ) -> Result<()> {
        let (rows, vocab) = (logits.rows(), logits.cols());
        if io.params.len < rows * SAMPLE_WORDS
            || io.picks.len < rows
            || io.logprobs.len() < rows * LOGPROB_COLS
            || io.top_ids.len < rows * MAX_TOP_LOGPROBS
            || io.scratch.len() < rows * vocab
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
        let name = "sample_rows_f32";
        let v = vocab as i32;
        let scratch = self.unshared(io.scratch)?;
        let logprobs = self.unshared(io.logprobs)?;
        let mut l = self.inner.stream.launch_builder(self.kernel(name));
        l.arg(&*logits.buf)
            .arg(&v)
            .arg(&io.params.buf)
            .arg(&io.bias.buf)
            .arg(&mut io.counts.buf)
            .arg(scratch)
            .arg(&mut io.picks.buf)
            .arg(logprobs)
            .arg(&mut io.top_ids.buf);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (SAMPLE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches sample_rows_f32, one block a row; every buffer was checked against
        // the rows above. Bias entries and count slots are the engine's (checked tokens, slots
        // of the table it allocated).
        self.launched(name, unsafe { l.launch(cfg) }.map(|_| ()))
    }
}
