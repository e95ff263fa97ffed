//! One engine step on the device: the scheduler's plan turned into the model's inputs (token
//! ids, M-RoPE tables, cache slots, block lists, image rows), the forward pass, and the picked
//! tokens (and, where a sequence needs them, its logits) brought back.
//!
//! Steps where every sequence decodes one token and no image is involved are replayed from a
//! recording ([`Backend::record`], a CUDA graph), one per batch-size bucket: the inputs are
//! written into buffers that stay put, the batch is padded to the bucket with rows that write
//! to the null block, and one launch runs the whole step. Other steps (prefill chunks mixed in)
//! run op by op with freshly uploaded inputs.

use std::ops::Range;
use std::time::{Duration, Instant};

use vlm_compute::{Backend, Embeddings, HostTensor, PagedBatch};

use crate::kv_cache::{PagedKv, NULL_BLOCK};
use crate::model::{ImageRows, LogitsOf, StepInput, TextModel};
use crate::mrope;
use crate::scheduler::Planned;
use crate::sequence::{PlacedImage, Sequence};
use crate::{Result, TextConfig};

/// Batch sizes decode steps are recorded for; a batch runs in the smallest that holds it.
const DECODE_BUCKETS: [usize; 12] = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256];

/// A step's inputs on the host.
struct HostStep<'a> {
    ids: Vec<u32>,
    positions: Vec<[u32; 3]>,
    slots: Vec<u32>,
    /// Per sequence: first row, rows, keys after the step, offset of its block list.
    seqs: Vec<u32>,
    blocks: Vec<u32>,
    decode_seqs: usize,
    max_queries: usize,
    max_keys: usize,
    /// Row of each sequence that samples this step (its last), in plan order.
    sample_rows: Vec<u32>,
    /// Rows holding image tokens, and the images they come from, in the same order: each with
    /// the range of its rows in this step.
    image_rows: Vec<usize>,
    image_parts: Vec<(&'a PlacedImage, Range<usize>)>,
    /// When the step began (what its `enqueue` time counts from).
    started: Instant,
}

impl<'a> HostStep<'a> {
    fn build(plan: &[Planned], running: &'a [Sequence], block_size: usize) -> Self {
        let mut s = HostStep {
            ids: Vec::new(),
            positions: Vec::new(),
            slots: Vec::new(),
            seqs: Vec::with_capacity(plan.len() * 4),
            blocks: Vec::new(),
            decode_seqs: plan.iter().take_while(|p| p.tokens == 1).count(),
            max_queries: 0,
            max_keys: 0,
            sample_rows: Vec::new(),
            image_rows: Vec::new(),
            image_parts: Vec::new(),
            started: Instant::now(),
        };
        for p in plan {
            let seq = &running[p.index];
            let (from, to) = (seq.computed, seq.computed + p.tokens);
            let row0 = s.ids.len();
            s.seqs
                .extend([row0, p.tokens, to, s.blocks.len()].map(|v| v as u32));
            let used = to.div_ceil(block_size);
            s.blocks.extend_from_slice(&seq.blocks[..used]);
            for i in from..to {
                s.ids.push(seq.tokens[i]);
                s.positions.push(seq.position(i));
                s.slots
                    .push(seq.blocks[i / block_size] * block_size as u32 + (i % block_size) as u32);
            }
            for (img, rows) in seq.image_parts(from..to) {
                let first = row0 + img.start + rows.start - from;
                s.image_rows.extend(first..first + rows.len());
                s.image_parts.push((img, rows));
            }
            if to == seq.tokens.len() {
                s.sample_rows.push((row0 + p.tokens - 1) as u32);
            }
            s.max_queries = s.max_queries.max(p.tokens);
            s.max_keys = s.max_keys.max(to);
        }
        s
    }

    /// Pads the step to `rows` single-token sequences that attend to and write the null
    /// block (a recorded step's batch size is fixed).
    fn pad_to(&mut self, rows: usize) {
        let null_list = self.blocks.len() as u32;
        self.blocks.push(NULL_BLOCK);
        for r in self.ids.len()..rows {
            self.ids.push(0);
            self.positions.push([0; 3]);
            self.slots.push(0);
            self.seqs.extend([r as u32, 1, 1, null_list]);
        }
    }
}

/// The embeddings and DeepStack features of a step's image rows, on the device, from `parts`
/// (each image with its rows in the step, in the step's order). An image wholly in the step
/// (the usual case: its tokens fit one prefill chunk) is uploaded from its own buffers; only
/// images split across chunks, or several in one step, are gathered into one buffer first.
fn upload_images<B: Backend>(
    be: &B,
    parts: &[(&PlacedImage, Range<usize>)],
) -> Result<Option<StepImages<B>>> {
    let whole = |img: &PlacedImage, rows: &Range<usize>| rows.start == 0 && rows.end == img.len;
    let images = match parts {
        [] => return Ok(None),
        [(img, rows)] if whole(img, rows) => StepImages {
            embeds: be.upload_embeddings(&img.embeds)?,
            deepstack: img
                .deepstack
                .iter()
                .map(|d| be.upload_embeddings(d))
                .collect::<vlm_compute::Result<_>>()?,
        },
        _ => {
            let gather = |pick: &dyn Fn(&PlacedImage) -> &Embeddings| {
                let rows: Vec<_> = parts
                    .iter()
                    .map(|(img, rows)| (pick(img), rows.clone()))
                    .collect();
                if rows.iter().all(|(e, _)| e.on_host()) {
                    be.upload_embeddings(&Embeddings::concat_rows(&rows)?)
                } else {
                    gather_on_device(be, &rows)
                }
            };
            let layers = parts[0].0.deepstack.len();
            StepImages {
                embeds: gather(&|img| &img.embeds)?,
                deepstack: (0..layers)
                    .map(|l| gather(&|img| &img.deepstack[l]))
                    .collect::<vlm_compute::Result<_>>()?,
            }
        }
    };
    Ok(Some(images))
}

/// The given rows of each part stacked on the device (some parts are there already).
fn gather_on_device<B: Backend>(
    be: &B,
    parts: &[(&Embeddings, Range<usize>)],
) -> vlm_compute::Result<B::Tensor> {
    let n = parts.iter().map(|(_, rows)| rows.len()).sum();
    let cols = parts[0].0.shape().last().copied().unwrap_or(1);
    let mut out = be.zeros(&[n, cols])?;
    let mut at = 0;
    for (e, rows) in parts {
        let all = be.upload_embeddings(e)?;
        let part = be.slice_rows(&all, rows.start, rows.end)?;
        let dst: Vec<usize> = (at..at + rows.len()).collect();
        be.scatter_rows(&mut out, &dst, &part)?;
        at += rows.len();
    }
    Ok(out)
}

/// A step's image rows on the device ([`upload_images`]).
struct StepImages<B: Backend> {
    embeds: B::Tensor,
    deepstack: Vec<B::Tensor>,
}

/// What a step gives back for each sequence that sampled, in plan order.
pub struct StepOutput {
    /// The most likely next token.
    pub greedy: Vec<u32>,
    /// The logits, for the sequences that asked for them (`need_logits`).
    pub logits: Vec<Option<Vec<f32>>>,
    /// Host time until all of the step's work was queued on the device (inputs built and
    /// uploaded, ops launched or the recording replayed); the rest of the step is waiting
    /// for the device and reading its results. Where a step's time goes, in the engine's log.
    /// A step whose chunks pick no token (a long prompt's first chunks) is not waited for, so
    /// the host may queue the next one meanwhile; some calls then wait for the device, and
    /// that wait counts here.
    pub enqueue: Duration,
}

/// A recorded decode step of `rows` sequences and the buffers it reads and writes.
struct DecodeGraph<B: Backend> {
    rows: usize,
    ids: B::Ids,
    slots: B::Ids,
    seqs: B::Ids,
    cos: B::Tensor,
    sin: B::Tensor,
    logits: B::Tensor,
    greedy: B::Ids,
    graph: B::Graph,
}

/// Whether this backend records steps.
enum Recording {
    Untried,
    Works,
    Unsupported,
}

pub struct StepRunner<B: Backend> {
    cfg: TextConfig,
    inv_freq: Vec<f32>,
    block_size: usize,
    /// Longest sequence: recorded steps size their attention grids (and block lists) for it.
    max_context: usize,
    max_batch: usize,
    recording: Recording,
    graphs: Vec<DecodeGraph<B>>,
    /// The block lists of a recorded step (shared by all buckets, one runs at a time).
    graph_blocks: Option<B::Ids>,
}

impl<B: Backend> StepRunner<B> {
    pub fn new(cfg: &TextConfig, block_size: usize, max_context: usize, max_batch: usize) -> Self {
        Self {
            cfg: cfg.clone(),
            inv_freq: mrope::inv_freq(cfg),
            block_size,
            max_context,
            max_batch,
            recording: Recording::Untried,
            graphs: Vec::new(),
            graph_blocks: None,
        }
    }

    /// Recorded decode steps so far (for logs).
    pub fn recorded_buckets(&self) -> Vec<usize> {
        self.graphs.iter().map(|g| g.rows).collect()
    }

    fn bucket(&self, n: usize) -> Option<usize> {
        DECODE_BUCKETS
            .iter()
            .copied()
            .find(|&b| b >= n)
            .filter(|&b| b <= self.max_batch.next_power_of_two().max(1))
    }

    /// Runs `plan` (sequences from `running`); `need_logits[i]` says whether the i-th sampling
    /// sequence wants its logits on the host.
    pub fn run(
        &mut self,
        model: &TextModel<B>,
        kv: &mut PagedKv<B>,
        plan: &[Planned],
        running: &[Sequence],
        need_logits: &[bool],
    ) -> Result<StepOutput> {
        let mut host = HostStep::build(plan, running, self.block_size);
        let decode_only = host.decode_seqs == plan.len()
            && host.sample_rows.len() == plan.len()
            && host.image_rows.is_empty();
        // While ops are timed (`vlm bench --profile`), every step runs op by op.
        let replayable =
            !matches!(self.recording, Recording::Unsupported) && !model.backend().timing_ops();
        if decode_only && replayable {
            if let Some(rows) = self.bucket(plan.len()) {
                host.pad_to(rows);
                if let Some(out) = self.replay(model, kv, &host, rows, plan.len(), need_logits)? {
                    return Ok(out);
                }
                let started = host.started;
                host = HostStep::build(plan, running, self.block_size);
                host.started = started;
            }
        }
        self.eager(model, kv, &host, need_logits)
    }

    /// The M-RoPE tables for `positions`.
    fn rope(&self, positions: &[[u32; 3]]) -> Result<(HostTensor, HostTensor)> {
        mrope::rope_tables(&self.cfg, &self.inv_freq, positions)
    }

    /// Picks and logits from a step's logits `[rows, vocab]` (the first `n` rows sampled), for
    /// a step that began at `started` and whose work is all queued now.
    fn outputs(
        be: &B,
        logits: &B::Tensor,
        greedy: &B::Ids,
        n: usize,
        need_logits: &[bool],
        started: Instant,
    ) -> Result<StepOutput> {
        let enqueue = started.elapsed();
        let greedy = be.download_ids(greedy, n)?;
        let mut out = vec![None; n];
        if need_logits.iter().any(|&w| w) {
            let host = be.download(logits)?;
            for (i, o) in out.iter_mut().enumerate() {
                if need_logits[i] {
                    *o = Some(host.row(i).to_vec());
                }
            }
        }
        Ok(StepOutput {
            greedy,
            logits: out,
            enqueue,
        })
    }

    fn eager(
        &mut self,
        model: &TextModel<B>,
        kv: &mut PagedKv<B>,
        host: &HostStep,
        need_logits: &[bool],
    ) -> Result<StepOutput> {
        let started = host.started;
        let be = model.backend();
        let (cos, sin) = self.rope(&host.positions)?;
        let (ids, slots) = (be.upload_ids(&host.ids)?, be.upload_ids(&host.slots)?);
        let (seqs, blocks) = (be.upload_ids(&host.seqs)?, be.upload_ids(&host.blocks)?);
        let sample_rows = be.upload_ids(&host.sample_rows)?;
        let images = upload_images(be, &host.image_parts)?;
        let (cos, sin) = (be.upload(&cos)?, be.upload(&sin)?);
        let prepared = started.elapsed();
        let step = StepInput {
            ids: &ids,
            cos: &cos,
            sin: &sin,
            slots: &slots,
            attn: PagedBatch {
                seqs: &seqs,
                blocks: &blocks,
                num_seqs: host.seqs.len() / 4,
                decode_seqs: host.decode_seqs,
                max_queries: host.max_queries,
                max_keys: host.max_keys,
                block_size: self.block_size,
            },
            images: images.as_ref().map(|img| ImageRows {
                rows: &host.image_rows,
                embeds: &img.embeds,
                deepstack: &img.deepstack,
            }),
            // Only prefill chunks that stop short of their prompt's end: nothing to pick.
            logits: if host.sample_rows.is_empty() {
                LogitsOf::Nothing
            } else {
                LogitsOf::Rows(&sample_rows)
            },
        };
        let n = host.sample_rows.len();
        let Some(logits) = model.forward(kv, &step)? else {
            tracing::debug!(
                rows = host.ids.len(),
                sequences = host.seqs.len() / 4,
                prepare_ms = prepared.as_secs_f64() * 1e3,
                enqueue_ms = started.elapsed().as_secs_f64() * 1e3,
                "step run op by op, not waited for (it picks no token)"
            );
            return Ok(StepOutput {
                greedy: Vec::new(),
                logits: Vec::new(),
                enqueue: started.elapsed(),
            });
        };
        let mut greedy = be.upload_ids(&vec![0; n])?;
        be.argmax_rows(&logits, &mut greedy)?;
        let out = Self::outputs(be, &logits, &greedy, n, need_logits, started)?;
        tracing::debug!(
            rows = host.ids.len(),
            sequences = host.seqs.len() / 4,
            prepare_ms = prepared.as_secs_f64() * 1e3,
            enqueue_ms = out.enqueue.as_secs_f64() * 1e3,
            total_ms = started.elapsed().as_secs_f64() * 1e3,
            "step run op by op"
        );
        Ok(out)
    }

    /// Replays (recording first if needed) the decode step for `rows` (padded) rows of which
    /// `n` are real; `None` if this backend does not record.
    fn replay(
        &mut self,
        model: &TextModel<B>,
        kv: &mut PagedKv<B>,
        host: &HostStep,
        rows: usize,
        n: usize,
        need_logits: &[bool],
    ) -> Result<Option<StepOutput>> {
        let started = host.started;
        let be = model.backend();
        if self.graph_blocks.is_none() {
            let per_seq = self.max_context.div_ceil(self.block_size);
            let cap = self.max_batch.next_power_of_two() * per_seq + 1;
            self.graph_blocks = Some(be.upload_ids(&vec![NULL_BLOCK; cap])?);
        }
        let at = match self.graphs.iter().position(|g| g.rows == rows) {
            Some(at) => at,
            None => match self.record(model, kv, rows)? {
                Some(g) => {
                    self.graphs.push(g);
                    self.graphs.len() - 1
                }
                None => return Ok(None),
            },
        };
        let (cos, sin) = self.rope(&host.positions)?;
        let blocks = self.graph_blocks.as_mut().expect("allocated above");
        be.write_ids(blocks, &host.blocks)?;
        let g = &mut self.graphs[at];
        be.write_ids(&mut g.ids, &host.ids)?;
        be.write_ids(&mut g.slots, &host.slots)?;
        be.write_ids(&mut g.seqs, &host.seqs)?;
        be.write(&mut g.cos, cos.data())?;
        be.write(&mut g.sin, sin.data())?;
        be.replay(&g.graph)?;
        let wanted: Vec<bool> = need_logits.iter().copied().take(n).collect();
        Self::outputs(be, &g.logits, &g.greedy, n, &wanted, started).map(Some)
    }

    /// Records the decode step for `rows` rows: `None` if the backend does not record (then
    /// it is never tried again) or recording failed (logged; steps run op by op).
    fn record(
        &mut self,
        model: &TextModel<B>,
        kv: &mut PagedKv<B>,
        rows: usize,
    ) -> Result<Option<DecodeGraph<B>>> {
        let be = model.backend();
        let d = self.cfg.head_dim;
        let vocab = self.cfg.vocab_size;
        let mut pad = HostStep {
            ids: Vec::new(),
            positions: Vec::new(),
            slots: Vec::new(),
            seqs: Vec::new(),
            blocks: Vec::new(),
            decode_seqs: 0,
            max_queries: 1,
            max_keys: 1,
            sample_rows: Vec::new(),
            image_rows: Vec::new(),
            image_parts: Vec::new(),
            started: Instant::now(),
        };
        pad.pad_to(rows);
        let ids = be.upload_ids(&pad.ids)?;
        let slots = be.upload_ids(&pad.slots)?;
        let seqs = be.upload_ids(&pad.seqs)?;
        let cos = be.zeros(&[rows, d])?;
        let sin = be.zeros(&[rows, d])?;
        let mut logits = be.zeros(&[rows, vocab])?;
        let mut greedy = be.upload_ids(&vec![0; rows])?;
        let blocks = self.graph_blocks.as_ref().expect("allocated by replay");
        let (block_size, max_context) = (self.block_size, self.max_context);
        let started = std::time::Instant::now();
        let recorded = be.record(&mut || {
            let step = StepInput {
                ids: &ids,
                cos: &cos,
                sin: &sin,
                slots: &slots,
                attn: PagedBatch {
                    seqs: &seqs,
                    blocks,
                    num_seqs: rows,
                    decode_seqs: rows,
                    max_queries: 1,
                    max_keys: max_context,
                    block_size,
                },
                images: None,
                logits: LogitsOf::AllRows,
            };
            let out = model.forward(kv, &step)?.expect("every row's logits");
            be.copy(&mut logits, &out)?;
            be.argmax_rows(&logits, &mut greedy)
        });
        match recorded {
            Ok(Some(graph)) => {
                self.recording = Recording::Works;
                tracing::debug!(
                    rows,
                    ms = started.elapsed().as_secs_f64() * 1e3,
                    "decode step recorded"
                );
                Ok(Some(DecodeGraph {
                    rows,
                    ids,
                    slots,
                    seqs,
                    cos,
                    sin,
                    logits,
                    greedy,
                    graph,
                }))
            }
            Ok(None) => {
                self.recording = Recording::Unsupported;
                Ok(None)
            }
            Err(e) => {
                // Slower, not wrong: the same ops run one by one.
                tracing::warn!(rows, error = %e, "decode step could not be recorded; running steps op by op");
                self.recording = Recording::Unsupported;
                Ok(None)
            }
        }
    }
}
