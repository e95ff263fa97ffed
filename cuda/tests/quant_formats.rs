//! Every quantized checkpoint format read as its own tooling wrote it (the fixtures of
//! tests/fixtures/make_quant_fixtures.py: llm-compressor, AutoAWQ, GPTQModel), unpacked into
//! `IntMatrix` and dequantized, against the tool's own dequantization of the same module
//! (`dequant.<module>` in each fixture's golden file). The whole model's logits against the
//! reference are llm-svc's golden tests.

use std::path::PathBuf;

use vlm_compute::golden::Golden;
use vlm_compute::quant::{QuantConfig, QuantizeTo};
use vlm_compute::Weights;

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
            let m = q.read(&w, out, inp).unwrap();
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
