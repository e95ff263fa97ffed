//! `vlm bench`: the stages measured on the device at hand, against the hardware limits
//! measured in the same run.
//!
//! - limits: copy bandwidth (decode reads every weight and the KV cache once per token, so
//!   bytes per token / bandwidth bounds it) and a large GEMM's FLOP rate (prefill and the ViT
//!   are GEMM-bound);
//! - ViT + mergers for square images of the given sides, from the image's bytes (the patches
//!   are cut by the tower's backend, on a GPU on the device) to the outputs, kept on the device
//!   (as the language stage of the same process takes them) and downloaded to the host (as a
//!   separate vision service delivers them);
//! - prefill throughput for text prompts of the given lengths;
//! - time to first token of image + text requests, in process, and how long packing and
//!   unpacking their embeddings for the hop between the services takes;
//! - decode tokens/s at the given contexts (steady state, eos ignored);
//! - the same image requests through vision-svc, llm-svc and the gateway over gRPC on
//!   loopback, to show what the service hops cost (embedding transfer included): with an
//!   image vision-svc has not seen, and with one its embedding cache holds;
//! - device memory in use after each stage, where the backend has its own (a GPU).
//!
//! Works from a checkpoint or, with random weights, from a config alone, so the real 8B shapes
//! can be measured without downloading weights. Each measurement runs `warmup` times
//! unmeasured, then `repeats` times; the report gives the median and the spread.

use std::path::Path;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use llm_svc::{GenerateRequest, SamplerRow, SamplingParams};
use serde_json::{json, Value};
use vision_svc::{Delivery, Patches, VisionConfig};
use vlm_compute::sampling::SampleBuffers;
use vlm_compute::{Backend, HostTensor, Weights};

use gateway::chat::{ChatTokenizer, Message, Part};
use gateway::request::ChatRequest;

use crate::footprint::{decoder_layer_matrix_params, int_bytes, stored_int_bits};
use crate::pipeline::Pipeline;
use crate::stack::{LocalStack, StackConfig};

#[derive(Clone, Debug)]
pub struct BenchOptions {
    pub warmup: usize,
    pub repeats: usize,
    /// Sides (pixels) of the square images for the ViT measurement.
    pub image_sides: Vec<usize>,
    /// Prompt lengths for the prefill measurements.
    pub prefill_tokens: Vec<usize>,
    /// Contexts at which decoding is measured, and how many tokens are decoded each time.
    pub decode_contexts: Vec<usize>,
    pub decode_tokens: usize,
    /// Batch sizes of the batched-decode rows (sequences decoding together, each at the first
    /// of `decode_contexts`).
    pub decode_batches: Vec<usize>,
    /// Also print where a prefill and a batched decode step spend device time, op by op.
    pub profile: bool,
    /// Also measure every decode row sampled as Qwen3-VL's model card asks (temperature 0.7,
    /// top-p 0.8, top-k 20, presence penalty 1.5, a fixed seed), beside greedy.
    pub sampled_decode: bool,
    /// Also measure every decode row sampled with a JSON schema on every request
    /// ([`bench_schema`]), and the host's grammar masks a step at each batch size.
    pub json_schema_decode: bool,
    /// The time-to-first-token requests: one square image of each of these sides and about
    /// `ttft_text_tokens` text tokens.
    pub ttft_image_sides: Vec<usize>,
    pub ttft_text_tokens: usize,
    /// Also send those requests through the services and the gateway on loopback (a new image
    /// each time, and one sent before), and time packing and unpacking their embeddings.
    pub through_gateway: bool,
    /// Random weights from this seed instead of the checkpoint's.
    pub random_weights: Option<u64>,
    /// `--quantize` and `--quantize-lm-head`: matrices quantized at load.
    pub weights: llm_svc::WeightArgs,
    /// `--kv-cache-dtype`: how the engine's KV cache stores keys and values.
    pub kv_cache_dtype: llm_svc::KvCacheDtype,
}

/// One row of the report.
#[derive(Clone, Debug)]
pub struct Measurement {
    pub name: String,
    /// Seconds per run, sorted.
    pub seconds: Vec<f64>,
    /// Work per run in `unit`s (tokens, bytes, FLOPs), for the throughput column.
    pub work: f64,
    pub unit: &'static str,
    /// Fraction of the measured hardware limit reached, when one applies.
    pub roofline: Option<f64>,
}

impl Measurement {
    /// A row that is an amount of memory (`bytes` in use), not a rate.
    fn amount(name: String, bytes: usize) -> Self {
        Self {
            name,
            seconds: vec![0.0],
            work: bytes as f64,
            unit: "B in use",
            roofline: None,
        }
    }

    pub fn median(&self) -> f64 {
        self.seconds[self.seconds.len() / 2]
    }
    pub fn throughput(&self) -> f64 {
        self.work / self.median()
    }
    /// Whether the row is an amount (device memory in use) rather than a rate.
    pub fn is_amount(&self) -> bool {
        self.unit == "B in use"
    }
    pub fn to_json(&self, device: &str, config: &str) -> Value {
        // An amount has no rate (its work over zero seconds is infinite, which JSON writes as
        // null): "throughput" carries the amount itself, as hf_peer.py's memory row does.
        let (throughput, unit) = if self.is_amount() {
            (self.work, self.unit.to_string())
        } else {
            (self.throughput(), format!("{}/s", self.unit))
        };
        json!({
            "name": self.name,
            "device": device,
            "config": config,
            "median_ms": self.median() * 1e3,
            "min_ms": self.seconds[0] * 1e3,
            "max_ms": self.seconds[self.seconds.len() - 1] * 1e3,
            "runs": self.seconds.len(),
            "throughput": throughput,
            "unit": unit,
            "roofline_fraction": self.roofline,
        })
    }
}

/// Times `f` `warmup + repeats` times; returns the measured durations, sorted.
fn time(
    opts: &BenchOptions,
    bar: &ProgressBar,
    mut f: impl FnMut() -> anyhow::Result<Duration>,
) -> anyhow::Result<Vec<f64>> {
    for _ in 0..opts.warmup {
        f()?;
        bar.inc(1);
    }
    let mut s = Vec::with_capacity(opts.repeats);
    for _ in 0..opts.repeats.max(1) {
        s.push(f()?.as_secs_f64());
        bar.inc(1);
    }
    s.sort_by(f64::total_cmp);
    Ok(s)
}

/// Runs every measurement for the checkpoint (or config) in `dir` on backends opened by
/// `open` (one in process; the services open their own). `copy` copies `bytes` bytes once on
/// the device and returns how long that took; the limit it gives counts the read and the write
/// (2 x bytes), the traffic decoding's reads compare with.
pub fn run<B: Backend + Clone>(
    dir: &Path,
    open: fn() -> vlm_compute::Result<B>,
    opts: &BenchOptions,
    copy: impl Fn(&B, usize) -> anyhow::Result<Duration>,
) -> anyhow::Result<Vec<Measurement>> {
    // A text-only checkpoint has no vision tower: its rows are the text ones.
    let text_only_opts;
    let opts = if llm_svc::ModelConfig::from_dir(dir)?.vision.is_none() {
        tracing::info!("the model is text-only: no ViT, time-to-first-token or gateway rows");
        text_only_opts = BenchOptions {
            image_sides: Vec::new(),
            ttft_image_sides: Vec::new(),
            through_gateway: false,
            ..opts.clone()
        };
        &text_only_opts
    } else {
        opts
    };
    let backend = open()?;
    let base_memory = backend.memory_in_use();
    let weights = opts.weights.open(dir, opts.random_weights)?;
    let shapes = Shapes::new(dir, opts)?;
    let pipeline = Pipeline::with_weights(dir, &weights, backend.clone(), shapes.engine(opts))?;
    // A vocabulary llguidance cannot read has no structured outputs: their rows are left out.
    let no_grammar_opts;
    let opts = match pipeline.engine.grammars() {
        Err(why) if opts.json_schema_decode => {
            tracing::warn!(%why, "no structured-output rows: the vocabulary has no grammars");
            no_grammar_opts = BenchOptions {
                json_schema_decode: false,
                ..opts.clone()
            };
            &no_grammar_opts
        }
        _ => opts,
    };
    let bar = progress_bar(opts, &shapes);
    let mut out = Vec::new();

    // Limits first: copy bandwidth and a large GEMM.
    out.push(copy_bandwidth(opts, &bar, &backend, copy)?);
    out.push(gemm_rate(opts, &bar, &backend)?);
    let bench = Bench {
        opts,
        bar: &bar,
        backend: &backend,
        pipeline: &pipeline,
        bandwidth: out[0].throughput(),
        flop_rate: out[1].throughput(),
        int_bits: stored_int_bits(weights.quant_config(), opts.weights.quantize),
        lm_head_int8: weights.quantizing_lm_head(),
    };
    // What serving holds, by kind: the text decoder's weights as stored (their format says
    // the bytes) and the KV cache; then all the device has in use (both models' weights, the
    // KV cache, activations, workspaces, recorded graphs, and this bench's own buffers).
    out.extend(held_rows(&pipeline.engine, &weights));
    for &side in &opts.image_sides {
        out.extend(bench.vit(side)?);
    }
    memory_row(
        &mut out,
        "memory: all in use after the ViT rows (the bench's own buffers too)",
        &backend,
        base_memory,
    );
    for &tokens in &opts.prefill_tokens {
        out.push(bench.prefill(tokens)?);
    }
    for &side in &opts.ttft_image_sides {
        out.extend(bench.ttft_in_process(side)?);
    }
    let decodings = decodings(opts);
    for &context in &opts.decode_contexts {
        for d in &decodings {
            out.push(bench.decode(context, d)?);
        }
    }
    for &batch in &shapes.batched {
        for d in &decodings {
            out.push(bench.decode_batched(batch, shapes.batch_context, d)?);
        }
    }
    if opts.json_schema_decode {
        for &batch in &opts.decode_batches {
            out.extend(bench.grammar_masks(batch)?);
        }
    }
    if opts.sampled_decode {
        for &rows in &opts.decode_batches {
            for (tag, sampling) in sampler_settings() {
                out.push(bench.sampler(rows, tag, &sampling)?);
            }
        }
    }
    if opts.profile {
        profile_steps(
            &backend,
            &pipeline,
            &opts.image_sides,
            shapes.batch_context,
            shapes.most_seqs,
        )?;
    }
    memory_row(
        &mut out,
        "memory: all in use after every row",
        &backend,
        base_memory,
    );

    if opts.through_gateway {
        let requests = gateway_requests(opts, &pipeline.chat)?;
        // The services hold their own copies of the weights: free ours first.
        drop(pipeline);
        for (hop, requests) in requests {
            bar.set_message(format!("through the gateway, {}", hop.name()));
            out.extend(through_gateway(dir, open, opts, &requests, hop, &bar)?);
        }
    }
    bar.finish_and_clear();
    Ok(out)
}

/// The sizes the options ask of the engine: prompts prefilled in one step (the rows measure
/// prefill, not chunking), a cache that holds the longest request, and room for the
/// batched-decode rows.
struct Shapes {
    /// The longest prompt a row prefills.
    longest: usize,
    /// The context the batched-decode rows (and the profile's decode steps) run at: the first
    /// of `decode_contexts`.
    batch_context: usize,
    /// The batch sizes of the batched-decode rows (batch 1 at `batch_context` is the
    /// single-sequence decode row already).
    batched: Vec<usize>,
    /// The most sequences that decode together.
    most_seqs: usize,
}

impl Shapes {
    fn new(dir: &Path, opts: &BenchOptions) -> anyhow::Result<Self> {
        let image_settings = if opts.ttft_image_sides.is_empty() {
            None
        } else {
            Some(vision_svc::PreprocessConfig::from_dir(dir)?)
        };
        let ttft_prompts = opts
            .ttft_image_sides
            .iter()
            .map(|&side| {
                let settings = image_settings.as_ref().expect("read when there are sides");
                let image = vlm_proto::image::image_tokens_of_size(side, side, settings)?;
                // The chat template's own tokens on top of the image's and the text's.
                Ok(image + opts.ttft_text_tokens + 64)
            })
            .collect::<anyhow::Result<Vec<usize>>>()?;
        let longest = opts
            .prefill_tokens
            .iter()
            .chain(&opts.decode_contexts)
            .chain(&ttft_prompts)
            .chain(if opts.profile {
                &PROFILE_PREFILLS[..]
            } else {
                &[]
            })
            .copied()
            .max()
            .unwrap_or(0);
        let batch_context = opts.decode_contexts.first().copied().unwrap_or(512);
        let batched = opts
            .decode_batches
            .iter()
            .copied()
            .filter(|&b| b > 1 || !opts.decode_contexts.contains(&batch_context))
            .collect();
        let most_seqs = opts.decode_batches.iter().copied().max().unwrap_or(1);
        Ok(Self {
            longest,
            batch_context,
            batched,
            most_seqs,
        })
    }

    /// The engine the in-process rows run on.
    fn engine(&self, opts: &BenchOptions) -> llm_svc::EngineConfig {
        let (longest, most_seqs) = (self.longest, self.most_seqs);
        llm_svc::EngineConfig {
            max_batch_tokens: longest.max(2048),
            max_batch_seqs: most_seqs.max(1),
            kv_cache: llm_svc::KvCacheSize::Tokens(
                (longest + opts.decode_tokens + 64)
                    .max(most_seqs * (self.batch_context + opts.decode_tokens + 160)),
            ),
            // Every run repeats its prompt: cached blocks would make prefill look free.
            prefix_caching: false,
            kv_cache_dtype: opts.kv_cache_dtype,
            ..llm_svc::EngineConfig::default()
        }
    }
}

/// The progress bar, as long as the runs of every measurement [`run`] makes (`warmup +
/// repeats` each): the two limits; two ViT rows per image side; a prefill row per length;
/// per TTFT side, three in-process rows, and with `through_gateway` two more for packing and
/// unpacking and four through the gateway; a decode row per context and per batched row, each
/// greedy and sampled; four sampler rows per batch size, sampled.
fn progress_bar(opts: &BenchOptions, shapes: &Shapes) -> ProgressBar {
    let per_measure = opts.warmup + opts.repeats.max(1);
    let measures = 2
        + opts.image_sides.len() * 2
        + opts.prefill_tokens.len()
        + opts.ttft_image_sides.len() * (3 + 6 * opts.through_gateway as usize)
        + (opts.decode_contexts.len() + shapes.batched.len()) * decodings(opts).len()
        + opts.decode_batches.len() * 4 * opts.sampled_decode as usize
        + opts.decode_batches.len() * opts.json_schema_decode as usize;
    ProgressBar::new((per_measure * measures) as u64).with_style(
        ProgressStyle::with_template("bench {bar:30} {pos}/{len} runs {msg}")
            .expect("valid template"),
    )
}

/// The first limit: how fast the device copies (the read and the write counted).
fn copy_bandwidth<B: Backend>(
    opts: &BenchOptions,
    bar: &ProgressBar,
    backend: &B,
    copy: impl Fn(&B, usize) -> anyhow::Result<Duration>,
) -> anyhow::Result<Measurement> {
    bar.set_message("copy bandwidth");
    // A GPU copies 256 MiB in well under a millisecond, where the launch and the two
    // synchronisations around it cost a few percent: 1 GiB brings that under 1%, so decode's
    // "of limit" is set against the bandwidth itself. On the CPU 256 MiB is far past every
    // cache already, and two 1 GiB buffers are a lot to ask of a CI machine.
    let copy_bytes: usize = if backend.device_memory().is_some() {
        1 << 30
    } else {
        256 << 20
    };
    let bw = time(opts, bar, || copy(backend, copy_bytes))?;
    Ok(Measurement {
        name: "limit: copy bandwidth (read + write)".into(),
        seconds: bw,
        work: 2.0 * copy_bytes as f64,
        unit: "B",
        roofline: None,
    })
}

/// The second limit: the FLOP rate of a large GEMM through the backend's `linear`.
fn gemm_rate<B: Backend>(
    opts: &BenchOptions,
    bar: &ProgressBar,
    backend: &B,
) -> anyhow::Result<Measurement> {
    bar.set_message("GEMM rate");
    let (m, k, n) = (4096, 4096, 4096);
    let a = backend.upload(&HostTensor::new(vec![n, k], vec![0.5; n * k])?)?;
    let w = backend.upload_weight(&HostTensor::new(vec![m, k], vec![0.25; m * k])?)?;
    let gemm = time(opts, bar, || {
        let t = Instant::now();
        let y = backend.linear(&a, &w, None)?;
        backend.download(&backend.slice_rows(&y, 0, 1)?)?;
        Ok(t.elapsed())
    })?;
    drop((a, w));
    Ok(Measurement {
        name: format!("limit: GEMM {n}x{k}x{m} (the backend's linear)"),
        seconds: gemm,
        work: 2.0 * (m * n * k) as f64,
        unit: "FLOP",
        roofline: None,
    })
}

/// What the in-process measurements share: the options, the progress bar, the backend and
/// the pipeline on it, and the limits measured first.
struct Bench<'a, B: Backend> {
    opts: &'a BenchOptions,
    bar: &'a ProgressBar,
    backend: &'a B,
    pipeline: &'a Pipeline<B>,
    /// Bytes per second the device copies (read + write): what decoding is set against.
    bandwidth: f64,
    /// FLOP per second of the large GEMM: what the ViT and prefill are set against.
    flop_rate: f64,
    /// Bits a decoder-layer weight takes where the checkpoint or `--quantize` made them
    /// integers (`None`: the backend's own weight format).
    int_bits: Option<u32>,
    /// `--quantize-lm-head`: `lm_head` in 8 bits.
    lm_head_int8: bool,
}

impl<B: Backend + Clone> Bench<'_, B> {
    /// The text decoder's parameters (a prefill token's FLOPs are twice these).
    fn params(&self) -> f64 {
        text_params(self.pipeline.engine.config()) as f64
    }

    /// Bytes a decoded token reads of the weights, as stored: the decoder layers' matrices
    /// at `int_bits` with an f16 scale and zero per 128 (`--quantize`'s group, and the usual
    /// one of checkpoints), `lm_head` likewise at 8 bits under `--quantize-lm-head`, the rest
    /// (`lm_head` otherwise, norms, one embedding row: [`decode_params`]) in the backend's
    /// format.
    fn weight_bytes(&self) -> f64 {
        let cfg = self.pipeline.engine.config();
        let c = &cfg.text;
        let layers = c.num_hidden_layers * decoder_layer_matrix_params(c);
        let head = c.vocab_size * c.hidden_size;
        let stored = |params: usize, bits: Option<u32>| match bits {
            Some(b) => int_bytes(params, b),
            None => params * B::WEIGHT_BYTES,
        };
        let rest = decode_params(cfg) - layers - head;
        (stored(layers, self.int_bits)
            + stored(head, self.lm_head_int8.then_some(8))
            + rest * B::WEIGHT_BYTES) as f64
    }

    /// Bytes of KV cache one token of context takes.
    fn kv_bytes_per_token(&self) -> f64 {
        self.pipeline.engine.kv_bytes_per_token() as f64
    }

    /// ViT + mergers for a `side` x `side` image: with the outputs kept on the device, then
    /// downloaded to the host.
    fn vit(&self, side: usize) -> anyhow::Result<Vec<Measurement>> {
        let (opts, bar) = (self.opts, self.bar);
        let tower = vision_tower(self.pipeline)?;
        let patches = vit_input(&tower.preprocess, side)?;
        let g = patches.grid_thw[1];
        bar.set_message(format!("ViT {side}x{side}"));
        // The pass as the language stage of this process takes it (HF's peer row likewise
        // leaves the output on the GPU): image bytes uploaded, outputs kept on the device, timed
        // until the device has computed them (the hand-off itself returns once they are queued).
        let on_device = [Delivery::Device {
            identity: b"bench".to_vec(),
        }];
        let s = time(opts, bar, || {
            let t = Instant::now();
            let vision = &tower.model;
            vision.forward_delivered(std::slice::from_ref(&patches), &on_device)?;
            vision.backend().synchronize()?;
            Ok(t.elapsed())
        })?;
        // And as a separate vision service delivers it: outputs downloaded to the host.
        let s_host = time(opts, bar, || {
            let t = Instant::now();
            tower.model.forward(&patches)?;
            Ok(t.elapsed())
        })?;
        let rows = [
            (
                format!("vision: ViT + mergers {side}x{side} ({} patches)", g * g),
                s,
            ),
            (
                format!("vision: ViT + mergers {side}x{side}, outputs downloaded to the host"),
                s_host,
            ),
        ];
        let vcfg = tower.model.config();
        Ok(rows
            .into_iter()
            .map(|(name, seconds)| {
                let mut meas = Measurement {
                    name,
                    seconds,
                    work: vit_flops(vcfg, g * g),
                    unit: "FLOP",
                    roofline: None,
                };
                meas.roofline = Some(meas.throughput() / self.flop_rate);
                meas
            })
            .collect())
    }

    /// Prefill of a text prompt of `tokens` tokens.
    fn prefill(&self, tokens: usize) -> anyhow::Result<Measurement> {
        self.bar.set_message(format!("prefill {tokens}"));
        let req = greedy_request(text_prompt(tokens), 1);
        let s = time(self.opts, self.bar, || {
            Ok(self
                .pipeline
                .engine
                .generate(&req, |_| std::ops::ControlFlow::Continue(()))?
                .prefill)
        })?;
        let mut meas = Measurement {
            name: format!("prefill: {tokens} text tokens"),
            seconds: s,
            work: tokens as f64,
            unit: "token",
            roofline: None,
        };
        meas.roofline = Some(meas.throughput() * 2.0 * self.params() / self.flop_rate);
        Ok(meas)
    }

    /// Time to first token of an image request of a `side` x `side` image, in this process
    /// (and with the image encoded already), after the host's share of it (decoding and
    /// preprocessing the PNG); with `through_gateway`, also what packing and unpacking its
    /// embeddings for the wire costs the host.
    fn ttft_in_process(&self, side: usize) -> anyhow::Result<Vec<Measurement>> {
        let (opts, bar, pipeline) = (self.opts, self.bar, self.pipeline);
        let mut out = Vec::new();
        let request = ttft_request(&pipeline.chat, side, opts.ttft_text_tokens, 0)?;
        let Part::Image(png) = &request.messages[0].parts[0] else {
            unreachable!("the request starts with its image")
        };
        bar.set_message(format!("preprocess {side}x{side}"));
        // The host's part: decoding and resizing (the tower's backend cuts the patches).
        let vision = vision_tower(pipeline)?;
        let preprocessed = time(opts, bar, || {
            let t = Instant::now();
            vision_svc::preprocess::preprocess(png, &vision.preprocess, &vision.limits)?;
            Ok(t.elapsed())
        })?;
        out.push(Measurement {
            name: format!("image {side}x{side} PNG: decoded and preprocessed"),
            seconds: preprocessed,
            work: 1.0,
            unit: "image",
            roofline: None,
        });
        bar.set_message(format!("time to first token, {side}x{side}"));
        let in_process = time(opts, bar, || {
            let t = Instant::now();
            pipeline.run(&request, |_, _| std::ops::ControlFlow::Continue(()))?;
            Ok(t.elapsed())
        })?;
        out.push(Measurement {
            name: format!("{}, in process", ttft_name(side, opts)),
            seconds: in_process,
            work: 1.0,
            unit: "request",
            roofline: None,
        });
        // The floor of a repeated image: its embeddings at hand, only the prompt to prefill.
        let image = vision.encode_image(png)?;
        let prompt = pipeline
            .chat
            .prompt_ids(&request.messages, &[image.embeds.rows()])?;
        let encoded = GenerateRequest {
            images: vec![llm_svc::ImageInput {
                embeds: image.embeds.clone(),
                deepstack: image.deepstack.clone(),
                grid_thw: image.grid_thw,
            }],
            ..greedy_request(prompt, 1)
        };
        let prefill_only = time(opts, bar, || {
            let t = Instant::now();
            pipeline
                .engine
                .generate(&encoded, |_| std::ops::ControlFlow::Continue(()))?;
            Ok(t.elapsed())
        })?;
        out.push(Measurement {
            name: format!(
                "{}, in process, image already encoded",
                ttft_name(side, opts)
            ),
            seconds: prefill_only,
            work: 1.0,
            unit: "request",
            roofline: None,
        });
        if opts.through_gateway {
            out.extend(pack_and_unpack(&image, side, opts, bar)?);
        }
        Ok(out)
    }

    /// Seconds per token decoded by one sequence at `context`, steady state (eos ignored).
    fn decode(&self, context: usize, d: &Decoding) -> anyhow::Result<Measurement> {
        let opts = self.opts;
        let tag = d.tag;
        self.bar.set_message(format!("decode at {context}{tag}"));
        let req = GenerateRequest {
            sampling: d.sampling.clone(),
            constraint: d.constraint.clone(),
            ..greedy_request(text_prompt(context), opts.decode_tokens + 1)
        };
        let s = time(opts, self.bar, || {
            let g = self
                .pipeline
                .engine
                .generate(&req, |_| std::ops::ControlFlow::Continue(()))?;
            // Seconds per decoded token (the first token comes from the prefill).
            Ok(g.decode / (g.tokens.len().saturating_sub(1).max(1)) as u32)
        })?;
        let kv_bytes = (context + opts.decode_tokens / 2) as f64 * self.kv_bytes_per_token();
        // Weights as the backend stores them (f32 on the CPU, f16 on a GPU), and the cache.
        let bytes_per_token = self.weight_bytes() + kv_bytes;
        let mut meas = Measurement {
            name: format!("decode: batch 1 at context {context}{tag}"),
            seconds: s,
            work: 1.0,
            unit: "token",
            roofline: None,
        };
        meas.roofline = Some(meas.throughput() * bytes_per_token / self.bandwidth);
        Ok(meas)
    }

    /// Seconds per step of `batch` sequences decoding together at `context` ([`batched_decode`]).
    fn decode_batched(
        &self,
        batch: usize,
        context: usize,
        d: &Decoding,
    ) -> anyhow::Result<Measurement> {
        let opts = self.opts;
        let tag = d.tag;
        self.bar.set_message(format!("decode batch {batch}{tag}"));
        let s = time(opts, self.bar, || {
            batched_decode(
                &self.pipeline.engine,
                batch,
                context,
                opts.decode_tokens,
                d,
                || Ok(()),
            )
        })?;
        let kv_bytes =
            batch as f64 * (context + opts.decode_tokens / 2) as f64 * self.kv_bytes_per_token();
        let mut meas = Measurement {
            name: format!("decode: batch {batch} at context {context}{tag}"),
            seconds: s,
            work: batch as f64,
            unit: "token",
            roofline: None,
        };
        // One step reads the weights once and every sequence's cache.
        let step_bytes = self.weight_bytes() + kv_bytes;
        meas.roofline = Some(meas.throughput() / batch as f64 * step_bytes / self.bandwidth);
        Ok(meas)
    }

    /// The host's side of grammar-constrained decoding at `batch` sequences: one step's token
    /// masks ([`llm_svc::grammar::masks_by`], as the engine computes them while the
    /// device runs the forward pass), over steps of [`bench_schema`] answers. Two rows: the
    /// median step (its spread from the fastest to the slowest), and the 99th percentile.
    fn grammar_masks(&self, batch: usize) -> anyhow::Result<Vec<Measurement>> {
        self.bar
            .set_message(format!("grammar masks of {batch} sequences"));
        let grammars = self
            .pipeline
            .engine
            .grammars()
            .map_err(|why| anyhow::anyhow!("no grammars for this vocabulary: {why}"))?;
        let steps = 64 * self.opts.repeats.max(1);
        let (masks, checks) = time_masks(grammars, batch, 16, steps)?;
        self.bar
            .inc((self.opts.warmup + self.opts.repeats.max(1)) as u64);
        let p99 = |s: &[f64]| s[(s.len() * 99).div_ceil(100) - 1];
        let row = |name: String, seconds: Vec<f64>| Measurement {
            name,
            seconds,
            work: batch as f64,
            unit: "token",
            roofline: None,
        };
        let (masks_p99, checks_p99) = (p99(&masks), p99(&checks));
        Ok(vec![
            row(
                format!("grammar masks: {batch} sequences, a step (host, median)"),
                masks,
            ),
            row(
                format!("grammar masks: {batch} sequences, a step (host, p99)"),
                vec![masks_p99],
            ),
            row(
                format!("grammar pick checks: {batch} sequences, a step (host, median)"),
                checks,
            ),
            row(
                format!("grammar pick checks: {batch} sequences, a step (host, p99)"),
                vec![checks_p99],
            ),
        ])
    }

    /// The sampler alone: one `sample_rows` over `rows` rows of logits with `sampling`.
    fn sampler(
        &self,
        rows: usize,
        tag: &str,
        sampling: &SamplingParams,
    ) -> anyhow::Result<Measurement> {
        let vocab = self.pipeline.engine.config().text.vocab_size;
        self.bar.set_message(format!("sampler {rows} rows {tag}"));
        let s = time_sampler(self.backend, rows, vocab, sampling, self.opts, self.bar)?;
        let mut meas = Measurement {
            name: format!("sampler: {rows} rows of {vocab} logits, {tag}"),
            seconds: s,
            work: rows as f64,
            unit: "token",
            roofline: None,
        };
        // The least it must do: read each row's logits once.
        let bytes = (rows * vocab * 4) as f64;
        meas.roofline = Some(bytes / meas.median() / self.bandwidth);
        Ok(meas)
    }
}

/// A synthetic text prompt of `len` tokens (ids away from the special tokens).
fn text_prompt(len: usize) -> Vec<u32> {
    (0..len).map(|i| (i % 100 + 10) as u32).collect()
}

/// How a decode row's requests choose their tokens, and the tag its name ends with.
pub struct Decoding {
    pub tag: &'static str,
    pub sampling: SamplingParams,
    pub constraint: Option<vlm_proto::pb::Constraint>,
}

impl Decoding {
    fn greedy() -> Self {
        Self {
            tag: "",
            sampling: SamplingParams::greedy(),
            constraint: None,
        }
    }
}

/// The decode rows' ways: greedy; with `sampled_decode` as the model card asks; with
/// `json_schema_decode` sampled so with [`bench_schema`] on every request.
fn decodings(opts: &BenchOptions) -> Vec<Decoding> {
    let plain = |tag, sampling| Decoding {
        tag,
        sampling,
        constraint: None,
    };
    let mut out = vec![Decoding::greedy()];
    if opts.sampled_decode {
        out.push(plain(", sampled", recommended_sampling()));
    }
    if opts.json_schema_decode {
        out.push(Decoding {
            tag: ", sampled, json_schema",
            sampling: recommended_sampling(),
            constraint: Some(bench_constraint()),
        });
    }
    out
}

/// The schema of the constrained rows: Qwen3-VL's detections (`bbox_2d` in its 0-1000
/// coordinates and a label). At least 64 of them, over a thousand tokens, so that no answer
/// completes (a complete grammar ends a request, even one that generates through eos) and
/// every row decodes its fixed number of tokens.
pub fn bench_schema() -> serde_json::Value {
    serde_json::json!({
        "type": "array",
        "minItems": 64,
        "items": {
            "type": "object",
            "properties": {
                "bbox_2d": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 1000},
                    "minItems": 4,
                    "maxItems": 4
                },
                "label": {"type": "string", "maxLength": 32}
            },
            "required": ["bbox_2d", "label"],
            "additionalProperties": false
        }
    })
}

fn bench_constraint() -> vlm_proto::pb::Constraint {
    vlm_proto::pb::Constraint {
        grammar: Some(vlm_proto::pb::constraint::Grammar::JsonSchema(
            bench_schema().to_string(),
        )),
        after_token: None,
    }
}

/// The sampler rows' settings, each with the tag its row's name ends with.
fn sampler_settings() -> [(&'static str, SamplingParams); 4] {
    [
        ("greedy", SamplingParams::greedy()),
        (
            "temperature 1 alone",
            SamplingParams {
                temperature: 1.0,
                seed: Some(0),
                ..SamplingParams::greedy()
            },
        ),
        ("0.7 / 0.8 / 20, presence 1.5", recommended_sampling()),
        (
            "the same with top_logprobs 5",
            SamplingParams {
                logprobs: Some(5),
                ..recommended_sampling()
            },
        ),
    ]
}

/// The requests [`through_gateway`] sends, for each [`Hop`] and each side: a new image for
/// every run; and one image for every run (after the warm-up, vision-svc has its embeddings).
fn gateway_requests(
    opts: &BenchOptions,
    chat: &ChatTokenizer,
) -> anyhow::Result<Vec<(Hop, Vec<TtftRequests>)>> {
    let runs = (opts.warmup + opts.repeats.max(1)) as u32;
    let text = opts.ttft_text_tokens;
    let new_images = |first: u32| -> anyhow::Result<Vec<TtftRequests>> {
        opts.ttft_image_sides
            .iter()
            .map(|&side| {
                let new = (first..first + runs)
                    .map(|v| ttft_request(chat, side, text, v))
                    .collect::<anyhow::Result<_>>()?;
                let again = ttft_request(chat, side, text, 0)?;
                Ok((side, new, again))
            })
            .collect()
    };
    [Hop::Messages, Hop::SharedMemory, Hop::Device]
        .into_iter()
        .zip(0u32..)
        .map(|(hop, i)| Ok((hop, new_images(1 + i * runs)?)))
        .collect()
}

/// Seconds per decode step with `batch` sequences decoding together at about `context` tokens.
/// All are submitted at once; the last one submitted is prefilled last, so from its first token
/// on every sequence decodes. The clock then runs over `tokens` of its decode steps, while the
/// others (prefilled earlier, with tokens to spare) decode beside it: a full batch every step.
/// `prefilled` runs once every sequence has its first token. The requests are cancelled after.
fn batched_decode(
    engine: &llm_svc::Engine,
    batch: usize,
    context: usize,
    tokens: usize,
    d: &Decoding,
    mut prefilled: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<Duration> {
    // More than any sequence can generate before the last one is prefilled: at least one
    // prompt's worth of prefill per step, so at most `batch` steps of head start each.
    let budget = tokens + 1 + batch + 16;
    let mut streams = start_decoding(engine, batch, context, budget, d)?;
    prefilled()?;
    let started = Instant::now();
    let last = streams.last_mut().expect("batch >= 1");
    for _ in 0..tokens {
        match last.blocking_recv() {
            Some(llm_svc::Event::Token { .. }) => {}
            other => anyhow::bail!("batched decode: {other:?}"),
        }
    }
    let elapsed = started.elapsed();
    drop(streams);
    Ok(elapsed / tokens.max(1) as u32)
}

/// Submits `batch` sequences of `context` distinct prompt tokens, each to generate `budget`
/// tokens, and returns once every one has its first token (all are decoding). Dropping the
/// streams cancels them.
fn start_decoding(
    engine: &llm_svc::Engine,
    batch: usize,
    context: usize,
    budget: usize,
    d: &Decoding,
) -> anyhow::Result<Vec<llm_svc::RequestStream>> {
    let mut streams = Vec::with_capacity(batch);
    for b in 0..batch {
        // Distinct prompts (no shared prefix), ids away from the special tokens.
        let prompt = (0..context)
            .map(|i| ((i * 7 + b * 13) % 200 + 10) as u32)
            .collect();
        let req = GenerateRequest {
            sampling: SamplingParams {
                seed: Some(b as u64),
                ..d.sampling.clone()
            },
            constraint: d.constraint.clone(),
            ..greedy_request(prompt, budget)
        };
        streams.push(engine.submit(req, None, tracing::Span::none())?);
    }
    // Every sequence's first token (the prefills).
    for s in &mut streams {
        match s.blocking_recv() {
            Some(llm_svc::Event::Token { .. }) => {}
            other => anyhow::bail!("batched decode: expected a first token, got {other:?}"),
        }
    }
    Ok(streams)
}

/// The ViT's input for a `side` x `side` image, as preprocessing leaves it for the tower: the
/// image's bytes (a gradient; already at a size the tower takes, so nothing is resized:
/// decoding and resizing are not the ViT's cost) and the processor's normalization table. The
/// tower's backend cuts the patches from them, a GPU on the device.
/// The pipeline's vision tower, for the rows that measure it; a text-only checkpoint has none.
fn vision_tower<B: Backend>(
    pipeline: &Pipeline<B>,
) -> anyhow::Result<&vision_svc::VisionEncoder<B>> {
    pipeline.vision.as_ref().ok_or_else(|| {
        anyhow::anyhow!(
            "the model ({}) is text-only: it has no vision tower to measure (image rows need a \
             Qwen3-VL checkpoint)",
            pipeline.engine.config().architecture.name()
        )
    })
}

fn vit_input(pcfg: &vision_svc::PreprocessConfig, side: usize) -> anyhow::Result<Patches> {
    let factor = pcfg.patch_size * pcfg.merge_size;
    let side = (side / factor).max(1) * factor;
    let image = vision_svc::preprocess::RgbImage {
        width: side,
        height: side,
        data: gradient(side as u32).into_raw(),
    };
    let as_is = vision_svc::PreprocessConfig {
        do_resize: false,
        ..pcfg.clone()
    };
    Ok(vision_svc::preprocess::image_patches(image, &as_is)?)
}

/// The prefills `--profile` breaks down (the cache is sized to hold them): about a 448x448
/// image's request, a chunk of a long prompt, a long prompt.
const PROFILE_PREFILLS: [usize; 3] = [256, 512, 2048];

/// `vlm bench --profile`: device time per op of the ViT on each of `image_sides`, of each of
/// PROFILE_PREFILLS and of a decode step of `batch` sequences, printed slowest first (steps run
/// op by op meanwhile).
fn profile_steps<B: Backend + Clone>(
    be: &B,
    pipeline: &Pipeline<B>,
    image_sides: &[usize],
    context: usize,
    batch: usize,
) -> anyhow::Result<()> {
    if !be.time_ops(true)? {
        eprintln!("profile: the {} backend does not time ops", be.name());
        return Ok(());
    }
    println!(
        "\nprofile: an op's time runs from the end of the op before it, so time the GPU spent \
         waiting for the host (uploads, downloads, setup) counts to the op after the wait"
    );
    for &side in image_sides {
        let tower = vision_tower(pipeline)?;
        let patches = vit_input(&tower.preprocess, side)?;
        be.op_times()?;
        tower.model.forward(&patches)?;
        print_op_times(be, &format!("ViT + mergers of a {side}x{side} image"))?;
    }
    for tokens in PROFILE_PREFILLS {
        // A model whose context is shorter (the tiny fixture's 2048) gets the longest prompt
        // it takes, one token short of its context.
        let tokens = tokens.min(pipeline.engine.max_context() - 1);
        let req = greedy_request(text_prompt(tokens), 1);
        be.op_times()?;
        pipeline
            .engine
            .generate(&req, |_| std::ops::ControlFlow::Continue(()))?;
        print_op_times(be, &format!("prefill of {tokens} tokens (one step)"))?;
    }
    let steps = 8;
    // Times from the moment every sequence is prefilled: decode steps only.
    batched_decode(
        &pipeline.engine,
        batch,
        context,
        steps,
        &Decoding::greedy(),
        || be.op_times().map(|_| ()).map_err(anyhow::Error::from),
    )?;
    print_op_times(
        be,
        &format!("{steps} decode steps of {batch} sequences at context {context}"),
    )?;
    // A loaded server's usual step: the sequences decode while a new prompt's chunk is
    // prefilled beside them (its arrival may also see a decode step or two go by). One fewer
    // decoding, so that the engine (sized for `batch` sequences) admits the prompt at once.
    let decoding = batch.saturating_sub(1).max(1);
    let streams = start_decoding(&pipeline.engine, decoding, context, 64, &Decoding::greedy())?;
    let chunk = 512;
    let req = greedy_request((0..chunk).map(|i| (i % 150 + 20) as u32).collect(), 1);
    be.op_times()?;
    pipeline
        .engine
        .generate(&req, |_| std::ops::ControlFlow::Continue(()))?;
    print_op_times(
        be,
        &format!(
            "{decoding} sequences at context {context} decoding while a {chunk}-token prompt is \
         prefilled beside them (the mixed step, and any decode step while it arrived)"
        ),
    )?;
    drop(streams);
    be.time_ops(false)?;
    Ok(())
}

/// Prints the device time per op since `be.op_times` was last read (the slowest 14), under
/// `what`.
fn print_op_times<B: Backend>(be: &B, what: &str) -> anyhow::Result<()> {
    let times = be.op_times()?;
    let total: f64 = times.iter().map(|t| t.ms).sum();
    println!("\nprofile: {what}: {total:.2} ms of device time");
    println!("{:<32} {:>8} {:>10} {:>7}", "op", "launches", "ms", "share");
    for t in times.iter().take(14) {
        println!(
            "{:<32} {:>8} {:>10.3} {:>6.1}%",
            t.op,
            t.launches,
            t.ms,
            100.0 * t.ms / total.max(1e-9)
        );
    }
    Ok(())
}

/// A row for the device memory in use above `base`, when the backend can tell.
/// The text decoder's weights (named by their format) and its KV cache, in bytes.
fn held_rows(engine: &llm_svc::Engine, weights: &Weights) -> Vec<Measurement> {
    let mut format = match (weights.quant_config(), weights.quantizing()) {
        (Some(q), _) => format!("{}-bit {q}", q.bits()),
        (None, Some(to)) => format!("--quantize {to}"),
        (None, None) => "the backend's format".into(),
    };
    if weights.quantizing_lm_head() {
        format += ", --quantize-lm-head";
    }
    vec![
        Measurement::amount(
            format!("memory: text decoder weights ({format})"),
            engine.weight_bytes(),
        ),
        Measurement::amount(
            format!("memory: KV cache ({} tokens)", engine.kv_cache_tokens()),
            engine.kv_cache_bytes(),
        ),
    ]
}

fn memory_row<B: Backend>(out: &mut Vec<Measurement>, name: &str, be: &B, base: Option<usize>) {
    if let (Some(now), Some(base)) = (be.memory_in_use(), base) {
        out.push(Measurement::amount(name.into(), now.saturating_sub(base)));
    }
}

/// A `side` x `side` image of a smooth gradient: the bench's stand-in for a photo.
fn gradient(side: u32) -> image::RgbImage {
    image::RgbImage::from_fn(side, side, |x, y| {
        image::Rgb([(x * 255 / side) as u8, (y * 255 / side) as u8, 128])
    })
}

/// The time-to-first-token request: a PNG of a smooth gradient (decoding and resizing it are
/// part of the cost, as for a client's image) and text of about `text_tokens` tokens.
/// Requests of different `variant`s carry different images (one pixel differs), so no cache
/// knows them.
fn ttft_request(
    chat: &ChatTokenizer,
    side: usize,
    text_tokens: usize,
    variant: u32,
) -> anyhow::Result<ChatRequest> {
    let mut img = gradient(side as u32);
    let [a, b, c, d] = variant.to_le_bytes();
    img.put_pixel(0, 0, image::Rgb([a ^ d, b, c]));
    let mut png = Vec::new();
    img.write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png)?;
    let mut text = String::from("Describe");
    while chat.encode(&text)?.len() < text_tokens {
        text.push_str(" the picture");
    }
    Ok(ChatRequest {
        messages: vec![Message::user(vec![Part::Image(png), Part::Text(text)])],
        sampling: SamplingParams::greedy(),
        max_new_tokens: 1,
        stop: Vec::new(),
        ignore_eos: true,
        return_logits: false,
        ..Default::default()
    })
}

fn ttft_name(side: usize, opts: &BenchOptions) -> String {
    format!(
        "image {side}x{side} + {} text tokens: time to first token",
        opts.ttft_text_tokens
    )
}

/// Rows for the host's share of an image's hop: packing its embeddings into an f16 message,
/// as vision-svc does (the bytes as downloaded when the ViT ran on a GPU; a conversion pass
/// from the CPU's f32), and unpacking them into the engine's request, as llm-svc does (f16
/// is kept as the received bytes; the upload happens in the step).
fn pack_and_unpack(
    image: &vision_svc::VisionOutput,
    side: usize,
    opts: &BenchOptions,
    bar: &ProgressBar,
) -> anyhow::Result<Vec<Measurement>> {
    use vlm_proto::pb;
    let pack = || vision_svc::server::to_wire(image, pb::Dtype::F16);
    let packed = pack()?;
    let bytes = packed.payload_bytes();
    let size = if bytes >= 1_000_000 {
        format!("{:.1} MB", bytes as f64 / 1e6)
    } else {
        format!("{:.1} kB", bytes as f64 / 1e3)
    };
    let what = format!("image {side}x{side}: embeddings ({size} f16)");
    let pack_s = time(opts, bar, || {
        let t = Instant::now();
        std::hint::black_box(pack()?);
        Ok(t.elapsed())
    })?;
    let request = pb::GenerateRequest {
        images: vec![pb::ImageEmbeddings {
            embeddings: packed.embeddings.clone(),
            deepstack: packed.deepstack.clone(),
            grid_thw: packed.grid_thw.clone(),
            ..Default::default()
        }],
        ..Default::default()
    };
    let unpack_s = time(opts, bar, || {
        let t = Instant::now();
        let req = llm_svc::server::request_from_pb(request.clone())
            .map_err(|e| anyhow::anyhow!("unpacking: {e}"))?;
        std::hint::black_box(req);
        Ok(t.elapsed())
    })?;
    Ok(vec![
        Measurement {
            name: format!("{what} packed"),
            seconds: pack_s,
            work: bytes as f64,
            unit: "B",
            roofline: None,
        },
        Measurement {
            name: format!("{what} unpacked"),
            seconds: unpack_s,
            work: bytes as f64,
            unit: "B",
            roofline: None,
        },
    ])
}

/// For one image side: a request with a new image for each run, and one to send every run.
type TtftRequests = (usize, Vec<ChatRequest>, ChatRequest);

/// How embeddings go from vision-svc to llm-svc in a [`through_gateway`] run.
#[derive(Clone, Copy, PartialEq)]
enum Hop {
    /// Inside the gRPC messages (services on different hosts).
    Messages,
    /// Through a shared-memory segment (services in different processes on one host).
    SharedMemory,
    /// Kept on the device (services in one process, as `vlm serve` runs them).
    Device,
}

impl Hop {
    fn name(self) -> &'static str {
        match self {
            Hop::Messages => "embeddings in the gRPC messages",
            Hop::SharedMemory => "embeddings in shared memory",
            Hop::Device => "embeddings kept on the device",
        }
    }
}

/// Starts vision-svc, llm-svc and the gateway in this process on loopback ports
/// ([`LocalStack`]), the embeddings going as `hop` says, waits until they serve, and times
/// requests (one token each) through the gateway's gRPC ChatStream: for each `(side, new,
/// again)`, `new[i]` in run `i` (an image vision-svc has not seen); kept on the device (what
/// `vlm serve` does), then `again` in every run (seen since the warm-up).
fn through_gateway<B: Backend + Clone>(
    dir: &Path,
    open: fn() -> vlm_compute::Result<B>,
    opts: &BenchOptions,
    requests: &[TtftRequests],
    hop: Hop,
    bar: &ProgressBar,
) -> anyhow::Result<Vec<Measurement>> {
    let rt = tokio::runtime::Runtime::new()?;
    let mut stack = rt.block_on(LocalStack::start(stack_config(dir, opts, hop), open))?;
    let result = first_token_rows(&rt, &mut stack, opts, requests, hop, bar);
    let stopped = rt.block_on(stack.stop());
    let rows = result?;
    stopped?;
    Ok(rows)
}

/// The services and the gateway of a [`through_gateway`] run: one request at a time, f16
/// embeddings on the hop (half the bytes of f32), going as `hop` says.
fn stack_config(dir: &Path, opts: &BenchOptions, hop: Hop) -> StackConfig {
    let mut cfg = StackConfig::loopback(dir.to_path_buf());
    cfg.random_weights = opts.random_weights;
    cfg.weights = opts.weights;
    cfg.model_name = "bench".into();
    cfg.max_concurrent = 1;
    cfg.vision_max_concurrent = 1;
    cfg.embedding_dtype = vlm_proto::pb::Dtype::F16;
    cfg.shared_memory = hop != Hop::Messages;
    cfg.device_handoff = hop == Hop::Device;
    cfg.default_max_tokens = 1;
    // As in process: every run repeats the prompt, and cached blocks would make its prefill
    // look free, so the difference between the rows would not be the hops alone.
    cfg.engine.prefix_caching = false;
    cfg
}

/// The rows of a [`through_gateway`] run, once the `stack` it started serves.
fn first_token_rows(
    rt: &tokio::runtime::Runtime,
    stack: &mut LocalStack,
    opts: &BenchOptions,
    requests: &[TtftRequests],
    hop: Hop,
    bar: &ProgressBar,
) -> anyhow::Result<Vec<Measurement>> {
    use futures::StreamExt;
    use vlm_proto::pb::gateway_client::GatewayClient;

    // The model services load for as long as weights and kernels take.
    rt.block_on(stack.ready(Duration::from_secs(1800)))?;
    let client = rt.block_on(GatewayClient::connect(format!(
        "http://{}",
        stack.grpc_addr
    )))?;
    let first_token = |req: vlm_proto::pb::ChatRequest| {
        let mut client = client.clone();
        rt.block_on(async move {
            let t = Instant::now();
            let mut stream = client.chat_stream(req).await?.into_inner();
            while let Some(chunk) = stream.next().await {
                chunk?;
            }
            anyhow::Ok(t.elapsed())
        })
    };
    // llm-svc names its shared-memory and device domains in its first answer.
    first_token(to_grpc(&requests[0].2))?;
    let path = hop.name();
    let mut rows = Vec::new();
    for (side, new, again) in requests {
        let name = ttft_name(*side, opts);
        let mut new = new.iter().map(to_grpc);
        let seconds = time(opts, bar, || {
            let req = new.next().expect("a new image for every run");
            first_token(req)
        })?;
        rows.push(Measurement {
            name: format!("{name}, through the gateway ({path})"),
            seconds,
            work: 1.0,
            unit: "request",
            roofline: None,
        });
        if hop != Hop::Device {
            continue;
        }
        let again = to_grpc(again);
        let seconds = time(opts, bar, || first_token(again.clone()))?;
        rows.push(Measurement {
            name: format!("{name}, through the gateway, image seen before"),
            seconds,
            work: 1.0,
            unit: "request",
            roofline: None,
        });
    }
    Ok(rows)
}

/// A time-to-first-token request as a client sends it to the gateway over gRPC: one token,
/// greedy, eos ignored.
fn to_grpc(request: &ChatRequest) -> vlm_proto::pb::ChatRequest {
    use vlm_proto::pb::{content_part, ContentPart};
    vlm_proto::pb::ChatRequest {
        messages: vec![vlm_proto::pb::ChatMessage {
            role: "user".into(),
            content: request.messages[0]
                .parts
                .iter()
                .map(|p| ContentPart {
                    part: Some(match p {
                        Part::Image(bytes) => content_part::Part::Image(bytes.clone()),
                        Part::Text(text) => content_part::Part::Text(text.clone()),
                    }),
                })
                .collect(),
            ..Default::default()
        }],
        max_tokens: Some(1),
        temperature: Some(0.0),
        ignore_eos: true,
        ..Default::default()
    }
}

/// Parameters of the text decoder: its layers, the embedding table and `lm_head` (one table
/// where they are tied), the final norm.
pub fn text_params(cfg: &llm_svc::ModelConfig) -> usize {
    let c = &cfg.text;
    let d = c.head_dim;
    let tables = if cfg.tie_word_embeddings { 1 } else { 2 };
    c.num_hidden_layers * (decoder_layer_matrix_params(c) + 2 * d + 2 * c.hidden_size)
        + tables * c.vocab_size * c.hidden_size
        + c.hidden_size
}

/// Parameters a decoded token reads: all of [`text_params`] but the embedding table, of which
/// it reads one row (a tied `lm_head` is the table, read whole). Until 2026-11-28 the bench
/// counted the table too (1.24 GB a token at 8B shapes), which put batch-1 decode's share of
/// the copy bandwidth 8% (f16) to 25% (W4) above what the GPU did.
pub fn decode_params(cfg: &llm_svc::ModelConfig) -> usize {
    let c = &cfg.text;
    let unread = if cfg.tie_word_embeddings {
        0
    } else {
        c.vocab_size * c.hidden_size
    };
    text_params(cfg) - unread + c.hidden_size
}

/// Multiply-adds x 2 of the ViT and its mergers for `n` patches.
pub fn vit_flops(c: &VisionConfig, n: usize) -> f64 {
    let (h, i) = (c.hidden_size as f64, c.intermediate_size as f64);
    let n = n as f64;
    let block = 2.0 * n * (4.0 * h * h + 2.0 * h * i) + 4.0 * n * n * h;
    let g = h * (c.spatial_merge_size * c.spatial_merge_size) as f64;
    let merger = 2.0 * (n / 4.0) * (g * g + g * c.out_hidden_size as f64);
    2.0 * n * c.patch_dim() as f64 * h
        + c.depth as f64 * block
        + (1 + c.deepstack_visual_indexes.len()) as f64 * merger
}

/// A table for the terminal.
pub fn table(rows: &[Measurement]) -> String {
    let width = rows.iter().map(|m| m.name.len()).max().unwrap_or(0).max(52);
    let mut s = format!(
        "{:<width$} {:>11} {:>11} {:>16} {:>9}\n",
        "measurement", "median ms", "spread ms", "throughput", "of limit"
    );
    for m in rows {
        let (value, unit) = match m.unit {
            "FLOP" => (m.throughput() / 1e9, "GFLOP/s"),
            "B" => (m.throughput() / 1e9, "GB/s"),
            "B in use" => (m.work / 1e9, "GB"),
            "request" => (m.throughput(), "req/s"),
            "image" => (m.throughput(), "img/s"),
            _ => (m.throughput(), "tok/s"),
        };
        s.push_str(&format!(
            "{:<width$} {:>11.3} {:>11.3} {:>9.1} {:<6} {:>9}\n",
            m.name,
            m.median() * 1e3,
            (m.seconds[m.seconds.len() - 1] - m.seconds[0]) * 1e3,
            value,
            unit,
            m.roofline
                .map_or("-".to_string(), |r| format!("{:.1}%", r * 100.0))
        ));
    }
    s
}

/// Seconds of each of `steps` steps' masks for `batch` answers to [`bench_schema`] (after
/// `warmup` steps), sorted, and of checking each answer's pick against its grammar without a
/// mask (mistral.rs's way: sample first, compute the mask only if the pick is refused). Each
/// answer takes, every step, an allowed token picked by a fixed hash (as random weights
/// would: strings and numbers of any length); one that completes starts over.
fn time_masks(
    grammars: &llm_svc::grammar::Grammars,
    batch: usize,
    warmup: usize,
    steps: usize,
) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    use llm_svc::grammar::{masks_by, SequenceGrammar, StepMask};
    use rayon::prelude::*;
    let constraint = bench_constraint();
    let answer = || grammars.compile(&constraint).map(SequenceGrammar::new);
    let mut answers = (0..batch)
        .map(|_| answer())
        .collect::<llm_svc::Result<Vec<_>>>()?;
    let (mut masking, mut checking) = (Vec::with_capacity(steps), Vec::with_capacity(steps));
    // The engine waits no longer than its step; here every mask is waited for.
    let never = Instant::now() + Duration::from_secs(3600);
    for step in 0..warmup + steps {
        let refs: Vec<_> = answers.iter().collect();
        let started = Instant::now();
        let masks = masks_by(&refs, never);
        let took = started.elapsed().as_secs_f64();
        let mut picks = Vec::with_capacity(batch);
        for (i, mask) in masks.into_iter().enumerate() {
            let StepMask::Mask(mask) = mask else {
                anyhow::bail!("an answer's grammar gave no mask");
            };
            let allowed: Vec<u32> = (0..mask.len() * 32)
                .filter(|&t| vlm_compute::sampling::mask_allows(&mask, t))
                .map(|t| t as u32)
                .collect();
            picks.push(allowed[(step * 7919 + i * 104_729) % allowed.len()]);
        }
        let started = Instant::now();
        let refused = answers
            .par_iter()
            .zip(&picks)
            .filter(|(a, &pick)| !a.lock().allows(pick))
            .count();
        let checked = started.elapsed().as_secs_f64();
        anyhow::ensure!(refused == 0, "{refused} allowed picks were refused");
        if step >= warmup {
            masking.push(took);
            checking.push(checked);
        }
        for (a, pick) in answers.iter_mut().zip(picks) {
            let mut g = a.lock();
            g.accept(pick);
            if g.is_complete() {
                drop(g);
                *a = answer()?;
            }
        }
    }
    masking.sort_by(f64::total_cmp);
    checking.sort_by(f64::total_cmp);
    Ok((masking, checking))
}

/// Seconds of one `sample_rows` over `rows` rows of random logits (spread as a model's, a few
/// units) with `sampling`'s settings and penalties on (a count table of `rows` slots).
fn time_sampler<B: Backend>(
    be: &B,
    rows: usize,
    vocab: usize,
    sampling: &SamplingParams,
    opts: &BenchOptions,
    bar: &ProgressBar,
) -> anyhow::Result<Vec<f64>> {
    let logits = be.random_uniform(&[rows, vocab], 77, 4.0)?;
    let params: Vec<_> = (0..rows)
        .map(|r| {
            let slot = sampling.needs_counts().then_some(r as u32);
            sampling.row(r as u64, 100, slot, 0)
        })
        .collect();
    let mut bufs = SampleBuffers::new(be, vocab, &params, &[], &[], &vec![0; rows * vocab])?;
    time(opts, bar, || {
        be.synchronize()?;
        let t = Instant::now();
        bufs.sample(be, &logits)?;
        be.synchronize()?;
        Ok(t.elapsed())
    })
}

/// Qwen3-VL's recommended sampling (its model card): what real clients send.
pub fn recommended_sampling() -> SamplingParams {
    SamplingParams {
        temperature: 0.7,
        top_p: 0.8,
        top_k: 20,
        presence_penalty: 1.5,
        seed: Some(0),
        ..SamplingParams::greedy()
    }
}

/// A greedy text request that generates `max_new_tokens` through any eos (the benchmarks'
/// fixed lengths).
fn greedy_request(prompt: Vec<u32>, max_new_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt,
        images: Vec::new(),
        sampling: SamplingParams::greedy(),
        max_new_tokens,
        ignore_eos: true,
        return_logits: false,
        constraint: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A decoded token of the 8B model reads its layers and `lm_head`, not its embedding table
    /// (151,936 x 4,096): 7.6 billion parameters of 8.2; a tied head is read once, whole.
    #[test]
    fn a_decoded_token_reads_every_weight_but_the_embedding_table() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/models/qwen3-vl-8b");
        let mut cfg = llm_svc::ModelConfig::from_dir(&dir).unwrap();
        let (table, hidden) = (
            cfg.text.vocab_size * cfg.text.hidden_size,
            cfg.text.hidden_size,
        );
        assert_eq!(table, 151_936 * 4_096);
        assert_eq!(decode_params(&cfg), text_params(&cfg) - table + hidden);
        let billions = decode_params(&cfg) as f64 / 1e9;
        assert!((7.5..7.7).contains(&billions), "{billions} billion");
        let untied = text_params(&cfg);
        cfg.tie_word_embeddings = true;
        assert_eq!(text_params(&cfg), untied - table);
        assert_eq!(decode_params(&cfg), text_params(&cfg) + hidden);
    }

    #[test]
    fn memory_rows_carry_their_bytes_and_rates_their_rate() {
        let memory = Measurement {
            name: "memory: both models".into(),
            seconds: vec![0.0],
            work: 17e9,
            unit: "B in use",
            roofline: None,
        };
        let v = memory.to_json("gpu", "8b");
        assert_eq!(v["throughput"].as_f64(), Some(17e9), "{v}");
        assert_eq!(v["unit"], "B in use");
        assert!(table(&[memory]).contains("17.0 GB"));
        let decode = Measurement {
            name: "decode".into(),
            seconds: vec![0.01, 0.02, 0.03],
            work: 1.0,
            unit: "token",
            roofline: Some(0.5),
        };
        let v = decode.to_json("gpu", "8b");
        assert_eq!(
            (v["throughput"].as_f64(), &v["unit"]),
            (Some(50.0), &json!("token/s"))
        );
    }
}
