//! A suite nobody here wrote: llama.cpp's server tests (tools/server/tests/unit:
//! test_chat_completion.py, test_tool_call.py, test_vision_api.py), their shape and error
//! assertions ported to `llama_cpp_suite.py` beside this file, run against the real stack's
//! OpenAI-compatible HTTP port. The Python file's header lists each case's llama.cpp source and
//! the tests left out, with why.
//!
//! The features the suite covers that the gateway may not serve yet (tools, `response_format`,
//! `structured_outputs`) are probed first: a case group runs only where its probe request is
//! answered 200, and a group left off is reported as SKIPPED (`vlm_compute::skip::note`), so
//! the cases switch on by themselves once the gateway takes the field.

use std::time::Duration;

use e2e::{fixture, Stack, StackOptions};
use serde_json::{json, Value};

/// The suite's gates: the env var its cases read, what it covers, and a request that the
/// gateway answers 200 once it serves the feature.
fn probes() -> Vec<(&'static str, &'static str, Value)> {
    let user = json!([{"role": "user", "content": "hi"}]);
    vec![
        (
            "VLM_SUITE_TOOLS",
            "tools / tool_choice / tool_calls",
            json!({"messages": user, "max_tokens": 1, "tool_choice": "auto",
                   "tools": [{"type": "function", "function": {"name": "f",
                              "parameters": {"type": "object"}}}]}),
        ),
        (
            "VLM_SUITE_RESPONSE_FORMAT",
            "response_format json_object / json_schema",
            json!({"messages": user, "max_tokens": 1,
                   "response_format": {"type": "json_schema",
                                       "json_schema": {"name": "x", "schema": {"const": 1}}}}),
        ),
        (
            "VLM_SUITE_STRUCTURED_OUTPUTS",
            "structured_outputs.grammar",
            json!({"messages": user, "max_tokens": 1,
                   "structured_outputs": {"grammar": "start: \"a\""}}),
        ),
    ]
}

fn python_has_openai() -> bool {
    std::process::Command::new("python3")
        .args(["-c", "import openai"])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[tokio::test(flavor = "multi_thread")]
async fn llama_cpp_server_tests_pass_against_the_stack() {
    if !python_has_openai() {
        vlm_compute::skip::note(
            &"python3 with the `openai` package is needed for llama.cpp's ported server tests (pip install openai)",
        );
        return;
    }
    let stack = Stack::start(StackOptions::default()).await;
    let http = reqwest::Client::new();
    let mut gates = Vec::new();
    for (var, what, body) in probes() {
        let res = http
            .post(format!("{}/v1/chat/completions", stack.http))
            .json(&body)
            .timeout(Duration::from_secs(120))
            .send()
            .await
            .expect("probe request");
        let status = res.status();
        if status.is_success() {
            gates.push((var, "1"));
        } else {
            let text = res.text().await.unwrap_or_default();
            vlm_compute::skip::note(&format!(
                "llama.cpp suite: the {what} cases are off: the gateway answers their probe {status}: {text}"
            ));
            gates.push((var, "0"));
        }
    }

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/e2e/llama_cpp_suite.py");
    let out = tokio::process::Command::new("python3")
        .arg(script)
        .args(["--base-url", &stack.http])
        .arg("--image")
        .arg(fixture().join("images/cat.png"))
        .envs(gates)
        .output()
        .await
        .expect("python3 runs");
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "llama.cpp's ported server tests failed against the stack ({}):\n{report}",
        out.status
    );
    eprintln!("{report}");
}
