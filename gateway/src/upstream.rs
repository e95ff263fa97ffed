//! The model services as the gateway reaches them: each service's replicas, picked by
//! [`crate::routing`] with failover, health-checked and ejected when they fail, over plaintext
//! or TLS, with the internal hops' HTTP/2 settings.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::Status;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use crate::gateway_error::{upstream_gone, GatewayError};
use crate::routing::{affinity, llm_cost, BlockRecord, Policy, RouteKey, RoutingConfig};

/// Lets go of what an encoded image left upstream for llm-svc (a shared-memory segment, a
/// device handoff: the gateway passes both on by name and never looks inside) when its request
/// fails before llm-svc takes it. The gateway's own is [`ReleaseSharedMemory`]; `vlm serve`,
/// whose stages share its process, supplies one that frees device handoffs too.
pub trait Release: Send + Sync {
    fn release(&self, image: &vlm_proto::pb::ImageEmbeddings);
}

/// Removes an image's shared-memory segment, which any process on the host can; a device
/// handoff lives in another process, and is dropped there when it expires.
pub struct ReleaseSharedMemory;

impl Release for ReleaseSharedMemory {
    fn release(&self, image: &vlm_proto::pb::ImageEmbeddings) {
        drop(vlm_proto::shm::Segment::new(&image.shm_segment));
    }
}

/// The endpoint of an upstream at `addr` (`host:port`, or a URL): plaintext, or with `tls`
/// TLS (a bare `host:port` then means `https://`, and the certificate must name the host).
pub fn upstream_endpoint(addr: &str, tls: Option<&ClientTlsConfig>) -> anyhow::Result<Endpoint> {
    let uri = match (addr.contains("://"), tls) {
        (true, _) => addr.to_string(),
        (false, None) => format!("http://{addr}"),
        (false, Some(_)) => format!("https://{addr}"),
    };
    // An explicit http:// would silently bypass the TLS the flags ask for.
    anyhow::ensure!(
        tls.is_none() || uri.starts_with("https://"),
        "upstream address {addr:?} is not https://, but upstream TLS is configured"
    );
    let endpoint = Endpoint::from_shared(uri.clone())
        .with_context(|| format!("bad upstream address {addr:?}"))?;
    match tls {
        Some(tls) => endpoint
            .tls_config(tls.clone())
            .with_context(|| format!("cannot set up TLS to {uri}")),
        None => Ok(endpoint),
    }
}

/// How often each replica's `grpc.health.v1` is asked, and how long an answer may take: a
/// replica that stops answering is ejected within their sum (1 s).
pub const HEALTH_INTERVAL: Duration = Duration::from_millis(250);
pub const HEALTH_TIMEOUT: Duration = Duration::from_millis(750);

/// One replica: its channel, whether it is admitted, and what the gateway has sent it.
struct Replica {
    addr: String,
    channel: Channel,
    /// False while ejected: its connection or health check failed, and it has not answered
    /// SERVING since. Ejected replicas are tried only when no admitted one is left.
    admitted: AtomicBool,
    /// Calls the gateway has in flight there, and their prompts' KV blocks (llm-svc).
    in_flight: AtomicUsize,
    active_blocks: AtomicUsize,
    /// The prompt blocks the gateway sent there ([`crate::routing`]).
    record: Mutex<BlockRecord>,
}

/// One or more replicas of an upstream service. Each call goes to the replica
/// [`crate::routing`] picks among the admitted ones; a replica that answers UNAVAILABLE (or
/// whose connection breaks) is ejected and the call goes to the next. With
/// [`Upstreams::watch_health`] running, every replica's health is asked every
/// [`HEALTH_INTERVAL`]: one that fails is ejected within a second, one that answers again is
/// re-admitted, so a dead host costs requests no connect timeout. Channels connect lazily and
/// reconnect on their own, so the gateway starts before its upstreams and recovers when they
/// return.
pub struct Upstreams {
    service: &'static str,
    replicas: Arc<[Replica]>,
    next: AtomicUsize,
    routing: RoutingConfig,
}

/// A call's hold on its replica's load count; dropped when the call (or its stream) ends.
pub(crate) struct Load {
    replicas: Arc<[Replica]>,
    index: usize,
    blocks: usize,
}

impl Drop for Load {
    fn drop(&mut self) {
        let r = &self.replicas[self.index];
        r.in_flight.fetch_sub(1, Ordering::Relaxed);
        r.active_blocks.fetch_sub(self.blocks, Ordering::Relaxed);
    }
}

/// A call's answer, where it came from, and its hold on that replica's load.
pub(crate) struct Routed<T> {
    pub value: T,
    pub addr: String,
    pub load: Load,
}

impl Upstreams {
    /// Replicas at `addrs`, over TLS when `tls` is given, routed round-robin.
    pub fn new(
        service: &'static str,
        addrs: &[String],
        tls: Option<&ClientTlsConfig>,
    ) -> anyhow::Result<Self> {
        let routing = RoutingConfig {
            policy: Policy::RoundRobin,
            ..Default::default()
        };
        Self::with_routing(service, addrs, tls, routing)
    }

    /// Replicas at `addrs`, routed by `routing`.
    pub fn with_routing(
        service: &'static str,
        addrs: &[String],
        tls: Option<&ClientTlsConfig>,
        routing: RoutingConfig,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(!addrs.is_empty(), "no {service} address given");
        let replicas = addrs
            .iter()
            .map(|a| {
                let channel = vlm_proto::internal_hop::endpoint(upstream_endpoint(a, tls)?)
                    .connect_timeout(Duration::from_secs(2))
                    .tcp_nodelay(true)
                    .connect_lazy();
                Ok(Replica {
                    addr: a.clone(),
                    channel,
                    admitted: AtomicBool::new(true),
                    in_flight: AtomicUsize::new(0),
                    active_blocks: AtomicUsize::new(0),
                    record: Mutex::new(BlockRecord::new(routing.record_blocks)),
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(Self {
            service,
            replicas: replicas.into(),
            next: AtomicUsize::new(0),
            routing,
        })
    }

    /// Every replica's address.
    pub(crate) fn addrs(&self) -> impl Iterator<Item = &str> {
        self.replicas.iter().map(|r| r.addr.as_str())
    }

    /// The channel to the replica at `addr` (one of [`Upstreams::addrs`]).
    pub(crate) fn channel(&self, addr: &str) -> Option<Channel> {
        self.replicas
            .iter()
            .find(|r| r.addr == addr)
            .map(|r| r.channel.clone())
    }

    /// Whether the replica at `addr` is admitted (not ejected).
    pub fn admitted(&self, addr: &str) -> bool {
        self.replicas
            .iter()
            .any(|r| r.addr == addr && r.admitted.load(Ordering::Relaxed))
    }

    /// Ejects the replica at `addr`: no call goes there while another is admitted, until its
    /// health check answers SERVING again. What it held is forgotten (a restart empties it).
    pub(crate) fn eject(&self, addr: &str) {
        if let Some(i) = self.replicas.iter().position(|r| r.addr == addr) {
            eject(self.service, &self.replicas[i]);
        }
    }

    /// Notes that the replica at `addr` was sent a prompt of these blocks.
    pub(crate) fn record(&self, addr: &str, blocks: &[vlm_proto::prefix::BlockHash]) {
        if let Some(r) = self.replicas.iter().find(|r| r.addr == addr) {
            r.record
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(blocks);
        }
    }

    /// Asks every replica's health every [`HEALTH_INTERVAL`] until `stop`: ejects those that
    /// fail or take longer than [`HEALTH_TIMEOUT`], re-admits those that answer SERVING.
    pub fn watch_health(&self, stop: CancellationToken) {
        let replicas = self.replicas.clone();
        let service = self.service;
        tokio::spawn(async move {
            loop {
                let probes = replicas.iter().map(|r| async move {
                    let mut client = HealthClient::new(r.channel.clone());
                    let probe = client.check(HealthCheckRequest {
                        service: String::new(),
                    });
                    let serving = matches!(
                        tokio::time::timeout(HEALTH_TIMEOUT, probe).await,
                        Ok(Ok(a)) if a.get_ref().status == ServingStatus::Serving as i32
                    );
                    match (serving, r.admitted.load(Ordering::Relaxed)) {
                        (false, true) => eject(service, r),
                        (true, false) => {
                            r.admitted.store(true, Ordering::Relaxed);
                            tracing::info!(service, addr = %r.addr, "replica answers again: re-admitted");
                        }
                        _ => {}
                    }
                });
                futures::future::join_all(probes).await;
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(HEALTH_INTERVAL) => {}
                }
            }
        });
    }

    /// Replica indices in the order to try them for a call routed by `key`: the admitted ones,
    /// best first by [`crate::routing`], then the ejected ones (a last resort). `avoid`: a
    /// replica not to try at all.
    fn order(&self, key: RouteKey<'_>, avoid: Option<&str>) -> Vec<usize> {
        let n = self.replicas.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        // In turn from `start`, so ties go round robin.
        let turn: Vec<usize> = (0..n)
            .map(|i| (start + i) % n)
            .filter(|&i| Some(self.replicas[i].addr.as_str()) != avoid)
            .collect();
        let (mut admitted, ejected): (Vec<usize>, Vec<usize>) = turn
            .into_iter()
            .partition(|&i| self.replicas[i].admitted.load(Ordering::Relaxed));
        if self.routing.policy == Policy::CacheAware {
            self.rank(key, &mut admitted);
        }
        admitted.extend(ejected);
        admitted
    }

    /// Sorts `candidates` (in turn order) best first for `key` (stable: ties keep their turn).
    fn rank(&self, key: RouteKey<'_>, candidates: &mut [usize]) {
        let load = |i: usize| self.replicas[i].in_flight.load(Ordering::Relaxed);
        match key {
            RouteKey::None => candidates.sort_by_key(|&i| load(i)),
            RouteKey::Prompt(blocks) => {
                let cost = |i: usize| {
                    let r = &self.replicas[i];
                    let overlap = r
                        .record
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .overlap(blocks);
                    llm_cost(
                        self.routing.overlap_weight,
                        blocks.len(),
                        overlap,
                        r.active_blocks.load(Ordering::Relaxed),
                    )
                };
                let mut costed: Vec<(f64, usize, usize)> =
                    candidates.iter().map(|&i| (cost(i), load(i), i)).collect();
                costed.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
                for (slot, (_, _, i)) in candidates.iter_mut().zip(costed) {
                    *slot = i;
                }
            }
            RouteKey::Image(image) => {
                candidates
                    .sort_by_key(|&i| std::cmp::Reverse(affinity(image, &self.replicas[i].addr)));
                let least = candidates.iter().map(|&i| load(i)).min().unwrap_or(0);
                if let Some(&best) = candidates.first() {
                    if load(best) > least + self.routing.vision_slack {
                        candidates.sort_by_key(|&i| load(i));
                    }
                }
            }
        }
    }

    /// Runs `call` on replicas, best first for `key`, until one is not gone
    /// ([`upstream_gone`]; a gone one is ejected); returns its answer, the replica's address
    /// and its load hold. `blocks`: the KV blocks the call puts on the replica, for its load.
    pub(crate) async fn call<T, F, Fut>(
        &self,
        key: RouteKey<'_>,
        avoid: Option<&str>,
        mut call: F,
    ) -> Result<Routed<T>, GatewayError>
    where
        F: FnMut(Channel) -> Fut,
        Fut: std::future::Future<Output = Result<T, Status>>,
    {
        let blocks = match key {
            RouteKey::Prompt(b) => b.len(),
            _ => 0,
        };
        let mut last = None;
        for i in self.order(key, avoid) {
            let r = &self.replicas[i];
            r.in_flight.fetch_add(1, Ordering::Relaxed);
            r.active_blocks.fetch_add(blocks, Ordering::Relaxed);
            let load = Load {
                replicas: self.replicas.clone(),
                index: i,
                blocks,
            };
            match call(r.channel.clone()).await {
                Ok(value) => {
                    return Ok(Routed {
                        value,
                        addr: r.addr.clone(),
                        load,
                    })
                }
                Err(s) if upstream_gone(&s) => {
                    tracing::warn!(service = self.service, addr = %r.addr, error = %s.message(), "replica unavailable");
                    eject(self.service, r);
                    last = Some(GatewayError::upstream(self.service, &r.addr, &s));
                }
                Err(s) => return Err(GatewayError::upstream(self.service, &r.addr, &s)),
            }
        }
        Err(last.unwrap_or_else(|| {
            GatewayError::Unavailable(format!("no other {} replica to try", self.service))
        }))
    }
}

/// Ejects `r` (see [`Upstreams::eject`]).
fn eject(service: &str, r: &Replica) {
    if r.admitted.swap(false, Ordering::Relaxed) {
        tracing::warn!(service, addr = %r.addr, "replica ejected until it answers its health check");
    }
    r.record.lock().unwrap_or_else(|e| e.into_inner()).clear();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llm(addrs: &[&str]) -> Upstreams {
        let addrs: Vec<String> = addrs.iter().map(|a| a.to_string()).collect();
        Upstreams::with_routing("llm-svc", &addrs, None, RoutingConfig::default()).unwrap()
    }

    #[tokio::test]
    async fn a_prompt_goes_where_its_blocks_are_and_new_prompts_alternate() {
        let u = llm(&["a:1", "b:1"]);
        let firsts: Vec<usize> = (0..4)
            .map(|_| u.order(RouteKey::Prompt(&[1, 2, 3]), None)[0])
            .collect();
        assert_eq!(firsts, [0, 1, 0, 1], "nothing held: in turn");
        u.record("b:1", &[1, 2]);
        for _ in 0..3 {
            assert_eq!(u.order(RouteKey::Prompt(&[1, 2, 3]), None)[0], 1);
        }
        // Busy enough, b loses to a despite holding the prefix.
        u.replicas[1].active_blocks.store(5, Ordering::Relaxed);
        assert_eq!(u.order(RouteKey::Prompt(&[1, 2, 3]), None)[0], 0);
    }

    #[tokio::test]
    async fn an_ejected_replica_is_tried_last_and_forgets_what_it_held() {
        let u = llm(&["a:1", "b:1"]);
        u.record("b:1", &[1, 2]);
        u.eject("b:1");
        assert!(!u.admitted("b:1"));
        for _ in 0..3 {
            assert_eq!(u.order(RouteKey::Prompt(&[1, 2]), None), [0, 1]);
        }
        assert_eq!(u.order(RouteKey::None, Some("a:1")), [1], "a avoided");
        u.replicas[1].admitted.store(true, Ordering::Relaxed);
        let firsts: Vec<usize> = (0..2)
            .map(|_| u.order(RouteKey::Prompt(&[1, 2]), None)[0])
            .collect();
        assert!(
            firsts.contains(&1),
            "re-admitted with nothing held: back in turn"
        );
    }
}
