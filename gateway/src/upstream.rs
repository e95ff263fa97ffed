//! The model services as the gateway reaches them: each service's replicas, tried round-robin
//! with failover, over plaintext or TLS, with the internal hops' HTTP/2 settings.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::Status;

use crate::gateway_error::{upstream_gone, GatewayError};

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

/// One or more replicas of an upstream service, tried round-robin; a replica that answers
/// UNAVAILABLE (or whose connection breaks) is skipped for the next one. Channels connect
/// lazily and reconnect on their own, so the gateway starts before its upstreams and recovers
/// when they return.
pub struct Upstreams {
    service: &'static str,
    replicas: Vec<(String, Channel)>,
    next: AtomicUsize,
}

impl Upstreams {
    /// Replicas at `addrs`, over TLS when `tls` is given.
    pub fn new(
        service: &'static str,
        addrs: &[String],
        tls: Option<&ClientTlsConfig>,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(!addrs.is_empty(), "no {service} address given");
        let replicas = addrs
            .iter()
            .map(|a| {
                let ch = vlm_proto::internal_hop::endpoint(upstream_endpoint(a, tls)?)
                    .connect_timeout(Duration::from_secs(2))
                    .tcp_nodelay(true)
                    .connect_lazy();
                Ok((a.clone(), ch))
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Self {
            service,
            replicas,
            next: AtomicUsize::new(0),
        })
    }

    /// Every replica's address.
    pub(crate) fn addrs(&self) -> impl Iterator<Item = &str> {
        self.replicas.iter().map(|(a, _)| a.as_str())
    }

    /// The channel to the replica at `addr` (one of [`Upstreams::addrs`]).
    pub(crate) fn channel(&self, addr: &str) -> Option<Channel> {
        self.replicas
            .iter()
            .find(|(a, _)| a == addr)
            .map(|(_, ch)| ch.clone())
    }

    /// Replicas in the order to try them for the next call.
    fn order(&self) -> impl Iterator<Item = &(String, Channel)> {
        let n = self.replicas.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        (0..n).map(move |i| &self.replicas[(start + i) % n])
    }

    /// Runs `call` on replicas until one is not gone ([`upstream_gone`]); returns its answer
    /// and the replica's address.
    pub(crate) async fn call<T, F, Fut>(&self, mut call: F) -> Result<(T, String), GatewayError>
    where
        F: FnMut(Channel) -> Fut,
        Fut: std::future::Future<Output = Result<T, Status>>,
    {
        let mut last = None;
        for (addr, ch) in self.order() {
            match call(ch.clone()).await {
                Ok(v) => return Ok((v, addr.clone())),
                Err(s) if upstream_gone(&s) => {
                    tracing::warn!(service = self.service, %addr, error = %s.message(), "replica unavailable");
                    last = Some(GatewayError::upstream(self.service, addr, &s));
                }
                Err(s) => return Err(GatewayError::upstream(self.service, addr, &s)),
            }
        }
        Err(last.expect("at least one replica"))
    }
}
