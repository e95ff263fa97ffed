//! The local stack with several replicas (`vlm serve --replicas 2` on the CPU, `--gpus 0,1` on
//! GPUs): two vision-svc and two llm-svc behind one gateway, which routes chats to both; each
//! llm-svc's metrics show on the gateway's /metrics under its own `replica` label, one family
//! per name.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use vlm_cli::stack::{LocalStack, StackConfig};
use vlm_compute::{CpuBackend, Device, OnDevices};

fn fixture() -> PathBuf {
    vlm_compute::golden::tiny_fixture(env!("CARGO_MANIFEST_DIR"))
}

/// The `replica`'s value of the counter `name` on the gateway's /metrics page.
fn per_replica(page: &str, name: &str, replica: usize) -> f64 {
    let prefix = format!("{name}{{replica=\"{replica}\"}}");
    page.lines()
        .find_map(|l| l.strip_prefix(&prefix)?.trim().parse().ok())
        .unwrap_or(0.0)
}

async fn chat(http: SocketAddr, text: &str) {
    let body = serde_json::json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 2,
    });
    let resp = reqwest::Client::new()
        .post(format!("http://{http}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "{}", resp.text().await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_cpu_replicas_both_serve_behind_one_gateway() {
    // As `vlm serve --replicas 2` asks for them: one opener per replica, all the CPU.
    struct Openers;
    impl OnDevices for Openers {
        type Output = usize;
        fn run<B: vlm_compute::Backend + Clone>(
            self,
            opens: Vec<fn() -> vlm_compute::Result<B>>,
        ) -> usize {
            opens.len()
        }
    }
    assert_eq!(Device::run_all(&[Device::Cpu; 2], Openers), Some(2));
    assert_eq!(
        Device::run_all(&[Device::Cpu, Device::Cuda(0)], Openers),
        None,
        "CPU and GPU replicas are not mixed"
    );

    let cpu: fn() -> vlm_compute::Result<CpuBackend> = || Ok(CpuBackend::new());
    let mut stack = LocalStack::start_replicas(StackConfig::loopback(fixture()), vec![cpu; 2])
        .await
        .unwrap();
    assert_eq!(stack.llm_addrs.len(), 2);
    assert_eq!(stack.vision_addrs.len(), 2);
    stack.ready(Duration::from_secs(120)).await.unwrap();

    // Prompts that differ from their first block on (the chat template's opening is shared,
    // so they start apart), nothing cached: the gateway spreads them over both.
    for i in 0..6 {
        let text = format!("{i}{i}{i} apart ").repeat(8 + i);
        chat(stack.http_addr, &text).await;
    }
    let page = reqwest::get(format!("http://{}/metrics", stack.http_addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for replica in 0..2 {
        let tokens = per_replica(&page, "vlm_llm_prompt_tokens_total", replica);
        assert!(tokens > 0.0, "replica {replica} served nothing:\n{page}");
    }
    assert_eq!(
        page.matches("# TYPE vlm_llm_prompt_tokens_total ").count(),
        1,
        "one family per name"
    );
    stack.stop().await.unwrap();
}
