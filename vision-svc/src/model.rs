//! The Qwen3-VL vision tower, written once against [`Backend`].
//!
//! Reference: transformers `models/qwen3_vl/modeling_qwen3_vl.py` (`Qwen3VLVisionModel`).
//! Per image:
//! ```text
//! patches ─patch_embed (Conv3d == one GEMM)─▶ + learned pos-embed, bilinearly interpolated
//!   ─▶ depth × Block: x += proj(attn(rope2d(q), rope2d(k), v)) over LN1(x);  x += MLP(LN2(x))
//!        └─ after blocks in deepstack_visual_indexes: DeepStack merger (LN after 2×2 grouping)
//!   ─▶ merger: LN ─▶ group 2×2 ─▶ Linear ─▶ GELU ─▶ Linear → [tokens, out_hidden]
//! ```
//! Several images go through one pass together ([`VisionModel::forward_batch`]): their patches
//! are concatenated row-wise, every op but attention works row by row, and attention is full
//! (non-causal) within each image and never across them, which is what HF's per-image
//! `cu_seqlens` split computes. On the CPU an image's outputs are therefore bit for bit the
//! same whatever else is in its pass.
//!
//! A pass of one image replays its grid's recording where the backend records
//! ([`Backend::record`]; a CUDA graph): the tower as one launch instead of ~400, which at
//! 448x448 the host took as long to queue one by one as the device took to run them.

use std::sync::Mutex;
use std::time::Instant;

use tracing::debug_span;
use vlm_compute::nn::Linear;
use vlm_compute::patches::PatchLayout;
use vlm_compute::{
    AttentionWeights, Backend, Embeddings, GeluKind, HostTensor, LayerNormParams, WeightPrefix,
    Weights,
};

use crate::{Error, PatchValues, Patches, Result, VisionConfig};

const LN_EPS: f32 = 1e-6;
/// Single-image passes of up to this many patches are recorded, one recording per grid (1024
/// patches is 512x512 pixels). Past it the device's work hides the host's queueing anyway,
/// and a recording keeps its activations' memory while it lives.
const RECORD_MAX_PATCHES: usize = 4096;
/// Grids whose recordings are kept, the least recently used dropped first.
const RECORDED_GRIDS: usize = 4;

/// What the vision tower produces for one image: on the host, f32 from the CPU and f16 from a
/// GPU ([`Backend::download_embeddings`], the element type the wire carries them in), or kept
/// on the device ([`Delivery::Device`]).
#[derive(Clone, Debug, PartialEq)]
pub struct VisionOutput {
    /// `[tokens, out_hidden]`: replaces the image placeholder tokens in the LLM input.
    pub embeds: Embeddings,
    /// One `[tokens, out_hidden]` per DeepStack tap; added after LLM layers 0, 1, 2, ...
    pub deepstack: Vec<Embeddings>,
    /// Patch grid (t, h, w) before merging.
    pub grid_thw: [usize; 3],
}

struct LayerNorm<B: Backend> {
    w: B::Tensor,
    b: B::Tensor,
}

impl<B: Backend> LayerNorm<B> {
    fn new(be: &B, w: &WeightPrefix, dim: usize) -> Result<Self> {
        Ok(Self {
            w: w.load(be, "weight", &[dim])?,
            b: w.load(be, "bias", &[dim])?,
        })
    }
    fn forward(&self, be: &B, x: &B::Tensor) -> Result<B::Tensor> {
        Ok(be.layer_norm(x, &self.w, &self.b, LN_EPS)?)
    }
    /// As a fused op's operand (the norm before a block's projections).
    fn params(&self) -> LayerNormParams<'_, B> {
        LayerNormParams {
            w: &self.w,
            b: &self.b,
            eps: LN_EPS,
        }
    }
}

struct Attention<B: Backend> {
    qkv: Linear<B>,
    proj: Linear<B>,
    heads: usize,
}

impl<B: Backend> Attention<B> {
    fn new(be: &B, w: &WeightPrefix, cfg: &VisionConfig) -> Result<Self> {
        let h = cfg.hidden_size;
        Ok(Self {
            // q, k and v as the checkpoint stores them: one [3h, h] projection, one GEMM.
            qkv: Linear::load(be, &w.pp("qkv"), 3 * h, h, true)?,
            proj: Linear::load(be, &w.pp("proj"), h, h, true)?,
            heads: cfg.num_heads,
        })
    }

    /// `x += proj(attention(rope(q), rope(k), v))` with q, k, v from `norm(x)`, each image
    /// attending to itself only: one op ([`Backend::layer_norm_rope_attention`]).
    fn forward(
        &self,
        be: &B,
        x: &mut B::Tensor,
        norm: &LayerNorm<B>,
        pass: &Pass<B>,
    ) -> Result<()> {
        let weights = AttentionWeights {
            qkv: self.qkv.projection(),
            heads: self.heads,
            proj: self.proj.projection(),
        };
        let rope = [&pass.cos, &pass.sin];
        let lens = &pass.patches_per_image;
        Ok(be.layer_norm_rope_attention(x, norm.params(), weights, rope, lens)?)
    }
}

struct Block<B: Backend> {
    norm1: LayerNorm<B>,
    attn: Attention<B>,
    norm2: LayerNorm<B>,
    fc1: Linear<B>,
    fc2: Linear<B>,
    act: GeluKind,
}

impl<B: Backend> Block<B> {
    fn new(be: &B, w: &WeightPrefix, cfg: &VisionConfig) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Self {
            norm1: LayerNorm::new(be, &w.pp("norm1"), h)?,
            attn: Attention::new(be, &w.pp("attn"), cfg)?,
            norm2: LayerNorm::new(be, &w.pp("norm2"), h)?,
            fc1: Linear::load(be, &w.pp("mlp.linear_fc1"), i, h, true)?,
            fc2: Linear::load(be, &w.pp("mlp.linear_fc2"), h, i, true)?,
            act: if cfg.hidden_act == "gelu" {
                GeluKind::Erf
            } else {
                GeluKind::Tanh
            },
        })
    }

    fn forward(&self, be: &B, x: &mut B::Tensor, pass: &Pass<B>) -> Result<()> {
        self.attn.forward(be, x, &self.norm1, pass)?;
        let (fc1, fc2) = (self.fc1.projection(), self.fc2.projection());
        Ok(be.layer_norm_mlp(x, self.norm2.params(), fc1, self.act, fc2)?)
    }
}

/// Groups each 2×2 window of patches into one token and projects it to the LLM width.
struct Merger<B: Backend> {
    norm: LayerNorm<B>,
    /// DeepStack mergers normalize after grouping (over 4·hidden), the final one before.
    norm_after_grouping: bool,
    fc1: Linear<B>,
    fc2: Linear<B>,
    hidden: usize,
    grouped: usize,
}

impl<B: Backend> Merger<B> {
    fn new(
        be: &B,
        w: &WeightPrefix,
        cfg: &VisionConfig,
        norm_after_grouping: bool,
    ) -> Result<Self> {
        let hidden = cfg.hidden_size;
        let grouped = hidden * cfg.spatial_merge_size * cfg.spatial_merge_size;
        let norm_dim = if norm_after_grouping { grouped } else { hidden };
        Ok(Self {
            norm: LayerNorm::new(be, &w.pp("norm"), norm_dim)?,
            norm_after_grouping,
            fc1: Linear::load(be, &w.pp("linear_fc1"), grouped, grouped, true)?,
            fc2: Linear::load(be, &w.pp("linear_fc2"), cfg.out_hidden_size, grouped, true)?,
            hidden,
            grouped,
        })
    }

    fn forward(&self, be: &B, x: &B::Tensor) -> Result<B::Tensor> {
        let tokens = be.shape(x)[0] * self.hidden / self.grouped;
        let x = if self.norm_after_grouping {
            let g = be.reshape(x.clone(), &[tokens, self.grouped])?;
            self.norm.forward(be, &g)?
        } else {
            let n = self.norm.forward(be, x)?;
            be.reshape(n, &[tokens, self.grouped])?
        };
        let h = self.fc1.forward(be, &x)?;
        Ok(self.fc2.forward(be, &be.gelu(&h, GeluKind::Erf)?)?)
    }
}

/// What a pass needs besides the patches: where each image's rows are, the learned position
/// embedding and the 2-D rotary tables of all rows. All of it follows from the images' grids.
struct Pass<B: Backend> {
    /// Rows of each image, in pass order; attention stays within each run.
    patches_per_image: Vec<usize>,
    /// `[rows, hidden]`: each image's position embedding, interpolated to its grid.
    pos_embed: B::Tensor,
    /// `[rows, head_dim]` each, every image's tables one after the other.
    cos: B::Tensor,
    sin: B::Tensor,
}

/// A single image's pass recorded for its grid: the patches are written into `pixels`, the
/// recording replayed, and the outputs copied out of `outputs` (the next replay overwrites
/// them).
struct RecordedPass<B: Backend> {
    grid: [usize; 3],
    /// The grid's constant inputs: kept for the recording, which reads their buffers.
    _pass: Pass<B>,
    pixels: B::Tensor,
    /// The merger's output, then each DeepStack merger's.
    outputs: Vec<B::Tensor>,
    graph: B::Graph,
}

/// The recordings of single-image passes, least recently used first.
struct Recordings<B: Backend> {
    passes: Vec<RecordedPass<B>>,
    /// Set when the backend does not record (or recording failed): never tried again.
    unsupported: bool,
}

pub struct VisionModel<B: Backend> {
    backend: B,
    cfg: VisionConfig,
    patch_embed: Linear<B>,
    pos_embed: B::Tensor,
    blocks: Vec<Block<B>>,
    merger: Merger<B>,
    deepstack_mergers: Vec<Merger<B>>,
    /// Rotary inverse frequencies, `head_dim / 4` of them (shared by rows and columns).
    inv_freq: Vec<f32>,
    recordings: Mutex<Recordings<B>>,
}

impl<B: Backend> VisionModel<B> {
    pub fn new(cfg: VisionConfig, weights: &Weights, backend: B) -> Result<Self> {
        let be = &backend;
        let w = weights.pp("model.visual");
        let h = cfg.hidden_size;
        // Conv3d weight [h, C, T, P, P] flattened to [h, C·T·P·P] matches the patch layout.
        let pe = w.pp("patch_embed.proj");
        let conv_shape = [
            h,
            cfg.in_channels,
            cfg.temporal_patch_size,
            cfg.patch_size,
            cfg.patch_size,
        ];
        let patch_embed = Linear::from_host(
            be,
            &pe.get("weight", &conv_shape)?
                .reshape(vec![h, cfg.patch_dim()])?,
            Some(&pe.get("bias", &[h])?),
        )?;
        let pos_embed = w.load(be, "pos_embed.weight", &[cfg.num_position_embeddings, h])?;
        let blocks = (0..cfg.depth)
            .map(|i| Block::new(be, &w.pp("blocks").pp(i), &cfg))
            .collect::<Result<Vec<_>>>()?;
        let merger = Merger::new(be, &w.pp("merger"), &cfg, false)?;
        let deepstack_mergers = (0..cfg.deepstack_visual_indexes.len())
            .map(|i| Merger::new(be, &w.pp("deepstack_merger_list").pp(i), &cfg, true))
            .collect::<Result<Vec<_>>>()?;
        let spatial = cfg.head_dim() / 2;
        let theta = cfg.rope_theta() as f32;
        let inv_freq = (0..spatial / 2)
            .map(|j| 1.0 / theta.powf((2 * j) as f32 / spatial as f32))
            .collect();
        Ok(Self {
            backend,
            cfg,
            patch_embed,
            pos_embed,
            blocks,
            merger,
            deepstack_mergers,
            inv_freq,
            recordings: Mutex::new(Recordings {
                passes: Vec::new(),
                unsupported: false,
            }),
        })
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub fn config(&self) -> &VisionConfig {
        &self.cfg
    }

    /// (row, col) of every patch in merge-window order, repeated for each frame.
    fn patch_positions(&self, [t, h, w]: [usize; 3]) -> Vec<(usize, usize)> {
        let m = self.cfg.spatial_merge_size;
        let mut pos = Vec::with_capacity(t * h * w);
        for _ in 0..t {
            for br in 0..h / m {
                for bc in 0..w / m {
                    for ir in 0..m {
                        for ic in 0..m {
                            pos.push((br * m + ir, bc * m + ic));
                        }
                    }
                }
            }
        }
        pos
    }

    /// Bilinear (align_corners) taps into the learned `side × side` table for each patch.
    fn pos_embed_taps(&self, grid: [usize; 3], pos: &[(usize, usize)]) -> (Vec<u32>, Vec<f32>) {
        let side = self.cfg.pos_grid_side();
        let axis = |i: usize, size: usize| -> [(usize, f32); 2] {
            // Same f32 arithmetic as transformers' `_interpolation_axis_taps_weights`.
            let src = i as f32 * (side - 1) as f32 / (size.max(2) - 1) as f32;
            let f = src.floor();
            [0, 1].map(|o| {
                let tap = (f as usize + o).min(side - 1);
                (tap, (1.0 - (src - f - o as f32).abs()).max(0.0))
            })
        };
        let (mut idx, mut wts) = (Vec::new(), Vec::new());
        for &(r, c) in pos {
            for (hr, hw) in axis(r, grid[1]) {
                for (wc, ww) in axis(c, grid[2]) {
                    idx.push((hr * side + wc) as u32);
                    wts.push(hw * ww);
                }
            }
        }
        (idx, wts)
    }

    /// 2-D rotary tables for patches at `pos`: cos and sin, `[patches, head_dim]` each.
    fn rope_tables(&self, pos: &[(usize, usize)]) -> (Vec<f32>, Vec<f32>) {
        let d = self.cfg.head_dim();
        let q = self.inv_freq.len();
        // Rows and columns take the same few values: their angles once per value, then
        // copied into place (per patch, 896x896 took 451k sin/cos calls).
        let side = pos.iter().map(|&(r, c)| r.max(c) + 1).max().unwrap_or(0);
        let angles: Vec<(f32, f32)> = (0..side)
            .flat_map(|i| self.inv_freq.iter().map(move |f| (i as f32 * f).sin_cos()))
            .collect();
        let (mut cos, mut sin) = (vec![0f32; pos.len() * d], vec![0f32; pos.len() * d]);
        for (i, &(r, c)) in pos.iter().enumerate() {
            for half in [0, d / 2] {
                for (axis, offset) in [(r, 0), (c, q)] {
                    let at = i * d + half + offset;
                    for (j, &(s, co)) in angles[axis * q..(axis + 1) * q].iter().enumerate() {
                        cos[at + j] = co;
                        sin[at + j] = s;
                    }
                }
            }
        }
        (cos, sin)
    }

    /// How this tower's patches are cut.
    fn layout(&self) -> PatchLayout {
        PatchLayout {
            patch: self.cfg.patch_size,
            merge: self.cfg.spatial_merge_size,
            temporal: self.cfg.temporal_patch_size,
        }
    }

    /// Checks that `patches` came from this tower's preprocessing; returns its patch count.
    fn check(&self, patches: &Patches) -> Result<usize> {
        let cfg = &self.cfg;
        let grid = patches.grid_thw;
        let m = cfg.spatial_merge_size;
        let n = patches.rows();
        let (fits, what) = match &patches.values {
            PatchValues::Values(v) => (
                v.shape() == [n, cfg.patch_dim()],
                format!("values {:?}", v.shape()),
            ),
            PatchValues::Image { image, layout, .. } => (
                *layout == self.layout()
                    && grid[0] == 1
                    && image.height == grid[1] * layout.patch
                    && image.width == grid[2] * layout.patch,
                format!("a {}x{} image cut as {layout:?}", image.width, image.height),
            ),
        };
        if grid[1] % m != 0 || grid[2] % m != 0 || !fits {
            return Err(Error::Config(format!(
                "patches ({what}) with grid {grid:?} do not fit this tower (patch dim {}, merge {m})",
                cfg.patch_dim()
            )));
        }
        Ok(n)
    }

    /// `patches`' values on the device, `[rows, patch dim]`: uploaded, or cut there from the
    /// image's bytes.
    fn values_on_device(&self, patches: &Patches) -> Result<B::Tensor> {
        let be = &self.backend;
        Ok(match &patches.values {
            PatchValues::Values(v) => be.upload(v)?,
            PatchValues::Image {
                image,
                table,
                layout,
            } => be.patchify(&image.data, image.height, image.width, table, *layout)?,
        })
    }

    /// Encodes one image's patches: [`Self::forward_batch`] of one.
    pub fn forward(&self, patches: &Patches) -> Result<VisionOutput> {
        let mut out = self.forward_batch(std::slice::from_ref(patches))?;
        Ok(out.pop().expect("one output per image"))
    }

    /// Encodes several images in one pass and returns their outputs, on the host, in the same
    /// order. Each output equals (on the CPU, bit for bit) what [`Self::forward`] gives for
    /// that image alone; the pass just runs every GEMM over all images' rows at once.
    pub fn forward_batch(&self, images: &[Patches]) -> Result<Vec<VisionOutput>> {
        let host = vec![Delivery::Host; images.len()];
        self.forward_delivered(images, &host)
    }

    /// [`Self::forward_batch`], each image's output delivered as `deliver` says: downloaded,
    /// or kept on the device for the language stage in this process
    /// ([`Backend::hand_off`]).
    pub fn forward_delivered(
        &self,
        images: &[Patches],
        deliver: &[Delivery],
    ) -> Result<Vec<VisionOutput>> {
        if deliver.len() != images.len() {
            return Err(Error::Config(format!(
                "{} images, {} deliveries",
                images.len(),
                deliver.len()
            )));
        }
        let be = &self.backend;
        let cfg = &self.cfg;
        if images.is_empty() {
            return Ok(Vec::new());
        }
        let patches_per_image = images
            .iter()
            .map(|p| self.check(p))
            .collect::<Result<Vec<_>>>()?;
        let rows: usize = patches_per_image.iter().sum();
        let mut outputs = self
            .run(images, patches_per_image.clone(), rows)?
            .into_iter();
        let embeds = outputs.next().expect("the merger's output first");
        let deepstack: Vec<B::Tensor> = outputs.collect();
        let _outputs_span = debug_span!("vit_outputs").entered();
        // Downloads wait for the device: only once it has run every layer. One download of
        // the whole pass serves every image delivered to the host.
        let downloaded = if deliver.contains(&Delivery::Host) {
            let all: Vec<Embeddings> = std::iter::once(&embeds)
                .chain(&deepstack)
                .map(|t| be.download_embeddings(t))
                .collect::<vlm_compute::Result<_>>()?;
            Some(all)
        } else {
            None
        };

        // Mergers turn each 2×2 window (4 consecutive rows, never straddling two images) into
        // one token, so image i's tokens are its patches / merge² rows, in pass order.
        let group = cfg.spatial_merge_size * cfg.spatial_merge_size;
        let whole = images.len() == 1;
        let mut outputs = Vec::with_capacity(images.len());
        let mut start = 0;
        for ((p, &n), how) in images.iter().zip(&patches_per_image).zip(deliver) {
            let end = start + n / group;
            let mut rows: Vec<Embeddings> = match (how, &downloaded) {
                (Delivery::Host, Some(all)) if whole => all.clone(),
                (Delivery::Host, Some(all)) => all
                    .iter()
                    .map(|t| t.slice_rows(start, end))
                    .collect::<vlm_compute::Result<_>>()?,
                (Delivery::Host, None) => unreachable!("downloaded when any image is for the host"),
                (Delivery::Device { identity }, _) => std::iter::once(&embeds)
                    .chain(&deepstack)
                    .map(|t| {
                        let t = if whole {
                            t.clone()
                        } else {
                            be.slice_rows(t, start, end)?
                        };
                        be.hand_off(t, identity.clone())
                    })
                    .collect::<vlm_compute::Result<_>>()?,
            };
            let embeds = rows.remove(0);
            outputs.push(VisionOutput {
                embeds,
                deepstack: rows,
                grid_thw: p.grid_thw,
            });
            start = end;
        }
        Ok(outputs)
    }

    /// The tower's outputs for `images` (`rows` patches, `patches_per_image` of each), all
    /// images' rows together on the device: the merger's, then each DeepStack merger's. Debug
    /// spans say where a pass's wall time goes: host inputs and uploads, then queueing the
    /// layers (the device runs them meanwhile); the caller's `vit_outputs` waits for them.
    fn run(
        &self,
        images: &[Patches],
        patches_per_image: Vec<usize>,
        rows: usize,
    ) -> Result<Vec<B::Tensor>> {
        let be = &self.backend;
        if let [image] = images {
            if rows <= RECORD_MAX_PATCHES && !be.timing_ops() {
                if let Some(out) = self.replayed(image)? {
                    return Ok(out);
                }
            }
        }
        let inputs_span = debug_span!("vit_inputs", rows).entered();
        let pass = self.pass(images, patches_per_image)?;
        // From here on every op sees one matrix of all images' rows (one image's are that
        // matrix already).
        let pixels = match images {
            [p] => self.values_on_device(p)?,
            _ => {
                let mut pixels = be.zeros(&[rows, self.cfg.patch_dim()])?;
                let mut start = 0;
                for p in images {
                    let n = p.rows();
                    let at: Vec<usize> = (start..start + n).collect();
                    be.scatter_rows(&mut pixels, &at, &self.values_on_device(p)?)?;
                    start += n;
                }
                pixels
            }
        };
        drop(inputs_span);
        let _layers_span = debug_span!("vit_layers").entered();
        self.layers(&pixels, &pass)
    }

    /// The inputs of a pass over `images` besides their patches: position embeddings and
    /// rotary tables, image by image, each as if its image were alone.
    fn pass(&self, images: &[Patches], patches_per_image: Vec<usize>) -> Result<Pass<B>> {
        let be = &self.backend;
        let rows = patches_per_image.iter().sum();
        let (mut taps, mut tap_weights, mut pos) = (Vec::new(), Vec::new(), Vec::new());
        for p in images {
            let image_pos = self.patch_positions(p.grid_thw);
            let (idx, wts) = self.pos_embed_taps(p.grid_thw, &image_pos);
            taps.extend(idx);
            tap_weights.extend(wts);
            pos.extend(image_pos);
        }
        let (cos, sin) = self.rope_tables(&pos);
        let d = self.cfg.head_dim();
        Ok(Pass {
            patches_per_image,
            pos_embed: be.weighted_gather(&self.pos_embed, &taps, &tap_weights, 4)?,
            cos: be.upload(&HostTensor::new(vec![rows, d], cos)?)?,
            sin: be.upload(&HostTensor::new(vec![rows, d], sin)?)?,
        })
    }

    /// The layers from the patch embedding to the mergers: what [`Self::run`] returns.
    fn layers(&self, pixels: &B::Tensor, pass: &Pass<B>) -> Result<Vec<B::Tensor>> {
        let be = &self.backend;
        let x = self.patch_embed.forward(be, pixels)?;
        let mut x = be.add(&x, &pass.pos_embed)?;
        let mut outputs = vec![];
        for (i, block) in self.blocks.iter().enumerate() {
            block.forward(be, &mut x, pass)?;
            if let Some(j) = self
                .cfg
                .deepstack_visual_indexes
                .iter()
                .position(|&d| d == i)
            {
                outputs.push(self.deepstack_mergers[j].forward(be, &x)?);
            }
        }
        outputs.insert(0, self.merger.forward(be, &x)?);
        Ok(outputs)
    }

    /// `image`'s outputs from its grid's recording, recorded first if the grid has none;
    /// `None` where the backend does not record (the caller runs the ops itself).
    fn replayed(&self, image: &Patches) -> Result<Option<Vec<B::Tensor>>> {
        let be = &self.backend;
        let mut recordings = self.recordings.lock().unwrap_or_else(|e| e.into_inner());
        if recordings.unsupported {
            return Ok(None);
        }
        let passes = &mut recordings.passes;
        let recorded = match passes.iter().position(|r| r.grid == image.grid_thw) {
            Some(at) => passes.remove(at),
            None => match self.record(image)? {
                Some(r) => r,
                None => {
                    recordings.unsupported = true;
                    return Ok(None);
                }
            },
        };
        if passes.len() == RECORDED_GRIDS {
            passes.remove(0);
        }
        passes.push(recorded);
        let r = passes.last_mut().expect("just pushed");
        let inputs_span = debug_span!("vit_inputs", rows = image.rows()).entered();
        match &image.values {
            PatchValues::Values(v) => be.write(&mut r.pixels, v.data())?,
            PatchValues::Image { .. } => be.copy(&mut r.pixels, &self.values_on_device(image)?)?,
        }
        drop(inputs_span);
        let _layers_span = debug_span!("vit_layers", recorded = true).entered();
        be.replay(&r.graph)?;
        // Copies out: the next replay writes the same buffers.
        let out = r
            .outputs
            .iter()
            .map(|t| be.slice_rows(t, 0, be.shape(t)[0]))
            .collect::<vlm_compute::Result<_>>()?;
        Ok(Some(out))
    }

    /// Records the pass of one image of `image`'s grid. `None` if the backend does not record
    /// or recording failed (logged: passes then run op by op, slower but the same).
    fn record(&self, image: &Patches) -> Result<Option<RecordedPass<B>>> {
        let be = &self.backend;
        let cfg = &self.cfg;
        let rows = image.rows();
        let pass = self.pass(std::slice::from_ref(image), vec![rows])?;
        let pixels = be.zeros(&[rows, cfg.patch_dim()])?;
        let tokens = rows / (cfg.spatial_merge_size * cfg.spatial_merge_size);
        let mut outputs = (0..=cfg.deepstack_visual_indexes.len())
            .map(|_| be.zeros(&[tokens, cfg.out_hidden_size]))
            .collect::<vlm_compute::Result<Vec<_>>>()?;
        let started = Instant::now();
        let recorded = be.record(&mut || {
            // Only the backend's errors can come out of the layers.
            let got = self.layers(&pixels, &pass).map_err(|e| match e {
                Error::Compute(e) => e,
                other => vlm_compute::Error::Shape {
                    op: "ViT pass",
                    message: other.to_string(),
                },
            })?;
            for (out, t) in outputs.iter_mut().zip(&got) {
                be.copy(out, t)?;
            }
            Ok(())
        });
        match recorded {
            Ok(Some(graph)) => {
                tracing::debug!(
                    grid = ?image.grid_thw,
                    ms = started.elapsed().as_secs_f64() * 1e3,
                    "ViT pass recorded"
                );
                Ok(Some(RecordedPass {
                    grid: image.grid_thw,
                    _pass: pass,
                    pixels,
                    outputs,
                    graph,
                }))
            }
            Ok(None) => Ok(None),
            Err(e) => {
                tracing::warn!(grid = ?image.grid_thw, error = %e, "a ViT pass could not be recorded; running passes op by op");
                Ok(None)
            }
        }
    }
}

/// Where an image's output goes from a pass.
#[derive(Clone, Debug, PartialEq)]
pub enum Delivery {
    /// Downloaded to the host (f32 from the CPU, f16 from a GPU).
    Host,
    /// Kept on the device ([`Embeddings::Device`]) for the language stage in this process;
    /// `identity` stands for the values in its prefix cache.
    Device { identity: Vec<u8> },
}
