//! One engine step on the device: the scheduler's plan turned into the model's inputs (token
//! ids, M-RoPE tables, cache slots, block lists, image rows), the forward pass, each sampling
//! sequence's token picked on the device ([`Backend::sample_rows`]: greedy or drawn, with its
//! penalties, bias and logprobs), and the picks (and, where a sequence asked, its logits and
//! logprobs) brought back. The logits themselves stay on the device.
//!
//! Steps where every sequence decodes one token and no image is involved are replayed from a
//! recording ([`Backend::record`], a CUDA graph), one per batch-size bucket: the inputs are
//! written into buffers that stay put, the batch is padded to the bucket with rows that write
//! to the null block, and two launches run the whole step (the forward pass, then the
//! sampler). Other steps (prefill chunks mixed in) run op by op with freshly uploaded inputs.
//!
//! Sequences with a grammar ([`crate::grammar`]) have their token masks computed on the host
//! while the device runs the forward pass (in parallel, one task a sequence), then uploaded for
//! the sampler, which is queued after them. The step waits for them about as long as the
//! device needs anyway (the last step's time): a sequence whose mask is later than that takes
//! no pick this step and picks the same token the next (its draw is keyed by its position, and
//! its token counts are left alone), so a slow grammar holds back its own sequence only.

use std::ops::Range;
use std::time::{Duration, Instant};

use vlm_compute::sampling::{
    bias_words, mask_words, work_words, RowParams, IN_PROMPT, LOGPROB_COLS, MAX_TOP_LOGPROBS,
    NO_SLOT, SAMPLE_WORDS,
};
use vlm_compute::{Backend, Embeddings, HostTensor, PagedBatch, SampleIo};

use crate::grammar::StepMask;
use crate::kv_cache::{PagedKv, NULL_BLOCK};
use crate::model::{ImageRows, LogitsOf, StepInput, TextModel};
use crate::mrope;
use crate::sampler::{SamplerRow, TokenLogprob, MAX_LOGIT_BIAS};
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
    /// The sampler's row for each of them, their `logit_bias` entries (which the rows index)
    /// and whether each wants its logits on the host.
    draws: Vec<RowParams>,
    bias: Vec<(u32, f32)>,
    need_logits: Vec<bool>,
    /// The sampling sequences with a grammar, each with its index in `draws`.
    constrained: Vec<(usize, &'a Sequence)>,
    /// Whether each of `draws` takes no pick this step: its grammar's mask came too late.
    late: Vec<bool>,
    /// Rows holding image tokens, and the images they come from, in the same order: each with
    /// the range of its rows in this step.
    image_rows: Vec<usize>,
    image_parts: Vec<(&'a PlacedImage, Range<usize>)>,
    /// When the step began (what its `enqueue` time counts from).
    started: Instant,
}

impl<'a> HostStep<'a> {
    fn build(
        plan: &[Planned],
        running: &'a [Sequence],
        block_size: usize,
        counts: &CountSlots,
    ) -> Self {
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
            draws: Vec::new(),
            bias: Vec::new(),
            need_logits: Vec::new(),
            constrained: Vec::new(),
            late: Vec::new(),
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
                let sampling = &seq.sampling;
                let slot = counts.slot_of(seq.id);
                s.draws
                    .push(sampling.row(seq.seed, seq.tokens.len(), slot, s.bias.len()));
                s.bias.extend_from_slice(&sampling.logit_bias);
                s.need_logits.push(seq.limits.return_logits);
                if seq.grammar.is_some() {
                    s.constrained.push((s.draws.len() - 1, seq));
                }
            }
            s.max_queries = s.max_queries.max(p.tokens);
            s.max_keys = s.max_keys.max(to);
        }
        s
    }

    /// The constrained sequences' masks, computed in parallel and waited for until
    /// `deadline`: the words to upload (rows up to the last masked one, [`mask_words`] each;
    /// rows in between unread) with each masked draw flagged, and how long the host took. A
    /// sequence whose grammar has not started (or has failed, which ends it after the step)
    /// samples unmasked; one whose mask is late samples nothing that counts (its draw
    /// updates no token counts, and its pick is dropped).
    fn masks(&mut self, vocab: usize, deadline: Instant) -> (Vec<u32>, Duration) {
        let started = Instant::now();
        self.late = vec![false; self.draws.len()];
        if self.constrained.is_empty() {
            return (Vec::new(), Duration::ZERO);
        }
        let grammars: Vec<_> = self
            .constrained
            .iter()
            .map(|(_, seq)| {
                seq.grammar
                    .as_ref()
                    .expect("constrained sequences have one")
            })
            .collect();
        let masks = crate::grammar::masks_by(&grammars, deadline);
        let words = mask_words(vocab);
        let draws: Vec<usize> = self.constrained.iter().map(|&(d, _)| d).collect();
        let rows = draws
            .iter()
            .zip(&masks)
            .filter(|(_, m)| matches!(m, StepMask::Mask(_)))
            .map(|(d, _)| d + 1)
            .max()
            .unwrap_or(0);
        let mut all = vec![0u32; rows * words];
        for (draw, mask) in draws.into_iter().zip(masks) {
            match mask {
                StepMask::Mask(mask) => {
                    all[draw * words..(draw + 1) * words].copy_from_slice(&mask);
                    self.draws[draw].masked = true;
                }
                StepMask::Free => {}
                StepMask::Late => {
                    self.late[draw] = true;
                    self.draws[draw].slot = NO_SLOT;
                    self.draws[draw].logprobs = 0;
                }
            }
        }
        (all, started.elapsed())
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
            self.draws.push(RowParams::default());
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
    /// The picked tokens; `None` for a sequence whose grammar's mask came too late for the
    /// step (it computes its last token again and picks next step, as it would have).
    pub picks: Vec<Option<u32>>,
    /// The logits, for the sequences that asked for them (`return_logits`).
    pub logits: Vec<Option<Vec<f32>>>,
    /// The picks' logprobs, for the sequences that asked for them.
    pub logprobs: Vec<Option<TokenLogprob>>,
    /// Host time until all of the step's work was queued on the device (inputs built and
    /// uploaded, ops launched or the recording replayed); the rest of the step is waiting
    /// for the device and reading its results. Where a step's time goes, in the engine's log.
    /// A step whose chunks pick no token (a long prompt's first chunks) is not waited for, so
    /// the host may queue the next one meanwhile; some calls then wait for the device, and
    /// that wait counts here.
    pub enqueue: Duration,
    /// Host time spent computing the grammars' token masks (zero without grammars); it
    /// overlaps the forward pass on the device.
    pub masks: Duration,
}

/// The sampler's outputs for a step of `rows` rows, and its parameter words.
struct SampleOut<B: Backend> {
    params: B::Ids,
    picks: B::Ids,
    logprobs: B::Tensor,
    top_ids: B::Ids,
}

impl<B: Backend> SampleOut<B> {
    fn new(be: &B, rows: usize) -> Result<Self> {
        Ok(Self {
            params: be.upload_ids(&vec![0; rows * SAMPLE_WORDS])?,
            picks: be.upload_ids(&vec![0; rows])?,
            logprobs: be.zeros(&[rows, LOGPROB_COLS])?,
            top_ids: be.upload_ids(&vec![0; rows * MAX_TOP_LOGPROBS])?,
        })
    }
}

/// A recorded decode step of `rows` sequences and the buffers it reads and writes: the
/// forward pass and the sampler recorded apart, so that grammars' masks can be computed
/// while the first runs and uploaded before the second.
struct DecodeGraph<B: Backend> {
    rows: usize,
    ids: B::Ids,
    slots: B::Ids,
    seqs: B::Ids,
    cos: B::Tensor,
    sin: B::Tensor,
    logits: B::Tensor,
    out: SampleOut<B>,
    forward: B::Graph,
    sample: B::Graph,
}

/// Whether this backend records steps.
enum Recording {
    Untried,
    Works,
    Unsupported,
}

/// Which row of the device's token-count table each sequence with penalties uses. A slot is
/// taken the first step a sequence samples and filled from its tokens (prompt tokens flagged,
/// generated ones counted); the sampler adds each pick. A slot whose sequence has left the
/// running set (finished, cancelled or preempted) is free again: a preempted sequence gets a
/// slot filled anew when it runs again. There are as many slots as sequences can run.
pub struct CountSlots {
    owners: Vec<Option<u64>>,
}

impl CountSlots {
    fn new(slots: usize) -> Self {
        Self {
            owners: vec![None; slots],
        }
    }

    fn slot_of(&self, seq: u64) -> Option<u32> {
        self.owners
            .iter()
            .position(|o| *o == Some(seq))
            .map(|s| s as u32)
    }

    /// Gives every sequence of `plan` that samples with penalties a slot, filling new ones.
    fn assign<B: Backend>(
        &mut self,
        be: &B,
        table: &mut B::Ids,
        vocab: usize,
        plan: &[Planned],
        running: &[Sequence],
    ) -> Result<()> {
        // The sequences that sample this step with penalties and have no slot yet.
        let new: Vec<&Sequence> = plan
            .iter()
            .map(|p| (p, &running[p.index]))
            .filter(|(p, seq)| {
                seq.sampling.needs_counts()
                    && seq.computed + p.tokens == seq.tokens.len()
                    && self.slot_of(seq.id).is_none()
            })
            .map(|(_, seq)| seq)
            .collect();
        if new.is_empty() {
            return Ok(());
        }
        let live: std::collections::HashSet<u64> = running.iter().map(|s| s.id).collect();
        for o in self.owners.iter_mut() {
            if o.is_some_and(|id| !live.contains(&id)) {
                *o = None;
            }
        }
        for seq in new {
            let slot = self
                .owners
                .iter()
                .position(Option::is_none)
                .expect("a slot for every running sequence");
            self.owners[slot] = Some(seq.id);
            let mut row = vec![0u32; vocab];
            for &t in &seq.tokens[..seq.prompt_len] {
                row[t as usize] |= IN_PROMPT;
            }
            for &t in &seq.tokens[seq.prompt_len..] {
                row[t as usize] += 1;
            }
            be.write_ids_at(table, slot * vocab, &row)?;
        }
        Ok(())
    }
}

/// The sampler's buffers every step shares: the token counts, the processed logits' room and
/// the bias entries of a recorded step (one step runs at a time).
struct SamplerState<B: Backend> {
    counts: B::Ids,
    slots: CountSlots,
    scratch: B::Tensor,
    graph_bias: B::Ids,
    /// The grammars' token masks, [`mask_words`] a row, for the largest step.
    masks: B::Ids,
    /// What the device's sampling passes hand each other, sized for the largest step.
    work: B::Ids,
}

impl<B: Backend> SamplerState<B> {
    /// The step's picks from `logits` into `out`, with `bias` as its `logit_bias` entries (a
    /// recorded step's: `None`, the buffer written before each replay) and the shared
    /// buffers.
    fn sample(
        &mut self,
        be: &B,
        logits: &B::Tensor,
        out: &mut SampleOut<B>,
        bias: Option<&B::Ids>,
    ) -> vlm_compute::Result<()> {
        be.sample_rows(
            logits,
            SampleIo {
                params: &out.params,
                bias: bias.unwrap_or(&self.graph_bias),
                masks: &self.masks,
                counts: &mut self.counts,
                scratch: &mut self.scratch,
                picks: &mut out.picks,
                logprobs: &mut out.logprobs,
                top_ids: &mut out.top_ids,
                work: &mut self.work,
            },
        )
    }
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
    sampler: Option<SamplerState<B>>,
    /// How long a step waits for its grammars' masks once its forward pass is queued: as
    /// long as the last step that picked took with no mask late (about the time the device is
    /// busy anyway), and at least [`MIN_MASK_WAIT`].
    mask_wait: Duration,
}

/// The least a step waits for its masks. A mask takes well under this (`vlm bench` reports
/// the p99 at each batch size); a grammar slower than it costs its own sequence steps, not
/// the others.
const MIN_MASK_WAIT: Duration = Duration::from_millis(2);

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
            sampler: None,
            mask_wait: MIN_MASK_WAIT,
        }
    }

    /// Device bytes of the sampler's shared buffers for `max_batch` sequences (for the KV
    /// cache's sizing): the count table, the processed logits' room, the masks and the work
    /// buffer.
    pub fn sampler_bytes(cfg: &TextConfig, max_batch: usize) -> usize {
        let rows = max_batch.next_power_of_two();
        let masks = rows * mask_words(cfg.vocab_size);
        (2 * rows * cfg.vocab_size + masks + work_words(rows.max(256))) * 4
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

    /// Runs `plan` (sequences from `running`): the forward pass and each sampling sequence's
    /// pick.
    pub fn run(
        &mut self,
        model: &TextModel<B>,
        kv: &mut PagedKv<B>,
        plan: &[Planned],
        running: &[Sequence],
    ) -> Result<StepOutput> {
        let be = model.backend();
        let vocab = self.cfg.vocab_size;
        if self.sampler.is_none() {
            let rows = self.max_batch.next_power_of_two();
            self.sampler = Some(SamplerState {
                counts: be.upload_ids(&vec![0; rows * vocab])?,
                slots: CountSlots::new(self.max_batch),
                scratch: be.zeros(&[rows, vocab])?,
                graph_bias: be.upload_ids(&vec![0; 2 * rows * MAX_LOGIT_BIAS + 2])?,
                masks: be.upload_ids(&vec![0; rows * mask_words(vocab)])?,
                work: be.upload_ids(&vec![0; (1..=rows).map(work_words).max().unwrap_or(0)])?,
            });
        }
        let sampler = self.sampler.as_mut().expect("made above");
        sampler
            .slots
            .assign(be, &mut sampler.counts, vocab, plan, running)?;
        let mut host = HostStep::build(plan, running, self.block_size, &sampler.slots);
        let decode_only = host.decode_seqs == plan.len()
            && host.sample_rows.len() == plan.len()
            && host.image_rows.is_empty();
        // While ops are timed (`vlm bench --profile`), every step runs op by op.
        let replayable =
            !matches!(self.recording, Recording::Unsupported) && !model.backend().timing_ops();
        let mut out = None;
        if decode_only && replayable {
            if let Some(rows) = self.bucket(plan.len()) {
                host.pad_to(rows);
                out = self.replay(model, kv, &mut host, rows, plan.len())?;
                if out.is_none() {
                    let started = host.started;
                    let slots = &self.sampler.as_ref().expect("made above").slots;
                    host = HostStep::build(plan, running, self.block_size, slots);
                    host.started = started;
                }
            }
        }
        let out = match out {
            Some(out) => out,
            None => self.eager(model, kv, &mut host)?,
        };
        // A step with a late mask waited out its deadline: its time says nothing new.
        if !out.picks.is_empty() && out.picks.iter().all(Option::is_some) {
            self.mask_wait = host.started.elapsed().max(MIN_MASK_WAIT);
        }
        Ok(out)
    }

    /// The M-RoPE tables for `positions`.
    fn rope(&self, positions: &[[u32; 3]]) -> Result<(HostTensor, HostTensor)> {
        mrope::rope_tables(&self.cfg, &self.inv_freq, positions)
    }

    /// The picks (and what else was asked for) of a step whose sampler wrote `out` for its
    /// first `host.draws` rows (the first `n` real), from logits `[rows, vocab]`, once all of
    /// the step's work is queued.
    fn outputs(
        be: &B,
        logits: &B::Tensor,
        out: &SampleOut<B>,
        host: &HostStep,
        n: usize,
        masks: Duration,
    ) -> Result<StepOutput> {
        let enqueue = host.started.elapsed();
        let picks = be
            .download_ids(&out.picks, n)?
            .into_iter()
            .enumerate()
            .map(|(i, t)| (!host.late.get(i).copied().unwrap_or(false)).then_some(t))
            .collect();
        let mut logits_out = vec![None; n];
        if host.need_logits.iter().any(|&w| w) {
            let all = be.download(logits)?;
            for (i, o) in logits_out.iter_mut().enumerate() {
                if host.need_logits[i] {
                    *o = Some(all.row(i).to_vec());
                }
            }
        }
        let mut logprobs = vec![None; n];
        if host.draws[..n].iter().any(|d| d.logprobs > 0) {
            let values = be.download(&out.logprobs)?;
            let ids = be.download_ids(&out.top_ids, n * MAX_TOP_LOGPROBS)?;
            for (i, o) in logprobs.iter_mut().enumerate() {
                let asked = host.draws[i].logprobs as usize;
                if asked == 0 {
                    continue;
                }
                let row = values.row(i);
                let top = (0..asked - 1)
                    .map(|j| (ids[i * MAX_TOP_LOGPROBS + j], row[1 + j]))
                    .collect();
                *o = Some(TokenLogprob {
                    logprob: row[0],
                    top,
                });
            }
        }
        Ok(StepOutput {
            picks,
            logits: logits_out,
            logprobs,
            enqueue,
            masks,
        })
    }

    fn eager(
        &mut self,
        model: &TextModel<B>,
        kv: &mut PagedKv<B>,
        host: &mut HostStep,
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
                picks: Vec::new(),
                logits: Vec::new(),
                logprobs: Vec::new(),
                enqueue: started.elapsed(),
                masks: Duration::ZERO,
            });
        };
        // The forward pass is queued: the masks are computed while it runs.
        let (masks, mask_time) = host.masks(self.cfg.vocab_size, Instant::now() + self.mask_wait);
        let mut out = SampleOut::new(be, n)?;
        let words: Vec<u32> = host.draws.iter().flat_map(|d| d.to_words()).collect();
        be.write_ids(&mut out.params, &words)?;
        let bias = be.upload_ids(&[bias_words(&host.bias), vec![0, 0]].concat())?;
        let sampler = self.sampler.as_mut().expect("made by run");
        if !masks.is_empty() {
            be.write_ids(&mut sampler.masks, &masks)?;
        }
        sampler.sample(be, &logits, &mut out, Some(&bias))?;
        let result = Self::outputs(be, &logits, &out, host, n, mask_time)?;
        tracing::debug!(
            rows = host.ids.len(),
            sequences = host.seqs.len() / 4,
            prepare_ms = prepared.as_secs_f64() * 1e3,
            enqueue_ms = result.enqueue.as_secs_f64() * 1e3,
            total_ms = started.elapsed().as_secs_f64() * 1e3,
            "step run op by op"
        );
        Ok(result)
    }

    /// Replays (recording first if needed) the decode step for `rows` (padded) rows of which
    /// `n` are real; `None` if this backend does not record.
    fn replay(
        &mut self,
        model: &TextModel<B>,
        kv: &mut PagedKv<B>,
        host: &mut HostStep,
        rows: usize,
        n: usize,
    ) -> Result<Option<StepOutput>> {
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
        if !host.bias.is_empty() {
            let sampler = self.sampler.as_mut().expect("made by run");
            be.write_ids(&mut sampler.graph_bias, &bias_words(&host.bias))?;
        }
        let g = &mut self.graphs[at];
        be.write_ids(&mut g.ids, &host.ids)?;
        be.write_ids(&mut g.slots, &host.slots)?;
        be.write_ids(&mut g.seqs, &host.seqs)?;
        be.write(&mut g.cos, cos.data())?;
        be.write(&mut g.sin, sin.data())?;
        be.replay(&g.forward)?;
        // The forward pass is queued: the masks are computed while it runs.
        let deadline = Instant::now() + self.mask_wait;
        let (masks, mask_time) = host.masks(self.cfg.vocab_size, deadline);
        if !masks.is_empty() {
            let sampler = self.sampler.as_mut().expect("made by run");
            be.write_ids(&mut sampler.masks, &masks)?;
        }
        let words: Vec<u32> = host.draws.iter().flat_map(|d| d.to_words()).collect();
        be.write_ids(&mut g.out.params, &words)?;
        be.replay(&g.sample)?;
        Self::outputs(be, &g.logits, &g.out, host, n, mask_time).map(Some)
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
            draws: Vec::new(),
            bias: Vec::new(),
            need_logits: Vec::new(),
            constrained: Vec::new(),
            late: Vec::new(),
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
        let mut out = SampleOut::new(be, rows)?;
        let words: Vec<u32> = pad.draws.iter().flat_map(|d| d.to_words()).collect();
        be.write_ids(&mut out.params, &words)?;
        let blocks = self.graph_blocks.as_ref().expect("allocated by replay");
        let sampler = self.sampler.as_mut().expect("made by run");
        let (block_size, max_context) = (self.block_size, self.max_context);
        let started = std::time::Instant::now();
        let forward = be.record(&mut || {
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
            let forward = model.forward(kv, &step)?.expect("every row's logits");
            be.copy(&mut logits, &forward)
        });
        let recorded = match forward {
            Ok(Some(forward)) => be
                .record(&mut || sampler.sample(be, &logits, &mut out, None))
                .map(|sample| sample.map(|sample| (forward, sample))),
            Ok(None) => Ok(None),
            Err(e) => Err(e),
        };
        match recorded {
            Ok(Some((forward, sample))) => {
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
                    out,
                    forward,
                    sample,
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
