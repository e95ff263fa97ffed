//! `vlm run` end to end, as a user runs it: the real binary on the bundled tiny checkpoint,
//! compared with what HF transformers produced for the same images and prompts (golden
//! fixtures), plus every kind of bad input, which must end in a clear message and a non-zero
//! exit, never a panic.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;
use vlm_compute::{golden::Golden, npy};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-qwen3-vl")
}

fn vlm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vlm"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("the vlm binary runs")
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vlm-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A copy of the checkpoint `src` in a fresh temporary directory `name`, with `from`
/// replaced by `to` in its config.json.
fn copy_with_config(name: &str, src: &Path, from: &str, to: &str) -> PathBuf {
    let d = tmp(name);
    for entry in std::fs::read_dir(src).unwrap() {
        let p = entry.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, d.join(p.file_name().unwrap())).unwrap();
        }
    }
    let cfg = std::fs::read_to_string(d.join("config.json")).unwrap();
    std::fs::write(d.join("config.json"), cfg.replace(from, to)).unwrap();
    d
}

/// Runs a case of the golden manifest through `vlm run --json`.
fn run_case(case: &Value, extra: &[&str]) -> (Value, Output) {
    let dir = fixture();
    let mut args: Vec<String> = vec!["run".into(), "--model".into(), dir.display().to_string()];
    for img in case["images"].as_array().unwrap() {
        args.push("--image".into());
        args.push(
            dir.join("images")
                .join(img.as_str().unwrap())
                .display()
                .to_string(),
        );
    }
    args.extend(["--prompt".into(), case["prompt"].as_str().unwrap().into()]);
    if let Some(system) = case["system"].as_str() {
        args.extend(["--system".into(), system.into()]);
    }
    args.extend([
        "--max-new-tokens".into(),
        case["max_new_tokens"].to_string(),
    ]);
    if !extra.contains(&"--temperature") {
        args.extend(["--temperature".into(), "0".into()]);
    }
    args.push("--json".into());
    args.extend(extra.iter().map(|s| s.to_string()));
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = vlm(&argv);
    assert!(
        out.status.success(),
        "vlm {argv:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: Value = serde_json::from_slice(&out.stdout).expect("one JSON object on stdout");
    (json, out)
}

#[test]
fn run_matches_hf_token_for_token_from_image_files() {
    let g = Golden::open(&fixture()).unwrap();
    for case in g.manifest()["cases"].as_array().unwrap() {
        if !case["history"].as_array().unwrap().is_empty() {
            continue; // `vlm run` is one turn (and a system message); the services test the rest
        }
        let (json, _) = run_case(case, &[]);
        let name = case["name"].as_str().unwrap();
        assert_eq!(
            json["prompt_token_ids"], case["prompt_token_ids"],
            "{name}: prompt ids"
        );
        assert_eq!(
            json["generated_token_ids"], case["generated_token_ids"],
            "{name}: tokens"
        );
        assert_eq!(json["text"], case["text"], "{name}: text");
    }
}

#[test]
fn logits_out_writes_the_logits_of_each_step() {
    let g = Golden::open(&fixture()).unwrap();
    let case = &g.manifest()["cases"][0];
    let path = tmp("logits").join("logits.npy");
    run_case(case, &["--logits-out", path.to_str().unwrap()]);
    let ours = npy::read_f32(&path).unwrap();
    let hf = g
        .tensor(&format!("case.{}.logits", case["name"].as_str().unwrap()))
        .unwrap();
    assert_eq!(ours.shape(), hf.shape(), "[generated_steps, vocab_size]");
    // Same bound as the stage test: f32 summation order only.
    assert!(ours.max_abs_diff(&hf).unwrap() <= 1e-3);
}

#[test]
fn stop_strings_cut_the_text_and_plain_output_is_the_text() {
    let g = Golden::open(&fixture()).unwrap();
    let case = &g.manifest()["cases"][0];
    let full = case["text"].as_str().unwrap();
    // Stop at " model", which the golden text contains after its first few characters.
    let at = full.find(" model").expect("golden text contains ' model'");
    let (json, _) = run_case(case, &["--stop", " model"]);
    assert_eq!(json["text"].as_str().unwrap(), &full[..at]);
    assert_eq!(json["finish_reason"], "stop");

    let dir = fixture();
    let img = dir.join("images/cat.png");
    let out = vlm(&[
        "run",
        "--model",
        dir.to_str().unwrap(),
        "--image",
        img.to_str().unwrap(),
        "--prompt",
        case["prompt"].as_str().unwrap(),
        "--max-new-tokens",
        "8",
    ]);
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout), format!("{full}\n"));
}

#[test]
fn seeded_sampling_is_reproducible() {
    let g = Golden::open(&fixture()).unwrap();
    let case = &g.manifest()["cases"][2];
    let args = ["--temperature", "0.9", "--top-p", "0.95", "--seed", "11"];
    let (a, _) = run_case(case, &args);
    let (b, _) = run_case(case, &args);
    assert_eq!(a["generated_token_ids"], b["generated_token_ids"]);
}

/// Runs `vlm run` expecting failure; returns stderr.
fn fails(args: &[&str]) -> String {
    let out = vlm(args);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "expected failure for {args:?}");
    assert!(!err.contains("panicked"), "panic for {args:?}: {err}");
    err
}

fn run_with_image(image: &Path) -> String {
    let dir = fixture();
    fails(&[
        "run",
        "--model",
        dir.to_str().unwrap(),
        "--image",
        image.to_str().unwrap(),
        "--prompt",
        "hi",
        "--max-new-tokens",
        "2",
    ])
}

#[test]
fn bad_images_are_reported_not_crashed_on() {
    let d = tmp("images");
    let truncated = d.join("truncated.png");
    let png = std::fs::read(fixture().join("images/cat.png")).unwrap();
    std::fs::write(&truncated, &png[..png.len() / 3]).unwrap();
    let err = run_with_image(&truncated);
    assert!(err.contains("image 0") && err.contains("decode"), "{err}");

    let text = d.join("notes.png");
    std::fs::write(&text, "this is not an image").unwrap();
    let err = run_with_image(&text);
    assert!(err.contains("unrecognized format"), "{err}");

    // A BMP is a real image, just not one of the formats we accept.
    let bmp = d.join("x.bmp");
    let mut b = b"BM".to_vec();
    b.extend_from_slice(&[0u8; 60]);
    std::fs::write(&bmp, b).unwrap();
    let err = run_with_image(&bmp);
    assert!(
        err.contains("not supported") || err.contains("unrecognized"),
        "{err}"
    );

    // 20000 x 8 pixels: small on disk, over the 16384-per-side limit.
    let wide = d.join("wide.png");
    image::RgbImage::new(20_000, 8).save(&wide).unwrap();
    let err = run_with_image(&wide);
    assert!(err.contains("20000x8") && err.contains("limit"), "{err}");

    let missing = d.join("nope.png");
    let err = run_with_image(&missing);
    assert!(
        err.contains("cannot read image") && err.contains("nope.png"),
        "{err}"
    );
}

#[test]
fn prompts_past_the_context_are_rejected() {
    let dir = fixture();
    let long = "apples and oranges ".repeat(800);
    let err = fails(&["run", "--model", dir.to_str().unwrap(), "--prompt", &long]);
    assert!(err.contains("context holds at most 2048"), "{err}");
    let err = fails(&[
        "run",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        "hello",
        "--max-context",
        "8",
    ]);
    assert!(err.contains("at most 8"), "{err}");
}

#[test]
fn bad_models_and_parameters_are_named() {
    let err = fails(&["run", "--model", "/no/such/dir", "--prompt", "hi"]);
    assert!(
        err.contains("/no/such/dir") && err.contains("does not exist"),
        "{err}"
    );

    // A checkpoint whose config disagrees with its weights.
    let d = copy_with_config(
        "badmodel",
        &fixture(),
        "\"intermediate_size\": 160",
        "\"intermediate_size\": 128",
    );
    let err = fails(&["run", "--model", d.to_str().unwrap(), "--prompt", "hi"]);
    assert!(
        err.contains("mlp.gate_proj.weight") && err.contains("[128, 64]"),
        "{err}"
    );

    std::fs::write(d.join("config.json"), "{ not json").unwrap();
    let err = fails(&["run", "--model", d.to_str().unwrap(), "--prompt", "hi"]);
    assert!(
        err.contains("config.json") && err.contains("not valid JSON"),
        "{err}"
    );

    let dir = fixture();
    let m = dir.to_str().unwrap();
    let err = fails(&["run", "--model", m, "--prompt", "hi", "--temperature", "-1"]);
    assert!(err.contains("temperature"), "{err}");
    let err = fails(&[
        "run",
        "--model",
        m,
        "--prompt",
        "hi",
        "--max-new-tokens",
        "0",
    ]);
    assert!(
        err.contains("max_tokens") && err.contains("--max-new-tokens"),
        "{err}"
    );
    // No GPU here: a clear error naming what is missing, not a crash.
    let err = fails(&["run", "--model", m, "--prompt", "hi", "--device", "cuda"]);
    assert!(
        err.contains("CUDA") && err.contains("could not be loaded"),
        "{err}"
    );
}

#[test]
fn bench_reports_every_measurement_against_the_limits() {
    let json = tmp("bench").join("bench.json");
    let dir = fixture();
    let out = vlm(&[
        "bench",
        "--model",
        dir.to_str().unwrap(),
        "--random-weights",
        "--warmup",
        "0",
        "--repeats",
        "1",
        "--image-sides",
        "64",
        "--prefill-tokens",
        "16",
        "--decode-contexts",
        "16",
        "--decode-tokens",
        "2",
        "--decode-batches",
        "3",
        "--ttft-image-side",
        "64",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("decode: batch 1 at context 16") && table.contains("of limit"),
        "{table}"
    );
    let rows: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = rows.as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["name"].as_str().unwrap()).collect();
    // Of the memory rows, only what the model holds by kind: the CPU has no device memory of
    // its own to report as in use.
    assert_eq!(
        rows.len(),
        30,
        "two limits, the text decoder's weights and its KV cache, one ViT size (outputs kept on the device, and downloaded to the host), \
         prefill, the image's preprocessing, image TTFT in process \
         (and with the image already encoded), \
         packing and unpacking its embeddings, decode and batched decode (each greedy, \
         sampled, and sampled with a JSON schema), the host's grammar masks and pick checks \
         (median, p99), \
         the sampler alone (greedy, temperature alone, sampled, with logprobs), the same through the \
         gateway with a new image (embeddings in the messages, in shared memory and kept on \
         the device) and with one seen before: {names:?}"
    );
    assert!(
        names.contains(&"decode: batch 3 at context 16")
            && names.contains(&"decode: batch 3 at context 16, sampled")
            && names.contains(&"decode: batch 3 at context 16, sampled, json_schema")
            && names.contains(&"grammar masks: 3 sequences, a step (host, p99)")
            && names.contains(&"grammar pick checks: 3 sequences, a step (host, p99)")
            && names.contains(&"sampler: 3 rows of 414 logits, the same with top_logprobs 5")
            && names.contains(&"vision: ViT + mergers 64x64, outputs downloaded to the host"),
        "{names:?}"
    );
    for row in [
        "through the gateway (embeddings in the gRPC messages)",
        "through the gateway (embeddings in shared memory)",
        "through the gateway (embeddings kept on the device)",
        "through the gateway, image seen before",
        "f16) unpacked",
        "PNG: decoded and preprocessed",
        "memory: text decoder weights (the backend's format)",
    ] {
        assert!(
            names.iter().any(|n| n.ends_with(row)),
            "no row ending {row:?}: {names:?}"
        );
    }
    for r in rows {
        // Timings are not asserted (benchmarks report, they do not fail CI): only that every
        // row is a complete measurement (an amount of memory has no time).
        let amount = r["unit"] == "B in use";
        assert!(
            (amount || r["median_ms"].as_f64().unwrap() > 0.0)
                && r["throughput"].as_f64().unwrap() > 0.0,
            "{r}"
        );
        for key in ["device", "config", "commit", "unit", "min_ms", "max_ms"] {
            assert!(!r[key].is_null(), "{key} missing in {r}");
        }
    }
    for n in ["vision", "prefill", "decode"] {
        let row = rows
            .iter()
            .find(|r| r["name"].as_str().unwrap().starts_with(n))
            .unwrap();
        assert!(
            row["roofline_fraction"].as_f64().unwrap() > 0.0,
            "{n} is set against a limit"
        );
    }
}

#[test]
fn random_weights_run_from_the_config_alone_and_follow_the_seed() {
    // A copy of the fixture without its safetensors: only config, tokenizer and template remain.
    let dir = tmp("random");
    for f in std::fs::read_dir(fixture()).unwrap() {
        let p = f.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        if p.is_file() && !name.contains("safetensors") {
            std::fs::copy(&p, dir.join(&name)).unwrap();
        }
    }
    let image = fixture().join("images/cat.png");
    let run = |seed: &str| {
        let out = vlm(&[
            "run",
            "--model",
            dir.to_str().unwrap(),
            "--random-weights",
            "--weights-seed",
            seed,
            "--image",
            image.to_str().unwrap(),
            "--prompt",
            "hi",
            "--max-new-tokens",
            "6",
            "--json",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v["generated_token_ids"].clone()
    };
    let a = run("1");
    assert_eq!(a.as_array().unwrap().len(), 6);
    assert_eq!(a, run("1"));
    assert_ne!(a, run("2"));
    // Without --random-weights the missing weights are named.
    let err = fails(&["run", "--model", dir.to_str().unwrap(), "--prompt", "hi"]);
    assert!(err.contains("safetensors"), "{err}");
}

#[test]
fn doctor_lists_what_cuda_needs_and_fails_where_something_is_missing() {
    let out = vlm(&["doctor", "--arch", "sm_87"]);
    let text = String::from_utf8_lossy(&out.stdout);
    for what in [
        "NVIDIA driver (libcuda)",
        "NVRTC (libnvrtc)",
        "cuBLAS (libcublas)",
        "cuBLASLt (libcublasLt)",
        "CUDA headers for NVRTC",
        "kernel cache",
    ] {
        assert!(text.contains(what), "no {what} line:\n{text}");
    }
    let line = |start: &str, what: &str| {
        text.lines()
            .any(|l| l.starts_with(start) && l.contains(what))
    };
    if vlm_compute::CudaBackend::new(0).is_err() {
        assert!(!out.status.success(), "{text}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("cannot run here"),
            "{out:?}"
        );
        assert!(
            line("PROBLEM", "libcuda") || line("PROBLEM", "GPU 0"),
            "{text}"
        );
    }
    // Compiling needs NVRTC and the headers only (CI installs both): the Orin build is checked.
    if vlm_compute::cuda::nvrtc_available()
        && vlm_compute::cuda::compile::cuda_include_dir().is_ok()
    {
        assert!(line("ok", "kernels compile for sm_87"), "{text}");
    }
}

/// `vlm run` on the text-only checkpoints (Qwen3ForCausalLM, Qwen2ForCausalLM): a one-turn chat
/// gives HF's prompt ids and greedy tokens, an image is refused naming the model as text-only,
/// and a config of another architecture is refused naming the field and what is supported.
#[test]
fn text_only_models_run_as_hf_and_refuse_images() {
    for name in ["tiny-qwen3", "tiny-qwen2"] {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures")
            .join(name);
        let m = dir.to_str().unwrap();
        let g = Golden::open(&dir).unwrap();
        let case = g.manifest()["cases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == "chat")
            .unwrap()
            .clone();
        let prompt = case["messages"][0]["content"].as_str().unwrap();
        let steps = case["max_new_tokens"].to_string();
        let args = [
            "run",
            "--model",
            m,
            "--prompt",
            prompt,
            "--max-new-tokens",
            &steps,
            "--temperature",
            "0",
            "--json",
        ];
        let out = vlm(&args);
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let json: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(
            json["prompt_token_ids"], case["prompt_token_ids"],
            "{name}: prompt"
        );
        assert_eq!(
            json["generated_token_ids"], case["generated_token_ids"],
            "{name}: greedy tokens"
        );

        let image = fixture().join("images/cat.png");
        let err = fails(&[
            "run",
            "--model",
            m,
            "--image",
            image.to_str().unwrap(),
            "--prompt",
            "hi",
        ]);
        assert!(
            err.contains("text-only") && err.contains("images"),
            "{name}: {err}"
        );
    }

    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-qwen3");
    let d = copy_with_config("llama", &src, "Qwen3ForCausalLM", "LlamaForCausalLM");
    let err = fails(&["run", "--model", d.to_str().unwrap(), "--prompt", "hi"]);
    assert!(
        err.contains("`architectures`")
            && err.contains("LlamaForCausalLM")
            && err.contains("Qwen2ForCausalLM"),
        "{err}"
    );
}
