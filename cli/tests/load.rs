//! `vlm load` as a user runs it: the real binary starts the local stack on the bundled tiny
//! model, sends streamed chats with images over HTTP and gRPC at two concurrencies, and
//! reports every request answered with all its tokens. Timings are not asserted (benchmarks
//! report, they do not fail CI); only that each number is there and consistent.

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-qwen3-vl")
}

fn vlm_load(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vlm"))
        .arg("load")
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("the vlm binary runs")
}

#[test]
fn load_answers_every_request_over_both_apis_and_writes_one_object_per_level() {
    let dir = std::env::temp_dir().join(format!("vlm-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("load.json");
    let model = fixture();
    let out = vlm_load(&[
        "--model",
        model.to_str().unwrap(),
        "--concurrency",
        "1,4",
        "--requests",
        "8",
        "--max-tokens",
        "8",
        "--prompt-tokens",
        "40",
        "--image-every",
        "2",
        "--image-side",
        "64",
        "--api",
        "mixed",
        "--json",
        json.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for column in [
        "concurrency",
        "output tok/s",
        "req/s",
        "TTFT p99 ms",
        "ITL p50 ms",
    ] {
        assert!(stdout.contains(column), "no {column} column:\n{stdout}");
    }
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .map(|l| l.split_whitespace().collect())
        .filter(|cells: &Vec<&str>| cells.len() == 11 && cells[0].parse::<usize>().is_ok())
        .collect();
    assert_eq!(rows.len(), 2, "one table line per level:\n{stdout}");
    for (row, concurrency) in rows.iter().zip(["1", "4"]) {
        assert_eq!(&row[..3], [concurrency, "8", "0"], "{stdout}");
    }

    let levels: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let levels = levels.as_array().expect("a list of levels");
    assert_eq!(levels.len(), 2);
    for (level, concurrency) in levels.iter().zip([1, 4]) {
        let num = |key: &str| {
            level[key]
                .as_f64()
                .unwrap_or_else(|| panic!("{key} missing in {level}"))
        };
        assert_eq!(num("concurrency"), concurrency as f64);
        assert_eq!(num("requests_ok"), 8.0, "{level}");
        assert_eq!(num("error_count"), 0.0, "{level}");
        assert_eq!(level["errors"], serde_json::json!({}));
        // ignore_eos: every request streams exactly max_tokens, over HTTP as over gRPC.
        assert_eq!(num("output_tokens"), 64.0, "{level}");
        // At least the 20 text tokens of the shortest prompt each, images and template on top.
        assert!(num("prompt_tokens") >= 8.0 * 20.0, "{level}");
        let wall = num("wall_s");
        assert!(wall > 0.0);
        let rate = num("output_tokens_per_s");
        assert!((rate * wall - 64.0).abs() < 1e-6 * 64.0, "{level}");
        assert!((num("requests_per_s") * wall - 8.0).abs() < 1e-6 * 8.0);
        assert!(num("prompt_tokens_per_s") > 0.0);
        assert!(num("ttft_p50_ms") > 0.0 && num("ttft_p99_ms") >= num("ttft_p50_ms"));
        assert!(num("itl_p50_ms") >= 0.0 && num("itl_p99_ms") >= num("itl_p50_ms"));
        assert!(num("ttft_p99_ms") <= wall * 1e3, "{level}");
        assert!(level["device"].as_str().unwrap().starts_with("cpu"));
        assert!(level["model"].as_str().unwrap().contains("tiny-qwen3-vl"));
        assert!(level["config"].as_str().unwrap().contains("ignore_eos"));
        for key in ["commit", "system", "name", "api"] {
            assert!(
                !level[key].as_str().unwrap_or_default().is_empty(),
                "{key} missing in {level}"
            );
        }
        assert_eq!((num("max_tokens"), num("image_every")), (8.0, 2.0));
        // Mixed: half the requests through each API, each API's share counted on its own.
        for api in ["http", "grpc"] {
            let share = &level["by_api"][api];
            assert_eq!(share["requests_ok"], 4, "{api}: {level}");
            assert_eq!(share["output_tokens"], 32, "{api}: {level}");
        }
        // The local stack's gateway shows llm-svc's prefix-cache counters; new prompts share
        // little.
        let cached = num("prefix_cache_hit_pct");
        assert!((0.0..50.0).contains(&cached), "{level}");
    }
    assert!(stdout.contains("concurrency 4 by API: grpc"), "{stdout}");
}

/// `--turns 3 --replicas 2`: conversations over two CPU replicas behind the local gateway; every
/// turn after the first resends its history, so most of its prompt is found in the prefix
/// cache of the replica the gateway sent the conversation to, and the table and the JSON say
/// how much.
#[test]
fn load_holds_conversations_whose_later_turns_hit_the_prefix_cache() {
    let dir = std::env::temp_dir().join(format!("vlm-load-turns-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("load.json");
    let model = fixture();
    let out = vlm_load(&[
        "--model",
        model.to_str().unwrap(),
        "--replicas",
        "2",
        "--turns",
        "3",
        "--concurrency",
        "2",
        "--requests",
        "12",
        "--warmup",
        "0",
        "--max-tokens",
        "4",
        "--prompt-tokens",
        "60",
        "--image-every",
        "3",
        "--image-side",
        "64",
        "--api",
        "mixed",
        "--json",
        json.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("conversations of 3 turns"), "{stdout}");
    assert!(stdout.contains("2 replicas on cpu"), "{stdout}");
    let row: Vec<&str> = stdout
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|cells| cells.len() == 11 && cells[0] == "2")
        .unwrap_or_else(|| panic!("no level line:\n{stdout}"));
    assert_eq!(&row[..3], ["2", "12", "0"], "{stdout}");
    let levels: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let level = &levels[0];
    assert_eq!(level["turns"], 3, "{level}");
    assert!(level["ttft_p50_ms"].as_f64().unwrap() > 0.0, "{level}");
    // Four conversations of three turns: turns 2 and 3 find the turns before them cached
    // (40% of the level's prompt tokens on one replica, whole blocks only; 29-40% over two,
    // as the gateway weighs load against overlap); the same run with --turns 1 finds 0%.
    let hit = level["prefix_cache_hit_pct"].as_f64().unwrap();
    assert!(hit > 20.0, "{level}");
    assert_eq!(
        row[10],
        format!("{hit:.1}"),
        "the table's cache hit % is the JSON's"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `--stand-in-llm`: the gateway alone, its llm-svc a stand-in without a model.
#[test]
fn load_measures_the_gateway_alone_with_a_stand_in_llm() {
    let model = fixture();
    let args = |extra: &[&'static str]| {
        let mut a = vec![
            "--model",
            model.to_str().unwrap(),
            "--stand-in-llm",
            "2",
            "--concurrency",
            "8",
            "--requests",
            "16",
            "--max-tokens",
            "20",
            "--prompt-tokens",
            "40",
            "--api",
            "mixed",
        ];
        a.extend_from_slice(extra);
        a
    };
    let out = vlm_load(&args(&["--image-every", "0"]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("stand-in llm-svc"), "{stdout}");
    let row: Vec<&str> = stdout
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|cells| cells.len() == 11 && cells[0] == "8")
        .unwrap_or_else(|| panic!("no level line:\n{stdout}"));
    assert_eq!(&row[..3], ["8", "16", "0"], "{stdout}");
    // No vision-svc: images are refused before anything starts.
    let out = vlm_load(&args(&["--image-every", "2"]));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--image-every 0"), "{err}");
}

#[test]
fn load_names_what_is_wrong_with_its_flags() {
    let fails = |args: &[&str]| {
        let out = vlm_load(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let err = fails(&["--http", "http://127.0.0.1:9"]);
    assert!(
        err.contains("--api mixed needs both --http and --grpc"),
        "{err}"
    );
    let err = fails(&["--concurrency", "1,0"]);
    assert!(err.contains("--concurrency"), "{err}");
    let model = fixture();
    let err = fails(&[
        "--model",
        model.to_str().unwrap(),
        "--concurrency",
        "8",
        "--max-concurrent",
        "4",
    ]);
    assert!(err.contains("--max-concurrent 4 is below"), "{err}");
    // Nothing listens on the discard port: the run stops at once and says where it looked.
    let err = fails(&[
        "--http",
        "http://127.0.0.1:9",
        "--api",
        "http",
        "--warmup",
        "0",
    ]);
    assert!(err.contains("127.0.0.1:9"), "{err}");
}
