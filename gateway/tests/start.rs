//! The `gateway` binary refuses a start it cannot serve, naming what was wrong. It binds its
//! listeners first, so the cases give it ports of its own (`127.0.0.1:0`): on the defaults, a
//! port another process holds would be the error instead. (The served behaviour is tested end
//! to end in `tests/e2e`, which starts this same binary; cargo builds a package's binaries only
//! for its own integration tests, so this file is also what puts `target/debug/gateway` there
//! for them.)

use std::process::{Command, Output};

fn gateway(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gateway"))
        .args(args)
        .env("RUST_LOG", "warn")
        .env_remove("VLM_MODEL")
        .env_remove("VLM_LLM_ADDR")
        .output()
        .expect("the gateway binary runs")
}

fn fixture() -> String {
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/tiny-qwen3-vl"
    )
    .to_string()
}

fn refused(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the start should fail: {stderr}");
    assert!(
        stderr.contains(needle),
        "stderr should name {needle:?}: {stderr}"
    );
    assert!(
        !stderr.contains("panicked"),
        "a panic, not an error: {stderr}"
    );
}

#[test]
fn a_missing_model_directory_is_named() {
    let out = gateway(&[
        "--model",
        "/no/such/checkpoint",
        "--llm-addr",
        "http://127.0.0.1:1",
        "--http-listen",
        "127.0.0.1:0",
        "--grpc-listen",
        "127.0.0.1:0",
    ]);
    refused(&out, "/no/such/checkpoint");
}

#[test]
fn a_bad_upstream_address_is_named() {
    let model = fixture();
    let out = gateway(&[
        "--model",
        &model,
        "--llm-addr",
        "ht tp://x",
        "--http-listen",
        "127.0.0.1:0",
        "--grpc-listen",
        "127.0.0.1:0",
    ]);
    refused(&out, "ht tp://x");
}

#[test]
fn the_required_model_flag_is_named() {
    let out = gateway(&["--llm-addr", "http://127.0.0.1:1"]);
    refused(&out, "--model");
}
