//! Every quantized checkpoint format read as its own tooling wrote it (the fixtures of
//! tests/fixtures/make_quant_fixtures.py: llm-compressor, AutoAWQ, GPTQModel), unpacked into
//! `IntMatrix` or `Fp8Matrix` and dequantized, against the tool's own dequantization of the same
//! module (`dequant.<module>` in each fixture's golden file); transformers' FineGrainedFP8
//! layout (whose fixture needs a GPU to make) from tensors built here. The whole model's logits
//! against the reference are llm-svc's golden tests.

use std::path::{Path, PathBuf};

use safetensors::{tensor::TensorView, Dtype};
use vlm_compute::golden::Golden;
use vlm_compute::quant::fp8::{Fp8Scales, E4M3};
use vlm_compute::quant::{Fp8Layout, QuantConfig, QuantMatrix, QuantizeTo};
use vlm_compute::{CpuBackend, Weights};

fn fixture(name: &str) -> PathBuf {
    vlm_compute::golden::fixture(env!("CARGO_MANIFEST_DIR"), name)
}

/// (fixture, bits, group, act order): what each directory holds.
const FORMATS: [(&str, u32, usize, bool); 7] = [
    ("tiny-qwen3-ct-w4a16-group", 4, 32, false),
    ("tiny-qwen3-ct-w4a16-asym", 4, 32, false),
    ("tiny-qwen3-ct-w8a16-channel", 8, 0, false),
    ("tiny-qwen3-awq", 4, 128, false),
    ("tiny-qwen3-gptq", 4, 32, false),
    ("tiny-qwen3-gptq-actorder", 4, 32, true),
    ("tiny-qwen3-gptq-v2", 4, 32, false),
];

#[test]
fn every_format_unpacks_to_its_tools_dequantized_weights() {
    for (name, bits, group, act_order) in FORMATS {
        let dir = fixture(name);
        let weights = Weights::open(&dir).unwrap();
        let q = weights.quant_config().expect("quantized").clone();
        let golden = Golden::open(&dir).unwrap();
        for (module, out, inp) in [
            ("model.layers.0.self_attn.q_proj", 128, 128),
            ("model.layers.0.mlp.down_proj", 128, 384),
        ] {
            let w = weights.pp(module);
            assert!(q.holds(&w), "{name}: {module} is quantized");
            let QuantMatrix::Int(m) = q.read(&w, out, inp).unwrap() else {
                panic!("{name}: not an integer format")
            };
            assert_eq!(m.bits, bits, "{name}");
            // Channel-wise: one group a row.
            let want_group = if group == 0 { inp } else { group.min(inp) };
            assert_eq!(m.group, want_group, "{name} {module}");
            assert_eq!(m.perm.is_some(), act_order, "{name}: act order");
            let ours = m.dequantize();
            let tool = golden.tensor(&format!("dequant.{module}")).unwrap();
            assert_eq!(ours.shape(), tool.shape(), "{name} {module}");
            // Exact: each value is a small integer times a bf16/f16 scale, in f32 on both sides.
            let diff = ours.max_abs_diff(&tool).unwrap();
            assert_eq!(
                diff, 0.0,
                "{name} {module}: differs from the tool's by {diff}"
            );
        }
        // Unquantized modules stay plain weights.
        assert!(!q.holds(&weights.pp("lm_head")), "{name}: lm_head");
    }
}

/// (fixture, scales): the compressed-tensors FP8 fixtures (llm-compressor's presets).
const FP8_FORMATS: [(&str, Fp8Scales); 2] = [
    ("tiny-qwen3-ct-fp8-dynamic", Fp8Scales::Channel),
    ("tiny-qwen3-ct-fp8-block", Fp8Scales::Block([128, 128])),
];

#[test]
fn fp8_checkpoints_dequantize_to_their_tools_weights() {
    for (name, scales) in FP8_FORMATS {
        let dir = fixture(name);
        let weights = Weights::open(&dir).unwrap();
        let q = weights.quant_config().expect("quantized").clone();
        assert_eq!(
            q,
            QuantConfig::Fp8 {
                layout: Fp8Layout::CompressedTensors,
                scales
            }
        );
        let golden = Golden::open(&dir).unwrap();
        for (module, out, inp) in [
            ("model.layers.0.self_attn.q_proj", 128, 128),
            ("model.layers.0.mlp.down_proj", 128, 384),
        ] {
            let w = weights.pp(module);
            assert!(q.holds(&w), "{name}: {module} is quantized");
            let QuantMatrix::Fp8(m) = q.read(&w, out, inp).unwrap() else {
                panic!("{name}: not FP8")
            };
            assert_eq!(m.block, scales.block(out, inp), "{name} {module}");
            let tool = golden.tensor(&format!("dequant.{module}")).unwrap();
            // Exact: an e4m3 value times a bf16 scale, in f32 on both sides.
            let diff = m.dequantize().max_abs_diff(&tool).unwrap();
            assert_eq!(diff, 0.0, "{name} {module}: differs by {diff}");
        }
        // k_proj is [64, 128]: a partial block under FP8_BLOCK.
        let k = weights.pp("model.layers.1.self_attn.k_proj");
        assert!(q.read(&k, 64, 128).is_ok(), "{name}: k_proj");
        assert!(!q.holds(&weights.pp("lm_head")), "{name}: lm_head");
    }
}

/// A checkpoint directory of `tensors` (name, dtype, shape, bytes) and `config`.
fn write_checkpoint(
    name: &str,
    config: &serde_json::Value,
    tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)],
) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vlm-fp8-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    dir
}

fn fine_grained_config(extra: serde_json::Value) -> serde_json::Value {
    let mut q = serde_json::json!({
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [2, 2], "modules_to_not_convert": ["lm_head", "model.visual"],
        // transformers writes keys of its own; unknown ones are ignored.
        "dequantize": false, "scale_fmt": "float", "something_new": {"a": 1}
    });
    for (k, v) in extra.as_object().unwrap() {
        q[k] = v.clone();
    }
    serde_json::json!({"model_type": "qwen3", "quantization_config": q})
}

/// Why `prefix`'s `[out, inp]` matrix does not load on the CPU (it must not).
fn load_error(weights: &Weights, prefix: &str, out: usize, inp: usize) -> String {
    match weights.pp(prefix).load_matrix(&CpuBackend::new(), out, inp) {
        Ok(_) => panic!("{prefix}: loaded"),
        Err(e) => e.to_string(),
    }
}

fn scale_bytes(dtype: Dtype, vals: &[f32]) -> Vec<u8> {
    match dtype {
        Dtype::F32 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Dtype::F16 => vals
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect(),
        Dtype::BF16 => vals
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect(),
        _ => unreachable!(),
    }
}

/// Qwen's FineGrainedFP8 layout, here with 2x2 blocks so the numbers are checkable by hand: a
/// [3, 4] `weight` (its last row a partial block) and a [2, 2] `weight_scale_inv`, in f32, f16
/// and bf16, read through the loader into what the CPU backend computes with.
#[test]
fn fine_grained_fp8_dequantizes_each_value_times_its_blocks_scale() {
    // e4m3fn bytes: 0x38 = 1.0, 0x40 = 2.0, 0x44 = 3.0, 0xB8 = -1.0, 0x30 = 0.5, 0x01 =
    // 2^-9 (the smallest subnormal), 0x7E = 448, 0x00 = 0.
    let q: Vec<u8> = vec![
        0x38, 0x40, 0x44, 0xB8, //
        0x30, 0x01, 0x7E, 0x00, //
        0xB8, 0x38, 0x40, 0x30,
    ];
    let scales = [0.5f32, 2.0, 0.25, 4.0];
    #[rustfmt::skip]
    let want = [
        0.5, 1.0, 6.0, -2.0,
        0.25, 2f32.powi(-10), 896.0, 0.0,
        -0.25, 0.25, 8.0, 2.0,
    ];
    for dtype in [Dtype::F32, Dtype::F16, Dtype::BF16] {
        let dir = write_checkpoint(
            &format!("{dtype:?}"),
            &fine_grained_config(serde_json::json!({})),
            &[
                ("m.proj.weight", Dtype::F8_E4M3, vec![3, 4], q.clone()),
                (
                    "m.proj.weight_scale_inv",
                    dtype,
                    vec![2, 2],
                    scale_bytes(dtype, &scales),
                ),
                ("lm_head.weight", Dtype::BF16, vec![1, 4], vec![0; 8]),
            ],
        );
        let weights = Weights::open(&dir).unwrap();
        assert_eq!(
            weights.quant_config(),
            Some(&QuantConfig::Fp8 {
                layout: Fp8Layout::FineGrained,
                scales: Fp8Scales::Block([2, 2])
            })
        );
        let cpu = CpuBackend::new();
        let w = weights.pp("m.proj").load_matrix(&cpu, 3, 4).unwrap();
        // The CPU's weight is the f32 matrix.
        assert_eq!(w.data(), &want, "{dtype:?} scales");
        // modules_to_not_convert stay as they are.
        assert!(!weights
            .quant_config()
            .unwrap()
            .holds(&weights.pp("lm_head")));
        weights.pp("lm_head").load_matrix(&cpu, 1, 4).unwrap();
        assert_eq!(E4M3[0x7E], 448.0);
    }
}

#[test]
fn fp8_checkpoints_that_disagree_with_themselves_are_refused() {
    let q = vec![0x38u8; 12];
    let scale = scale_bytes(Dtype::F32, &[1.0; 2]);
    // A [3, 4] weight in 2x2 blocks needs a [2, 2] grid; [1, 2] is named with both shapes.
    let dir = write_checkpoint(
        "grid",
        &fine_grained_config(serde_json::json!({})),
        &[
            ("m.weight", Dtype::F8_E4M3, vec![3, 4], q.clone()),
            ("m.weight_scale_inv", Dtype::F32, vec![1, 2], scale.clone()),
        ],
    );
    let weights = Weights::open(&dir).unwrap();
    let e = load_error(&weights, "m", 3, 4);
    assert!(
        e.contains("`m.weight_scale_inv`")
            && e.contains("[1, 2]")
            && e.contains("[3, 4]")
            && e.contains("[2, 2]"),
        "{e}"
    );
    // A NaN in the weight (0x7F) is an error naming it.
    let mut nan = q.clone();
    nan[5] = 0x7F;
    let dir = write_checkpoint(
        "nan",
        &fine_grained_config(serde_json::json!({"weight_block_size": [4, 4]})),
        &[
            ("m.weight", Dtype::F8_E4M3, vec![3, 4], nan),
            (
                "m.weight_scale_inv",
                Dtype::F32,
                vec![1, 1],
                scale[..4].to_vec(),
            ),
        ],
    );
    let weights = Weights::open(&dir).unwrap();
    let e = load_error(&weights, "m", 3, 4);
    assert!(e.contains("`m.weight`") && e.contains("NaN"), "{e}");
    // An FP8 tensor without a scale cannot be read as a plain weight.
    let e = weights.get("m.weight", &[3, 4]).unwrap_err().to_string();
    assert!(e.contains("F8_E4M3"), "{e}");
    // --quantize on an FP8 checkpoint.
    let e = Weights::open(&dir)
        .unwrap()
        .quantize(Some(QuantizeTo::Fp8))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("quantized already"), "{e}");
}

#[test]
fn unsupported_fp8_configs_name_the_field() {
    let p = Path::new("config.json");
    for (extra, field, what) in [
        (serde_json::json!({"fmt": "e5m2"}), "fmt", "e4m3"),
        (
            serde_json::json!({"activation_scheme": "static"}),
            "activation_scheme",
            "dynamic",
        ),
        (
            serde_json::json!({"scale_fmt": "ue8m0"}),
            "scale_fmt",
            "float",
        ),
        (
            serde_json::json!({"weight_block_size": [128]}),
            "weight_block_size",
            "[rows, cols]",
        ),
    ] {
        let e = QuantConfig::from_config(p, &fine_grained_config(extra))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("quantization_config.{field}")) && e.contains(what),
            "{e}"
        );
    }
    let ct = |weights: serde_json::Value, acts: serde_json::Value| {
        serde_json::json!({"quantization_config": {"quant_method": "compressed-tensors",
            "format": "float-quantized", "config_groups": {"group_0": {"targets": ["Linear"],
            "weights": weights, "input_activations": acts}}}})
    };
    let w = serde_json::json!({"num_bits": 8, "type": "float", "strategy": "channel"});
    let static_acts = serde_json::json!({"num_bits": 8, "type": "float", "dynamic": false});
    let e = QuantConfig::from_config(p, &ct(w.clone(), static_acts))
        .unwrap_err()
        .to_string();
    assert!(e.contains("input_activations.dynamic"), "{e}");
    let group = serde_json::json!({"num_bits": 8, "type": "float", "strategy": "group"});
    let e = QuantConfig::from_config(p, &ct(group, serde_json::Value::Null))
        .unwrap_err()
        .to_string();
    assert!(e.contains("weights.strategy") && e.contains("block"), "{e}");
    let block = serde_json::json!({"num_bits": 8, "type": "float", "strategy": "block",
        "block_structure": [64, 32]});
    let dynamic = serde_json::json!({"num_bits": 8, "type": "float", "dynamic": true});
    assert_eq!(
        QuantConfig::from_config(p, &ct(block, dynamic)).unwrap(),
        Some(QuantConfig::Fp8 {
            layout: Fp8Layout::CompressedTensors,
            scales: Fp8Scales::Block([64, 32])
        })
    );
}

#[test]
fn quantize_is_refused_on_a_quantized_checkpoint() {
    let dir = fixture("tiny-qwen3-awq");
    let e = Weights::open(&dir)
        .unwrap()
        .quantize(Some(QuantizeTo::Int4))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("quantized already"), "{e}");
}

/// `--quantize-lm-head` quantizes an lm_head stored bf16 beside a quantized decoder (Qwen's
/// FP8 layout here; 128 columns, one group) to 8 bits, within half a step of its scale of each
/// value, and is refused for one the checkpoint stores quantized already.
#[test]
fn quantize_lm_head_takes_a_bf16_head_and_refuses_a_quantized_one() {
    let head: Vec<f32> = (0..2 * 128)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
        .collect();
    let bf16: Vec<u8> = head
        .iter()
        .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
        .collect();
    let proj = (
        "m.proj.weight",
        Dtype::F8_E4M3,
        vec![2, 128],
        vec![0x38u8; 256],
    );
    let scale = (
        "m.proj.weight_scale_inv",
        Dtype::F32,
        vec![1, 1],
        scale_bytes(Dtype::F32, &[1.0]),
    );
    let config = fine_grained_config(serde_json::json!({}));
    let dir = write_checkpoint(
        "head-bf16",
        &config,
        &[
            proj.clone(),
            scale.clone(),
            ("lm_head.weight", Dtype::BF16, vec![2, 128], bf16),
        ],
    );
    let cpu = CpuBackend::new();
    let weights = Weights::open(&dir).unwrap().quantize_lm_head(true);
    let got = weights.pp("lm_head").load_matrix(&cpu, 2, 128).unwrap();
    for (row, want) in got.data().chunks(128).zip(head.chunks(128)) {
        // Symmetric 8 bits: the largest value over 127 a step.
        let step = want.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
        let worst = row
            .iter()
            .zip(want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            worst > 0.0 && worst <= step / 2.0 + 1e-3 * step,
            "{worst} vs step {step}"
        );
    }
    let quantized_head = write_checkpoint(
        "head-fp8",
        &config,
        &[
            proj,
            scale,
            (
                "lm_head.weight",
                Dtype::F8_E4M3,
                vec![2, 128],
                vec![0x38u8; 256],
            ),
            (
                "lm_head.weight_scale_inv",
                Dtype::F32,
                vec![1, 1],
                scale_bytes(Dtype::F32, &[1.0]),
            ),
        ],
    );
    let weights = Weights::open(&quantized_head)
        .unwrap()
        .quantize_lm_head(true);
    let e = load_error(&weights, "lm_head", 2, 128);
    assert!(
        e.contains("lm_head") && e.contains("quantized already"),
        "{e}"
    );
}

#[test]
fn configs_of_the_fixtures_parse_as_their_formats() {
    for (name, want) in [
        ("tiny-qwen3-ct-w4a16-group", "CompressedTensors"),
        ("tiny-qwen3-awq", "Awq"),
        ("tiny-qwen3-gptq-v2", "Gptq"),
    ] {
        let path = fixture(name).join("config.json");
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let q = QuantConfig::from_config(&path, &cfg).unwrap().unwrap();
        assert!(format!("{q:?}").starts_with(want), "{name}: {q:?}");
    }
    let path = fixture("tiny-qwen3-gptq-v2").join("config.json");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert!(matches!(
        QuantConfig::from_config(&path, &cfg).unwrap(),
        Some(QuantConfig::Gptq { v2: true, .. })
    ));
}
