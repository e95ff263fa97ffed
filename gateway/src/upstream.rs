//! The model services as the gateway reaches them: each service's replicas, picked by
//! [`crate::routing`] with failover, health-checked and ejected when they fail, over plaintext
//! or TLS, with the internal hops' HTTP/2 settings.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

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
/// fails before llm-svc takes it. The gateway's own is [`ReleaseOnHost`]; `vlm serve`, whose
/// stages share its process, supplies one that frees device handoffs too.
pub trait Release: Send + Sync {
    fn release(&self, image: &vlm_proto::pb::ImageEmbeddings);
}

/// What any process on the host may let go of
/// ([`vlm_proto::pb::ImageEmbeddings::release_on_host`]: the contract knows which of its names
/// that is); a device handoff lives in another process, and is dropped there when it expires.
pub struct ReleaseOnHost;

impl Release for ReleaseOnHost {
    fn release(&self, image: &vlm_proto::pb::ImageEmbeddings) {
        image.release_on_host();
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
    /// The given address (index into the targets) it comes from.
    target: usize,
    channel: Channel,
    /// False while ejected: its connection or health check failed, and it has not answered
    /// SERVING since. Ejected replicas are tried only when no admitted one is left.
    admitted: AtomicBool,
    /// Whether it has ever answered SERVING. Until then a failed health check is a service
    /// still loading its model (the gateway usually starts first), said at info, not a
    /// replica lost, said as a warning.
    served: AtomicBool,
    /// Whether the gateway has warned that it never answered ([`STARTUP_PATIENCE`]).
    slow_start_warned: AtomicBool,
    /// When it was last ejected.
    ejected_at: Mutex<Option<Instant>>,
    /// Calls the gateway has in flight there, and their prompts' KV blocks (llm-svc).
    in_flight: AtomicUsize,
    active_blocks: AtomicUsize,
    /// The prompt blocks the gateway sent there ([`crate::routing`]).
    record: Mutex<BlockRecord>,
}

/// An address as given: an IP (a replica of its own) or a DNS name (as many replicas as it
/// resolves to, resolved again every interval).
struct Target {
    given: String,
    /// For a DNS name: the scheme prefix given (`""`, `http://`, `https://`), host and port.
    name: Option<(String, String, u16)>,
}

impl Target {
    fn parse(given: &str) -> Target {
        let (scheme, rest) = match given.find("://") {
            Some(i) => given.split_at(i + 3),
            None => ("", given),
        };
        let rest = rest.trim_end_matches('/');
        let name = rest.rsplit_once(':').and_then(|(host, port)| {
            let port: u16 = port.parse().ok()?;
            let is_ip = host.parse::<std::net::IpAddr>().is_ok() || host.starts_with('[');
            (!is_ip && !host.is_empty()).then(|| (scheme.to_string(), host.to_string(), port))
        });
        Target {
            given: given.to_string(),
            name,
        }
    }
}

/// One or more replicas of an upstream service. Each call goes to the replica
/// [`crate::routing`] picks among the admitted ones; a replica that answers UNAVAILABLE (or
/// whose connection breaks) is ejected and the call goes to the next. With
/// [`Upstreams::watch_health`] running, every replica's health is asked every
/// [`HEALTH_INTERVAL`]: one that fails is ejected within a second, one that answers again is
/// re-admitted, so a dead host costs requests no connect timeout; and an address that is a
/// DNS name is resolved again every interval, each address it gives a replica. Channels
/// connect lazily and reconnect on their own, so the gateway starts before its upstreams and
/// recovers when they return.
pub struct Upstreams {
    shared: Arc<Shared>,
    next: AtomicUsize,
    routing: RoutingConfig,
}

/// What the health and DNS tasks share with the calls.
struct Shared {
    service: &'static str,
    targets: Vec<Target>,
    tls: Option<ClientTlsConfig>,
    routing: RoutingConfig,
    /// The replicas now; replaced whole when a name resolves differently.
    replicas: RwLock<Arc<[Arc<Replica>]>>,
}

/// A call's hold on its replica's load count; dropped when the call (or its stream) ends.
pub(crate) struct Load {
    replica: Arc<Replica>,
    blocks: usize,
}

impl Drop for Load {
    fn drop(&mut self) {
        self.replica.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.replica
            .active_blocks
            .fetch_sub(self.blocks, Ordering::Relaxed);
    }
}

/// A call's answer, where it came from, and its hold on that replica's load.
pub(crate) struct Routed<T> {
    pub value: T,
    pub addr: String,
    pub load: Load,
}

/// A replica at `addr` (`host:port` or a URL); `server_name`: the name its TLS certificate
/// must carry when `addr` is an IP a DNS name resolved to.
fn replica(
    addr: String,
    target: usize,
    tls: Option<&ClientTlsConfig>,
    server_name: Option<&str>,
    routing: &RoutingConfig,
) -> anyhow::Result<Replica> {
    let tls = match (tls, server_name) {
        (Some(t), Some(name)) => Some(t.clone().domain_name(name)),
        (t, _) => t.cloned(),
    };
    let channel = vlm_proto::internal_hop::endpoint(upstream_endpoint(&addr, tls.as_ref())?)
        .connect_timeout(Duration::from_secs(2))
        .tcp_nodelay(true)
        .connect_lazy();
    Ok(Replica {
        addr,
        target,
        channel,
        admitted: AtomicBool::new(true),
        served: AtomicBool::new(false),
        slow_start_warned: AtomicBool::new(false),
        ejected_at: Mutex::new(None),
        in_flight: AtomicUsize::new(0),
        active_blocks: AtomicUsize::new(0),
        record: Mutex::new(BlockRecord::new(routing.record_blocks)),
    })
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

    /// Replicas at `addrs`, routed by `routing`. A DNS name is one replica, under its name,
    /// until [`Upstreams::watch_health`] resolves it.
    pub fn with_routing(
        service: &'static str,
        addrs: &[String],
        tls: Option<&ClientTlsConfig>,
        routing: RoutingConfig,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(!addrs.is_empty(), "no {service} address given");
        let replicas = addrs
            .iter()
            .enumerate()
            .map(|(i, a)| replica(a.clone(), i, tls, None, &routing).map(Arc::new))
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(Self {
            shared: Arc::new(Shared {
                service,
                targets: addrs.iter().map(|a| Target::parse(a)).collect(),
                tls: tls.cloned(),
                routing: routing.clone(),
                replicas: RwLock::new(replicas.into()),
            }),
            next: AtomicUsize::new(0),
            routing,
        })
    }

    /// The replicas now.
    fn snapshot(&self) -> Arc<[Arc<Replica>]> {
        self.shared.snapshot()
    }

    fn find(&self, addr: &str) -> Option<Arc<Replica>> {
        self.snapshot().iter().find(|r| r.addr == addr).cloned()
    }

    /// Every replica's address.
    pub(crate) fn addrs(&self) -> Vec<String> {
        self.snapshot().iter().map(|r| r.addr.clone()).collect()
    }

    /// The channel to the replica at `addr` (one of [`Upstreams::addrs`]).
    pub(crate) fn channel(&self, addr: &str) -> Option<Channel> {
        self.find(addr).map(|r| r.channel.clone())
    }

    /// Whether the router sends calls to the replica at `addr` (admitted) or not (ejected);
    /// `None` for an address it has no replica at (a DNS name, whose replicas are the addresses
    /// it resolves to).
    pub fn routed(&self, addr: &str) -> Option<bool> {
        self.find(addr).map(|r| r.admitted.load(Ordering::Relaxed))
    }

    /// Whether the replica at `addr` is admitted (not ejected).
    pub fn admitted(&self, addr: &str) -> bool {
        self.find(addr)
            .is_some_and(|r| r.admitted.load(Ordering::Relaxed))
    }

    /// Ejects the replica at `addr`: no call goes there while another is admitted, until its
    /// health check answers SERVING again. What it held is forgotten if it stays out for
    /// longer than a restart takes ([`RESTART_AFTER`]).
    pub(crate) fn eject(&self, addr: &str) {
        if let Some(r) = self.find(addr) {
            eject(self.shared.service, &r);
        }
    }

    /// Notes that the replica at `addr` was sent a prompt of these blocks.
    pub(crate) fn record(&self, addr: &str, blocks: &[vlm_proto::prefix::BlockHash]) {
        if let Some(r) = self.find(addr) {
            r.record
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(blocks);
        }
    }

    /// Until `stop`: asks every replica's health every [`HEALTH_INTERVAL`], ejecting those
    /// that fail or take longer than [`HEALTH_TIMEOUT`] and re-admitting those that answer
    /// SERVING; and resolves DNS names again every `resolve_interval` ([`RoutingConfig`]).
    pub fn watch_health(&self, stop: CancellationToken) {
        let shared = self.shared.clone();
        let health_stop = stop.clone();
        tokio::spawn(async move {
            loop {
                let replicas = shared.snapshot();
                let service = shared.service;
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
                        (true, false) => readmit(service, r),
                        (true, true) => first_served(service, r),
                        (false, false) => still_not_serving(service, r),
                    }
                });
                futures::future::join_all(probes).await;
                tokio::select! {
                    _ = health_stop.cancelled() => break,
                    _ = tokio::time::sleep(HEALTH_INTERVAL) => {}
                }
            }
        });
        if self.shared.targets.iter().all(|t| t.name.is_none()) {
            return;
        }
        let (shared, interval) = (self.shared.clone(), self.routing.resolve_interval);
        tokio::spawn(async move {
            loop {
                let resolved = shared.resolve().await;
                shared.apply_resolved(&resolved);
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(interval) => {}
                }
            }
        });
    }

    /// Replicas in the order to try them for a call routed by `key`: the admitted ones, best
    /// first by [`crate::routing`], then the ejected ones (a last resort). `avoid`: a replica
    /// not to try at all.
    fn order(&self, key: RouteKey<'_>, avoid: Option<&str>) -> Vec<Arc<Replica>> {
        let replicas = self.snapshot();
        let n = replicas.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n.max(1);
        // In turn from `start`, so ties go round robin.
        let turn: Vec<Arc<Replica>> = (0..n)
            .map(|i| replicas[(start + i) % n].clone())
            .filter(|r| Some(r.addr.as_str()) != avoid)
            .collect();
        let (mut admitted, ejected): (Vec<_>, Vec<_>) = turn
            .into_iter()
            .partition(|r| r.admitted.load(Ordering::Relaxed));
        if self.routing.policy == Policy::CacheAware {
            self.rank(key, &mut admitted);
        }
        admitted.extend(ejected);
        admitted
    }

    /// Sorts `candidates` (in turn order) best first for `key` (stable: ties keep their turn).
    fn rank(&self, key: RouteKey<'_>, candidates: &mut [Arc<Replica>]) {
        let load = |r: &Replica| r.in_flight.load(Ordering::Relaxed);
        match key {
            RouteKey::None => candidates.sort_by_key(|r| load(r)),
            RouteKey::Prompt(blocks) => {
                let cost = |r: &Replica| {
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
                let mut costed: Vec<(f64, usize, Arc<Replica>)> = candidates
                    .iter()
                    .map(|r| (cost(r), load(r), r.clone()))
                    .collect();
                costed.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
                for (slot, (_, _, r)) in candidates.iter_mut().zip(costed) {
                    *slot = r;
                }
            }
            RouteKey::Image(image) => {
                candidates.sort_by_key(|r| std::cmp::Reverse(affinity(image, &r.addr)));
                let least = candidates.iter().map(|r| load(r)).min().unwrap_or(0);
                if let Some(best) = candidates.first() {
                    if load(best) > least + self.routing.vision_slack {
                        candidates.sort_by_key(|r| load(r));
                    }
                }
            }
        }
    }

    /// Runs `call` on replicas, best first for `key`, until one is not gone
    /// ([`upstream_gone`]; a gone one is ejected); returns its answer, the replica's address
    /// and its load hold. `avoid`: a replica not to try (one that just failed).
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
        for r in self.order(key, avoid) {
            r.in_flight.fetch_add(1, Ordering::Relaxed);
            r.active_blocks.fetch_add(blocks, Ordering::Relaxed);
            let load = Load {
                replica: r.clone(),
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
                    tracing::warn!(service = self.shared.service, addr = %r.addr, error = %s.message(), "replica unavailable");
                    eject(self.shared.service, &r);
                    last = Some(GatewayError::upstream(self.shared.service, &r.addr, &s));
                }
                Err(s) => return Err(GatewayError::upstream(self.shared.service, &r.addr, &s)),
            }
        }
        Err(last.unwrap_or_else(|| {
            GatewayError::Unavailable(format!("no other {} replica to try", self.shared.service))
        }))
    }
}

impl Shared {
    fn snapshot(&self) -> Arc<[Arc<Replica>]> {
        self.replicas
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Sets the replicas from what each DNS name resolved to (`resolved[i]`: target `i`'s
    /// addresses; `None`: an IP, or a name that did not resolve, which keeps its replicas).
    /// A replica whose address stays keeps its state; one whose address went is dropped
    /// (calls under way on it finish).
    fn apply_resolved(&self, resolved: &[Option<Vec<std::net::SocketAddr>>]) {
        let now = self.snapshot();
        let mut next: Vec<Arc<Replica>> = Vec::new();
        for (i, (target, found)) in self.targets.iter().zip(resolved).enumerate() {
            let (Some((scheme, host, _)), Some(found)) = (&target.name, found) else {
                // An IP, or a name that did not resolve: it keeps its replicas.
                next.extend(now.iter().filter(|r| r.target == i).cloned());
                continue;
            };
            for sa in found {
                let addr = format!("{scheme}{sa}");
                if next.iter().any(|r| r.addr == addr) {
                    continue;
                }
                match now.iter().find(|r| r.addr == addr) {
                    Some(r) => next.push(r.clone()),
                    None => match replica(
                        addr.clone(),
                        i,
                        self.tls.as_ref(),
                        Some(host),
                        &self.routing,
                    ) {
                        Ok(r) => {
                            tracing::info!(service = self.service, name = %target.given, %addr, "replica found by DNS");
                            next.push(Arc::new(r));
                        }
                        Err(e) => {
                            tracing::warn!(service = self.service, %addr, error = %e, "cannot use a resolved address")
                        }
                    },
                }
            }
        }
        for gone in now
            .iter()
            .filter(|r| !next.iter().any(|n| n.addr == r.addr))
        {
            tracing::info!(service = self.service, addr = %gone.addr, "replica no longer in DNS: removed");
        }
        if next.is_empty() {
            return;
        }
        *self.replicas.write().unwrap_or_else(|e| e.into_inner()) = next.into();
    }

    /// Resolves every DNS-name target once (`None` for IPs and for names that fail).
    async fn resolve(&self) -> Vec<Option<Vec<std::net::SocketAddr>>> {
        let mut out = Vec::with_capacity(self.targets.len());
        for t in &self.targets {
            out.push(match &t.name {
                None => None,
                Some((_, host, port)) => {
                    match tokio::net::lookup_host((host.as_str(), *port)).await {
                        Ok(addrs) => {
                            let mut addrs: Vec<_> = addrs.collect();
                            addrs.sort();
                            addrs.dedup();
                            (!addrs.is_empty()).then_some(addrs)
                        }
                        Err(e) => {
                            tracing::warn!(service = self.service, name = %t.given, error = %e, "DNS name does not resolve; keeping its replicas");
                            None
                        }
                    }
                }
            });
        }
        out
    }
}

/// Ejects `r` (see [`Upstreams::eject`]).
fn eject(service: &str, r: &Replica) {
    if r.admitted.swap(false, Ordering::Relaxed) {
        *r.ejected_at.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        if r.served.load(Ordering::Relaxed) {
            tracing::warn!(service, addr = %r.addr, "replica ejected until it answers its health check");
        } else {
            tracing::info!(service, addr = %r.addr, "replica not serving yet (loading its model?): waiting for its health check");
        }
    }
}

/// How long a replica that has never answered SERVING is waited for before the gateway warns
/// that it may be misaddressed: longer than an 8B model takes to load from a slow disk.
const STARTUP_PATIENCE: Duration = Duration::from_secs(180);

/// A failed health check of an ejected replica: warns once if it has never answered and has
/// been waited for longer than [`STARTUP_PATIENCE`].
fn still_not_serving(service: &str, r: &Replica) {
    if r.served.load(Ordering::Relaxed) || r.slow_start_warned.load(Ordering::Relaxed) {
        return;
    }
    let waited = time_ejected(r, false);
    if waited > STARTUP_PATIENCE && !r.slow_start_warned.swap(true, Ordering::Relaxed) {
        tracing::warn!(service, addr = %r.addr, waited_s = waited.as_secs(), "replica has never answered its health check: is the address right, and did the service start?");
    }
}

/// Notes that `r` answered SERVING, saying so the first time.
fn first_served(service: &str, r: &Replica) {
    if !r.served.swap(true, Ordering::Relaxed) {
        tracing::info!(service, addr = %r.addr, "replica serving");
    }
}

/// A replica out for longer than this when it answers again is taken to have restarted (a
/// model takes longer than this to load), and what the gateway recorded for it is forgotten;
/// a shorter ejection (a health answer slowed by load) keeps it.
const RESTART_AFTER: Duration = Duration::from_secs(2);

/// How long `r` has been ejected (zero if it is not), forgetting when if `clear`.
fn time_ejected(r: &Replica, clear: bool) -> Duration {
    let mut at = r.ejected_at.lock().unwrap_or_else(|e| e.into_inner());
    let since = at.map_or(Duration::ZERO, |t| t.elapsed());
    if clear {
        *at = None;
    }
    since
}

/// Re-admits `r`, which answered SERVING.
fn readmit(service: &str, r: &Replica) {
    let out_for = time_ejected(r, true);
    if out_for > RESTART_AFTER {
        r.record.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
    r.admitted.store(true, Ordering::Relaxed);
    if r.served.swap(true, Ordering::Relaxed) {
        tracing::info!(service, addr = %r.addr, out_ms = out_for.as_millis() as u64, "replica answers again: re-admitted");
    } else {
        tracing::info!(service, addr = %r.addr, waited_ms = out_for.as_millis() as u64, "replica serving");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llm(addrs: &[&str]) -> Upstreams {
        let addrs: Vec<String> = addrs.iter().map(|a| a.to_string()).collect();
        Upstreams::with_routing("llm-svc", &addrs, None, RoutingConfig::default()).unwrap()
    }

    /// The addresses of `order`'s answer.
    fn order(u: &Upstreams, key: RouteKey<'_>, avoid: Option<&str>) -> Vec<String> {
        u.order(key, avoid).iter().map(|r| r.addr.clone()).collect()
    }

    #[tokio::test]
    async fn a_prompt_goes_where_its_blocks_are_and_new_prompts_alternate() {
        let u = llm(&["a:1", "b:1"]);
        let firsts: Vec<String> = (0..4)
            .map(|_| order(&u, RouteKey::Prompt(&[1, 2, 3]), None)[0].clone())
            .collect();
        assert_eq!(
            firsts,
            ["a:1", "b:1", "a:1", "b:1"],
            "nothing held: in turn"
        );
        u.record("b:1", &[1, 2]);
        for _ in 0..3 {
            assert_eq!(order(&u, RouteKey::Prompt(&[1, 2, 3]), None)[0], "b:1");
        }
        // Busy by more blocks than the two it holds are worth, b loses to a despite them.
        let worth = 2.0 * crate::routing::DEFAULT_OVERLAP_WEIGHT;
        u.snapshot()[1]
            .active_blocks
            .store(worth as usize + 1, Ordering::Relaxed);
        assert_eq!(order(&u, RouteKey::Prompt(&[1, 2, 3]), None)[0], "a:1");
    }

    #[tokio::test]
    async fn an_image_sticks_to_one_replica_until_it_is_too_busy() {
        let u = llm(&["a:1", "b:1", "c:1"]);
        let first = order(&u, RouteKey::Image(7), None)[0].clone();
        for _ in 0..4 {
            assert_eq!(order(&u, RouteKey::Image(7), None)[0], first);
        }
        let busy = u.find(&first).unwrap();
        busy.in_flight.store(5, Ordering::Relaxed);
        assert_ne!(
            order(&u, RouteKey::Image(7), None)[0],
            first,
            "past the slack of 4"
        );
    }

    #[tokio::test]
    async fn an_ejected_replica_is_tried_last_and_forgets_what_it_held_once_out_for_a_restart() {
        let u = llm(&["a:1", "b:1"]);
        u.record("b:1", &[1, 2]);
        u.eject("b:1");
        assert!(!u.admitted("b:1"));
        for _ in 0..3 {
            assert_eq!(order(&u, RouteKey::Prompt(&[1, 2]), None), ["a:1", "b:1"]);
        }
        assert_eq!(order(&u, RouteKey::None, Some("a:1")), ["b:1"], "a avoided");
        // Back at once (a slow health answer): it still holds the prompt.
        let b = u.find("b:1").unwrap();
        readmit("llm-svc", &b);
        for _ in 0..2 {
            assert_eq!(order(&u, RouteKey::Prompt(&[1, 2]), None)[0], "b:1");
        }
        // Out for longer than a restart: forgotten, back in turn.
        u.eject("b:1");
        *b.ejected_at.lock().unwrap() = Some(Instant::now() - 2 * RESTART_AFTER);
        readmit("llm-svc", &b);
        assert!(u.admitted("b:1"));
        let firsts: Vec<String> = (0..2)
            .map(|_| order(&u, RouteKey::Prompt(&[1, 2]), None)[0].clone())
            .collect();
        assert!(firsts.contains(&"a:1".to_string()), "{firsts:?}");
    }

    /// What the health checks log, captured: a replica that has never answered is waited for
    /// (info, and one warning past STARTUP_PATIENCE), one that had answered and fails is a
    /// warning.
    #[test]
    fn a_replica_still_starting_is_waited_for_and_a_lost_one_warned_of() {
        #[derive(Clone, Default)]
        struct Lines(std::sync::Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Lines {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(buf);
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        let logged = || String::from_utf8(std::mem::take(&mut *lines.0.lock().unwrap())).unwrap();
        tracing::subscriber::with_default(subscriber, || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let _in_runtime = rt.enter();
            let u = llm(&["a:1"]);
            let a = u.find("a:1").unwrap();
            // Starting: the first failed check waits, the first answer says it serves.
            eject("llm-svc", &a);
            let starting = logged();
            assert!(
                starting.contains(" INFO ") && starting.contains("not serving yet"),
                "{starting}"
            );
            readmit("llm-svc", &a);
            let ready = logged();
            assert!(ready.contains("replica serving"), "{ready}");
            // Served, then lost: a warning; back again: re-admitted.
            eject("llm-svc", &a);
            let lost = logged();
            assert!(
                lost.contains(" WARN ") && lost.contains("ejected"),
                "{lost}"
            );
            readmit("llm-svc", &a);
            assert!(logged().contains("re-admitted"));
            // Never answering: one warning once past the patience.
            let u = llm(&["c:1"]);
            let c = u.find("c:1").unwrap();
            eject("llm-svc", &c);
            still_not_serving("llm-svc", &c);
            assert!(!logged().contains(" WARN "), "too soon");
            *c.ejected_at.lock().unwrap() = Some(Instant::now() - 2 * STARTUP_PATIENCE);
            still_not_serving("llm-svc", &c);
            still_not_serving("llm-svc", &c);
            let slow = logged();
            assert_eq!(slow.matches(" WARN ").count(), 1, "{slow}");
            assert!(slow.contains("never answered"), "{slow}");
            // Admitted from the start and answering: said once.
            let u = llm(&["b:1"]);
            let b = u.find("b:1").unwrap();
            first_served("llm-svc", &b);
            first_served("llm-svc", &b);
            assert_eq!(logged().matches("replica serving").count(), 1);
        });
    }

    #[test]
    fn names_are_told_from_ips() {
        let name = |a: &str| Target::parse(a).name;
        assert_eq!(
            name("llm-svc:50052"),
            Some(("".into(), "llm-svc".into(), 50052))
        );
        assert_eq!(
            name("https://llm.example:443"),
            Some(("https://".into(), "llm.example".into(), 443))
        );
        assert_eq!(name("127.0.0.1:50052"), None);
        assert_eq!(name("[::1]:50052"), None);
        assert_eq!(name("http://10.0.0.1:1"), None);
    }

    #[tokio::test]
    async fn a_name_becomes_a_replica_per_address_as_its_addresses_change() {
        let u = llm(&["llm-svc:50052", "127.0.0.1:9"]);
        assert_eq!(
            u.addrs(),
            ["llm-svc:50052", "127.0.0.1:9"],
            "unresolved yet"
        );
        let sa = |s: &str| -> std::net::SocketAddr { s.parse().unwrap() };
        let shared = u.shared.clone();
        shared.apply_resolved(&[Some(vec![sa("10.0.0.1:50052"), sa("10.0.0.2:50052")]), None]);
        assert_eq!(
            u.addrs(),
            ["10.0.0.1:50052", "10.0.0.2:50052", "127.0.0.1:9"]
        );
        u.record("10.0.0.2:50052", &[1, 2]);
        // A pod goes, another comes: the one that stays keeps what it held.
        shared.apply_resolved(&[Some(vec![sa("10.0.0.2:50052"), sa("10.0.0.3:50052")]), None]);
        assert_eq!(
            u.addrs(),
            ["10.0.0.2:50052", "10.0.0.3:50052", "127.0.0.1:9"]
        );
        assert_eq!(
            order(&u, RouteKey::Prompt(&[1, 2]), None)[0],
            "10.0.0.2:50052"
        );
        // A lookup that fails keeps the last answer.
        shared.apply_resolved(&[None, None]);
        assert_eq!(
            u.addrs(),
            ["10.0.0.2:50052", "10.0.0.3:50052", "127.0.0.1:9"]
        );
        // A real lookup: localhost resolves to loopback.
        let u = llm(&["localhost:50052"]);
        let found = u.shared.resolve().await;
        assert!(
            found[0].as_ref().unwrap().contains(&sa("127.0.0.1:50052")),
            "{found:?}"
        );
    }
}
