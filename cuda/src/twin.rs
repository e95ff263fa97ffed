//! A device backend checked against its CPU twin, op by op, on the same inputs.
//!
//! One [`Case`] is one op at one size; [`compare`] runs it on the CPU reference and on the
//! device and measures the difference. Two users:
//! - `tests/cuda_twin.rs` runs cases at the real Qwen3-VL-8B and ViT sizes on the GPU machine;
//! - [`self_check`] runs [`self_check_cases`] (small sizes that still reach every kernel and
//!   every branch in them) each time a GPU is opened for serving, so `--device cuda` never
//!   serves from kernels that disagree with the reference on the hardware at hand.
//!
//! Tolerances ([`Case::tolerance`]) are relative to the largest |CPU output|. Both sides
//! compute in f32; the device differs in summation order (cuBLAS blocking, warp reductions,
//! online softmax) and, where it uses tensor cores, in rounding operands to f16. Inputs that
//! meet an f16 weight are f16-exact, so both sides multiply the same values.

use crate::{AttnMask, Backend, CpuBackend, Error, GeluKind, HostTensor, Result};

/// One op at one size, with inputs that are a pure function of the case (the counter-based
/// random values of [`crate::random`], so no RNG state is shared between the two runs).
#[derive(Clone, Debug)]
pub enum Case {
    Add {
        rows: usize,
        cols: usize,
    },
    SiluMul {
        rows: usize,
        cols: usize,
    },
    Gelu {
        rows: usize,
        cols: usize,
        kind: GeluKind,
    },
    LayerNorm {
        rows: usize,
        cols: usize,
    },
    RmsNorm {
        rows: usize,
        cols: usize,
    },
    /// `[n, k] · [m, k]ᵀ (+ bias)`: up to 4 rows run the device's GEMV (decode), more its GEMM.
    Linear {
        n: usize,
        k: usize,
        m: usize,
        bias: bool,
    },
    /// The fused gate/up/SwiGLU of the text MLP.
    Swiglu {
        n: usize,
        k: usize,
        m: usize,
    },
    Rope {
        tokens: usize,
        heads: usize,
        dim: usize,
    },
    /// Prefill / ViT attention: 16 queries and up run flash attention on the GPU.
    Attention {
        queries: usize,
        q_heads: usize,
        kv_heads: usize,
        dim: usize,
        slots: usize,
        kv_len: usize,
        mask: AttnMask,
    },
    /// One decoded token attending to cache slots `0..=slot` (the slot read from the device).
    DecodeAttention {
        q_heads: usize,
        kv_heads: usize,
        dim: usize,
        slots: usize,
        slot: usize,
    },
    WriteRowAt {
        kv_heads: usize,
        dim: usize,
        slots: usize,
        slot: usize,
    },
    /// Greedy pick over `n` logits; `tie` puts the same largest value at two places.
    Argmax {
        n: usize,
        tie: Option<(usize, usize)>,
    },
    Embedding {
        vocab: usize,
        width: usize,
    },
    WeightedGather {
        rows: usize,
        width: usize,
        out: usize,
        taps: usize,
    },
    /// `slice_rows`, `write_rows`, `scatter_rows`, `add_rows` together, and that a tensor
    /// cloned before an in-place update keeps its values.
    RowUpdates,
    /// Random-weight generation: bit for bit on every backend.
    RandomUniform {
        shape: Vec<usize>,
    },
    /// A decode-like step (embedding of a token read from the device, a GEMV, a cache row
    /// written at a slot read from the device) recorded once ([`Backend::record`]: a CUDA
    /// graph) and replayed twice with other token and slot values written in between: the
    /// replays must read the new values and write where they say, as every decoded token does.
    RecordReplay,
}

/// How one case came out.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub case: String,
    /// Largest |device - cpu| (infinite if the device produced NaN or ∞ where the CPU did not).
    pub max_diff: f32,
    /// The difference allowed: tolerance × max(|cpu|, 1e-3).
    pub limit: f32,
}

impl Outcome {
    /// Compares two outputs of the same case.
    pub fn of(case: String, cpu: &HostTensor, device: &HostTensor, tolerance: f32) -> Self {
        let scale = cpu.data().iter().fold(1e-3f32, |m, v| m.max(v.abs()));
        let max_diff = if cpu.shape() != device.shape() {
            f32::INFINITY
        } else {
            // Not HostTensor::max_abs_diff: f32::max ignores NaN, and a NaN from a kernel is
            // the first thing this must catch.
            cpu.data()
                .iter()
                .zip(device.data())
                .map(|(c, d)| {
                    let diff = (c - d).abs();
                    if diff.is_nan() {
                        f32::INFINITY
                    } else {
                        diff
                    }
                })
                .fold(0.0, f32::max)
        };
        Outcome {
            case,
            max_diff,
            limit: tolerance * scale,
        }
    }

    pub fn passed(&self) -> bool {
        self.max_diff <= self.limit
    }

    /// How much of the allowed difference was used: 1 is at the tolerance (infinite for any
    /// difference in an exact case), for reporting how close a passing run came.
    pub fn share_of_allowed(&self) -> f32 {
        if self.max_diff == 0.0 {
            0.0
        } else if self.limit == 0.0 {
            f32::INFINITY
        } else {
            self.max_diff / self.limit
        }
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: max diff {:.2e} (allowed {:.2e})",
            self.case, self.max_diff, self.limit
        )
    }
}

impl Case {
    /// A name that says the op and the size, for logs and failures.
    pub fn name(&self) -> String {
        match self {
            Case::Add { rows, cols } => format!("add [{rows},{cols}]"),
            Case::SiluMul { rows, cols } => format!("silu_mul [{rows},{cols}]"),
            Case::Gelu { rows, cols, kind } => format!("gelu {kind:?} [{rows},{cols}]"),
            Case::LayerNorm { rows, cols } => format!("layer_norm [{rows},{cols}]"),
            Case::RmsNorm { rows, cols } => format!("rms_norm [{rows},{cols}]"),
            Case::Linear { n, k, m, bias } => {
                format!("linear{} {n}x{k}->{m}", if *bias { "+bias" } else { "" })
            }
            Case::Swiglu { n, k, m } => format!("swiglu {n}x{k}->{m}"),
            Case::Rope { tokens, heads, dim } => format!("rope [{tokens},{heads},{dim}]"),
            Case::Attention {
                queries,
                q_heads,
                kv_heads,
                dim,
                kv_len,
                mask,
                ..
            } => format!("attention q{queries} h{q_heads}/{kv_heads} d{dim} kv{kv_len} {mask:?}"),
            Case::DecodeAttention {
                q_heads,
                kv_heads,
                dim,
                slots,
                slot,
            } => format!("decode_attention h{q_heads}/{kv_heads} d{dim} slots{slots} at {slot}"),
            Case::WriteRowAt {
                kv_heads,
                dim,
                slots,
                slot,
            } => format!("write_row_at h{kv_heads} d{dim} slots{slots} at {slot}"),
            Case::Argmax { n, tie } => format!("argmax over {n} (tie {tie:?})"),
            Case::Embedding { vocab, width } => format!("embedding [{vocab},{width}]"),
            Case::WeightedGather {
                rows,
                width,
                out,
                taps,
            } => format!("weighted_gather [{rows},{width}] -> {out} x{taps}"),
            Case::RowUpdates => "slice/write/scatter/add rows".into(),
            Case::RandomUniform { shape } => format!("random_uniform {shape:?}"),
            Case::RecordReplay => "record once, replay with new inputs".into(),
        }
    }

    /// The allowed difference relative to the largest |CPU output|, and why.
    pub fn tolerance(&self) -> f32 {
        match self {
            // Exact on every backend: gathers, copies, comparisons, integer hashing.
            Case::WriteRowAt { .. }
            | Case::Argmax { .. }
            | Case::Embedding { .. }
            | Case::RowUpdates
            | Case::RandomUniform { .. } => 0.0,
            // A GEMV and copies: summation order only.
            Case::RecordReplay => 1e-4,
            // One rounding per element, or a short sum.
            Case::Add { .. } | Case::WeightedGather { .. } => 1e-6,
            // Transcendentals: the device's expf/tanhf/erff are within a few ulp.
            Case::SiluMul { .. } | Case::Gelu { .. } | Case::Rope { .. } => 1e-5,
            // Reductions over a row, in another order.
            Case::LayerNorm { .. } | Case::RmsNorm { .. } | Case::DecodeAttention { .. } => 1e-4,
            // Long dot products in another order; k >= 4096 sums are long enough to need more.
            Case::Linear { k, .. } | Case::Swiglu { k, .. } => {
                if *k >= 4096 {
                    2e-4
                } else {
                    1e-4
                }
            }
            // Flash attention rounds Q (scaled), K, V and the probabilities to f16 for the
            // tensor cores (2^-11 relative each) and accumulates in f32; fewer queries run the
            // f32 kernel, which differs in summation order only.
            Case::Attention { queries, .. } => {
                if *queries >= 16 {
                    2e-3
                } else {
                    1e-4
                }
            }
        }
    }

    /// Runs the case on `be` and returns its output on the host.
    pub fn run<B: Backend>(&self, be: &B) -> Result<HostTensor> {
        let up = |shape: &[usize], key: u64| be.upload(&input(shape, key));
        let out = match *self {
            Case::Add { rows, cols } => be.add(&up(&[rows, cols], 1)?, &up(&[rows, cols], 2)?)?,
            Case::SiluMul { rows, cols } => {
                be.silu_mul(&up(&[rows, cols], 3)?, &up(&[rows, cols], 4)?)?
            }
            Case::Gelu { rows, cols, kind } => be.gelu(&up(&[rows, cols], 5)?, kind)?,
            Case::LayerNorm { rows, cols } => be.layer_norm(
                &up(&[rows, cols], 6)?,
                &up(&[cols], 7)?,
                &up(&[cols], 8)?,
                1e-6,
            )?,
            Case::RmsNorm { rows, cols } => {
                be.rms_norm(&up(&[rows, cols], 9)?, &up(&[cols], 10)?, 1e-6)?
            }
            Case::Linear { n, k, m, bias } => {
                let x = be.upload(&f16_exact(input(&[n, k], 11)))?;
                let w = be.upload_weight(&f16_exact(input(&[m, k], 12)))?;
                let b = if bias { Some(up(&[m], 13)?) } else { None };
                be.linear(&x, &w, b.as_ref())?
            }
            Case::Swiglu { n, k, m } => {
                let x = be.upload(&f16_exact(input(&[n, k], 14)))?;
                let gate = be.upload_weight(&f16_exact(input(&[m, k], 15)))?;
                let upw = be.upload_weight(&f16_exact(input(&[m, k], 16)))?;
                be.swiglu(&x, &gate, &upw)?
            }
            Case::Rope { tokens, heads, dim } => be.rope(
                &up(&[tokens, heads, dim], 17)?,
                &up(&[tokens, dim], 18)?,
                &up(&[tokens, dim], 19)?,
            )?,
            Case::Attention {
                queries,
                q_heads,
                kv_heads,
                dim,
                slots,
                kv_len,
                mask,
            } => be.attention(
                &up(&[queries, q_heads, dim], 20)?,
                &up(&[slots, kv_heads, dim], 21)?,
                &up(&[slots, kv_heads, dim], 22)?,
                kv_len,
                mask,
            )?,
            Case::DecodeAttention {
                q_heads,
                kv_heads,
                dim,
                slots,
                slot,
            } => be.decode_attention(
                &up(&[1, q_heads, dim], 23)?,
                &up(&[slots, kv_heads, dim], 24)?,
                &up(&[slots, kv_heads, dim], 25)?,
                &be.upload(&HostTensor::new(vec![1], vec![slot as f32])?)?,
            )?,
            Case::WriteRowAt {
                kv_heads,
                dim,
                slots,
                slot,
            } => {
                let mut cache = up(&[slots, kv_heads, dim], 26)?;
                let slot = be.upload(&HostTensor::new(vec![1], vec![slot as f32])?)?;
                be.write_row_at(&mut cache, &slot, &up(&[1, kv_heads, dim], 27)?)?;
                cache
            }
            Case::Argmax { n, tie } => {
                let mut logits = input(&[1, n], 28);
                if let Some((a, b)) = tie {
                    logits.data_mut()[a] = 5.0;
                    logits.data_mut()[b] = 5.0;
                }
                let best = be.argmax(&be.upload(&logits)?)?;
                return HostTensor::new(vec![1], vec![best as f32]);
            }
            Case::Embedding { vocab, width } => {
                let table = be.upload_weight(&f16_exact(input(&[vocab, width], 29)))?;
                // Repeats, the first and the last row.
                let ids = [3, 0, vocab - 1, 3, vocab / 2].map(|i| i as f32);
                be.embedding(
                    &table,
                    &be.upload(&HostTensor::new(vec![5], ids.to_vec())?)?,
                )?
            }
            Case::WeightedGather {
                rows,
                width,
                out,
                taps,
            } => {
                let index: Vec<u32> = (0..out * taps).map(|i| (i * 37 % rows) as u32).collect();
                let weights: Vec<f32> = (0..out * taps).map(|i| (i % 7) as f32 / 7.0).collect();
                be.weighted_gather(&up(&[rows, width], 30)?, &index, &weights, taps)?
            }
            Case::RowUpdates => {
                let (rows, x0, extra) = (
                    up(&[3, 1024], 31)?,
                    up(&[6, 1024], 32)?,
                    up(&[2, 1024], 33)?,
                );
                let mut cache = be.zeros(&[12, 8, 128])?;
                be.write_rows(&mut cache, 4, &be.reshape(rows, &[3, 8, 128])?)?;
                let mut x = x0.clone();
                be.scatter_rows(&mut x, &[5, 0], &extra)?;
                be.add_rows(&mut x, &[1, 5], &extra)?;
                let parts = [
                    be.download(&be.reshape(cache, &[12, 1024])?)?,
                    be.download(&x)?,
                    // Untouched by the in-place updates of the tensor cloned from it.
                    be.download(&x0)?,
                    be.download(&be.slice_rows(&x, 2, 5)?)?,
                ];
                return HostTensor::concat_rows(&parts);
            }
            Case::RandomUniform { ref shape } => be.random_uniform(shape, 34, 0.027)?,
            Case::RecordReplay => return record_and_replay(be),
        };
        be.download(&out)
    }
}

/// [`Case::RecordReplay`]: what `TextModel::decode` relies on, in miniature.
fn record_and_replay<B: Backend>(be: &B) -> Result<HostTensor> {
    let (vocab, width, out_width, slots) = (64, 256, 96, 8);
    let table = be.upload_weight(&f16_exact(input(&[vocab, width], 35)))?;
    let w = be.upload_weight(&f16_exact(input(&[out_width, width], 36)))?;
    let scalar = |v: f32| be.upload(&HostTensor::new(vec![1], vec![v])?);
    let (mut token, mut slot) = (scalar(0.0)?, scalar(0.0)?);
    let mut cache = be.zeros(&[slots, out_width])?;
    let mut out = be.zeros(&[1, out_width])?;
    let step = |token: &B::Tensor, slot: &B::Tensor, cache: &mut B::Tensor, out: &mut B::Tensor| {
        let y = be.linear(&be.embedding(&table, token)?, &w, None)?;
        be.write_row_at(cache, slot, &y)?;
        be.copy(out, &y)
    };
    // Backends that do not record (the CPU) run the step directly each time instead.
    let graph = be.record(&mut || step(&token, &slot, &mut cache, &mut out))?;
    let mut parts = Vec::new();
    for (t, s) in [(5.0, 2.0), (63.0, 7.0)] {
        be.write(&mut token, &[t])?;
        be.write(&mut slot, &[s])?;
        match &graph {
            Some(g) => be.replay(g)?,
            None => step(&token, &slot, &mut cache, &mut out)?,
        }
        parts.push(be.download(&out)?);
    }
    parts.push(be.download(&cache)?);
    HostTensor::concat_rows(&parts)
}

/// The inputs of a case: uniform in [-1, 1), a pure function of (shape, key).
fn input(shape: &[usize], key: u64) -> HostTensor {
    crate::random::uniform_tensor(shape, crate::random::tensor_key(key, "twin"), 1.0)
}

/// `t` with every value rounded to the nearest f16: the weights the GPU stores (and the
/// activations its tensor-core GEMMs multiply them with), so the CPU sees the same operands.
pub fn f16_exact(t: HostTensor) -> HostTensor {
    let shape = t.shape().to_vec();
    let data = t
        .into_data()
        .into_iter()
        .map(|v| half::f16::from_f32(v).to_f32())
        .collect();
    HostTensor::new(shape, data).expect("same length")
}

/// Runs `case` on the CPU reference and on `device` and compares them.
pub fn compare<B: Backend>(device: &B, case: &Case) -> Result<Outcome> {
    let cpu = case.run(&CpuBackend::new())?;
    let dev = case.run(device)?;
    Ok(Outcome::of(case.name(), &cpu, &dev, case.tolerance()))
}

/// Small sizes that reach every device kernel and the branches inside them: both GEMV paths
/// (k a multiple of 8 or not) and the GEMM, flash attention at every padded head dim (64, 80,
/// 96, 128) with full, causal and cached-prefix masks and the f32 attention below 16 queries,
/// split-K decode attention with one and many splits, the vocabulary-sized argmax with a tie,
/// and a decode-like step recorded once and replayed with new inputs.
/// Sized to run in about a second on the CPU side.
pub fn self_check_cases() -> Vec<Case> {
    use Case::*;
    let causal = |first_query_slot| AttnMask::Causal { first_query_slot };
    let mut cases = Vec::new();
    for (rows, cols) in [(3, 1152), (1, 4096), (2, 7)] {
        cases.extend([
            Add { rows, cols },
            SiluMul { rows, cols },
            Gelu {
                rows,
                cols,
                kind: GeluKind::Tanh,
            },
            Gelu {
                rows,
                cols,
                kind: GeluKind::Erf,
            },
            LayerNorm { rows, cols },
            RmsNorm { rows, cols },
        ]);
    }
    for (n, k, m) in [
        (1, 4096, 512),
        (4, 1024, 300),
        (2, 4100, 9),
        (3, 7, 5),
        (33, 1152, 200),
    ] {
        cases.push(Linear {
            n,
            k,
            m,
            bias: false,
        });
        cases.push(Linear {
            n,
            k,
            m,
            bias: true,
        });
        cases.push(Swiglu { n, k, m });
    }
    cases.extend([
        Rope {
            tokens: 3,
            heads: 8,
            dim: 128,
        },
        Rope {
            tokens: 5,
            heads: 4,
            dim: 72,
        },
    ]);
    for (queries, q_heads, kv_heads, dim, slots, kv_len, mask) in [
        (48, 8, 2, 128, 64, 48, causal(0)),
        (20, 8, 2, 128, 64, 50, causal(30)),
        (40, 4, 4, 72, 40, 40, AttnMask::Full),
        (17, 4, 2, 96, 17, 17, AttnMask::Full),
        (33, 4, 2, 16, 33, 33, AttnMask::Full),
        (7, 4, 2, 32, 9, 9, causal(2)),
        (1, 8, 2, 128, 40, 31, causal(30)),
    ] {
        cases.push(Attention {
            queries,
            q_heads,
            kv_heads,
            dim,
            slots,
            kv_len,
            mask,
        });
    }
    for (q_heads, kv_heads, dim, slots, slot) in [
        (32, 8, 128, 4096, 4095),
        (32, 8, 128, 600, 100),
        (6, 3, 40, 700, 257),
    ] {
        cases.push(DecodeAttention {
            q_heads,
            kv_heads,
            dim,
            slots,
            slot,
        });
    }
    cases.extend([
        WriteRowAt {
            kv_heads: 8,
            dim: 128,
            slots: 600,
            slot: 512,
        },
        Argmax {
            n: 151_936,
            tie: None,
        },
        Argmax {
            n: 151_936,
            tie: Some((70_000, 90_000)),
        },
        Argmax { n: 7, tie: None },
        Embedding {
            vocab: 1000,
            width: 512,
        },
        WeightedGather {
            rows: 576,
            width: 64,
            out: 50,
            taps: 4,
        },
        RowUpdates,
        RandomUniform {
            shape: vec![1000, 513],
        },
        RecordReplay,
    ]);
    cases
}

/// Runs [`self_check_cases`] on `device` (reporting each outcome to `progress`) and fails on
/// the first case outside its tolerance, naming it.
pub fn self_check<B: Backend>(device: &B, mut progress: impl FnMut(&Outcome)) -> Result<()> {
    for case in self_check_cases() {
        let outcome = compare(device, &case).map_err(|e| Error::SelfCheck {
            backend: device.name(),
            what: format!("{} failed to run: {e}", case.name()),
        })?;
        progress(&outcome);
        if !outcome.passed() {
            return Err(Error::SelfCheck {
                backend: device.name(),
                what: format!("{outcome}"),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_passes_its_own_self_check_exactly() {
        // The same inputs on the same backend: every case reproduces bit for bit, which is
        // what makes a nonzero difference on a device mean something.
        let mut n = 0;
        self_check(&CpuBackend::new(), |o| {
            assert_eq!(o.max_diff, 0.0, "{o}");
            n += 1;
        })
        .unwrap();
        assert_eq!(n, self_check_cases().len());
    }

    #[test]
    fn a_difference_past_the_tolerance_or_a_nan_fails() {
        let cpu = HostTensor::new(vec![4], vec![1.0, -2.0, 0.5, 0.0]).unwrap();
        let with = |i: usize, v: f32| {
            let mut t = cpu.clone();
            t.data_mut()[i] = v;
            t
        };
        // Allowed: 1e-4 of the largest |value| (2.0).
        assert!(Outcome::of("ok".into(), &cpu, &with(2, 0.5 + 1.9e-4), 1e-4).passed());
        assert!(!Outcome::of("off".into(), &cpu, &with(2, 0.5 + 2.1e-4), 1e-4).passed());
        assert!(!Outcome::of("nan".into(), &cpu, &with(3, f32::NAN), 1e-4).passed());
        assert!(!Outcome::of("inf".into(), &cpu, &with(0, f32::INFINITY), 1e-4).passed());
        let short = HostTensor::new(vec![3], vec![1.0, -2.0, 0.5]).unwrap();
        assert!(!Outcome::of("shape".into(), &cpu, &short, 1.0).passed());
        // Exact cases allow nothing.
        assert!(!Outcome::of("exact".into(), &cpu, &with(0, 1.0 + 1e-7), 0.0).passed());
        // How close a run came, for the logs and vlm doctor.
        let near = Outcome::of("near".into(), &cpu, &with(2, 0.5 + 1.5e-4), 1e-4);
        assert!((near.share_of_allowed() - 0.75).abs() < 0.01, "{near}");
        assert_eq!(
            Outcome::of("same".into(), &cpu, &cpu, 0.0).share_of_allowed(),
            0.0
        );
        let off = Outcome::of("off".into(), &cpu, &with(0, 1.0 + 1e-7), 0.0);
        assert_eq!(off.share_of_allowed(), f32::INFINITY);
    }

    #[test]
    fn every_case_has_a_distinct_name() {
        let names: std::collections::BTreeSet<String> =
            self_check_cases().iter().map(Case::name).collect();
        assert_eq!(names.len(), self_check_cases().len());
    }
}
