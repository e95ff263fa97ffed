//! Images by URL: `http://` and `https://` fetched by the gateway, `file://` read under
//! `--allowed-local-media-path`, for both APIs. A request's URLs are read into
//! [`PendingImage`]s as the request is parsed (the parts hold empty placeholders), fetched
//! concurrently by [`MediaFetcher::resolve`], and only then does the request reach the
//! orchestrator, which checks the bytes against `--max-image-bytes` and the image rule as it
//! does for `data:` URLs.
//!
//! No server-side request forgery: unless `--allow-private-media-addresses`, a host must resolve
//! to public addresses only; the check runs in the HTTP client's own resolver
//! ([`PublicOnly`]), so the address connected to is the address checked (a DNS rebinding
//! between a check and the connect cannot slip through), and IP-literal hosts are checked
//! before any request. Redirects are followed by hand, at most [`MAX_REDIRECTS`], each target
//! checked again. The body is read in chunks and dropped as soon as it passes the byte limit;
//! connect and total timeouts bound a slow server. Fetched images are cached by URL under a
//! byte budget, unless the response says `Cache-Control: no-store` (or `no-cache`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use reqwest::header::{CACHE_CONTROL, LOCATION};
use reqwest::Url;
use tracing::{field::Empty, info_span, Instrument};

use crate::chat::{Message, Part};
use crate::gateway_error::GatewayError;
use crate::metrics::Metrics;

/// Redirects followed per image, each one checked as the first URL was.
pub const MAX_REDIRECTS: usize = 3;
/// Default connect timeout per attempt (`--media-connect-timeout-secs`).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default limit on one image's whole fetch, redirects and body included
/// (`--media-fetch-timeout-secs`).
pub const DEFAULT_FETCH_TIMEOUT: Duration = Duration::from_secs(30);
/// Default byte budget of the URL cache (`--media-cache-bytes`).
pub const DEFAULT_CACHE_BYTES: usize = 256 * 1024 * 1024;
/// Default number of image fetches in flight at once, over all requests
/// (`--media-max-concurrent-fetches`).
pub const DEFAULT_MAX_CONCURRENT_FETCHES: usize = 64;
/// Longest a cached image is reused when its response names no shorter `max-age`.
pub const CACHE_TTL: Duration = Duration::from_secs(600);

/// What a request's image URLs may reach: the fetch flags, shared by `gateway` and `vlm serve`.
#[derive(Clone, Debug)]
pub struct MediaRules {
    /// Fetch `http(s)://` images at all (`--no-media-fetch` turns it off).
    pub fetch: bool,
    /// Hosts images may come from, lowercase, exact names; empty: any host.
    pub allowed_domains: Vec<String>,
    /// Let hosts resolve to loopback, private and other non-public addresses.
    pub allow_private_addresses: bool,
    /// `file://` URLs are read under this directory (as given, and resolved); `None`: refused.
    pub local_dir: Option<LocalDir>,
    pub connect_timeout: Duration,
    /// The whole fetch of one image: redirects, headers and body.
    pub fetch_timeout: Duration,
    /// Bytes of fetched images kept by URL; 0 turns the cache off.
    pub cache_bytes: usize,
    /// Fetches in flight at once over all requests; one more is refused at once (429).
    pub max_concurrent_fetches: usize,
}

impl Default for MediaRules {
    fn default() -> Self {
        Self {
            fetch: true,
            allowed_domains: Vec::new(),
            allow_private_addresses: false,
            local_dir: None,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            fetch_timeout: DEFAULT_FETCH_TIMEOUT,
            cache_bytes: DEFAULT_CACHE_BYTES,
            max_concurrent_fetches: DEFAULT_MAX_CONCURRENT_FETCHES,
        }
    }
}

/// The directory `file://` URLs are kept inside.
#[derive(Clone, Debug)]
pub struct LocalDir {
    /// As given (absolute), for the check before the filesystem is asked anything.
    pub given: PathBuf,
    /// With every symlink resolved, for the check of the file's own resolved path.
    pub resolved: PathBuf,
}

impl LocalDir {
    /// `dir`, which must exist and be a directory.
    pub fn new(dir: &Path) -> std::io::Result<Self> {
        let resolved = std::fs::canonicalize(dir)?;
        if !resolved.is_dir() {
            return Err(std::io::Error::other(format!(
                "{} is not a directory",
                dir.display()
            )));
        }
        let given = std::path::absolute(dir)?;
        Ok(Self { given, resolved })
    }
}

/// The fetch flags of `gateway` and `vlm serve`.
#[derive(clap::Args, Clone, Debug)]
pub struct MediaArgs {
    /// Refuse `http(s)://` image URLs: images come as data: URLs (or file:// under
    /// --allowed-local-media-path) only.
    #[arg(long, env = "VLM_NO_MEDIA_FETCH")]
    pub no_media_fetch: bool,
    /// Fetch images only from these hosts (exact names, comma-separated); default: any host
    /// whose addresses are public.
    #[arg(
        long,
        env = "VLM_ALLOWED_MEDIA_DOMAINS",
        value_delimiter = ',',
        value_name = "HOST"
    )]
    pub allowed_media_domains: Vec<String>,
    /// Let image URLs reach loopback, private, link-local and other non-public addresses
    /// (a closed network, or tests on loopback). Off by default: a URL whose host resolves to
    /// such an address is refused, checked on the address connected to.
    #[arg(long, env = "VLM_ALLOW_PRIVATE_MEDIA_ADDRESSES")]
    pub allow_private_media_addresses: bool,
    /// Accept `file://` image URLs for files under DIR (symlinks and `..` resolved first,
    /// and the file kept inside DIR); without it file:// URLs are refused.
    #[arg(long, env = "VLM_ALLOWED_LOCAL_MEDIA_PATH", value_name = "DIR")]
    pub allowed_local_media_path: Option<PathBuf>,
    /// Longest the connection to an image's host may take to open, in seconds.
    #[arg(long, env = "VLM_MEDIA_CONNECT_TIMEOUT_SECS", default_value_t = DEFAULT_CONNECT_TIMEOUT.as_secs_f64())]
    pub media_connect_timeout_secs: f64,
    /// Longest one image's whole fetch (redirects and body included) may take, in seconds.
    #[arg(long, env = "VLM_MEDIA_FETCH_TIMEOUT_SECS", default_value_t = DEFAULT_FETCH_TIMEOUT.as_secs_f64())]
    pub media_fetch_timeout_secs: f64,
    /// Bytes of fetched images kept by URL, so a chat that resends an image URL each turn
    /// does not fetch it again (responses with Cache-Control: no-store are not kept); 0: off.
    #[arg(long, env = "VLM_MEDIA_CACHE_BYTES", default_value_t = DEFAULT_CACHE_BYTES)]
    pub media_cache_bytes: usize,
    /// Image fetches in flight at once, over all requests (they run before a request takes
    /// one of --max-concurrent's places); one more gets RESOURCE_EXHAUSTED / 429 at once.
    #[arg(long, env = "VLM_MEDIA_MAX_CONCURRENT_FETCHES", default_value_t = DEFAULT_MAX_CONCURRENT_FETCHES)]
    pub media_max_concurrent_fetches: usize,
}

impl MediaArgs {
    /// The rules these flags set; the local directory must exist.
    pub fn rules(&self) -> anyhow::Result<MediaRules> {
        let secs = |v: f64, flag: &str| {
            Duration::try_from_secs_f64(v)
                .ok()
                .filter(|t| !t.is_zero())
                .ok_or_else(|| {
                    anyhow::anyhow!("{flag} must be a positive number of seconds, got {v}")
                })
        };
        let local_dir = match &self.allowed_local_media_path {
            None => None,
            Some(dir) => Some(LocalDir::new(dir).map_err(|e| {
                anyhow::anyhow!("--allowed-local-media-path {}: {e}", dir.display())
            })?),
        };
        Ok(MediaRules {
            fetch: !self.no_media_fetch,
            allowed_domains: self
                .allowed_media_domains
                .iter()
                .map(|d| d.trim().trim_end_matches('.').to_ascii_lowercase())
                .filter(|d| !d.is_empty())
                .collect(),
            allow_private_addresses: self.allow_private_media_addresses,
            local_dir,
            connect_timeout: secs(
                self.media_connect_timeout_secs,
                "--media-connect-timeout-secs",
            )?,
            fetch_timeout: secs(self.media_fetch_timeout_secs, "--media-fetch-timeout-secs")?,
            cache_bytes: self.media_cache_bytes,
            max_concurrent_fetches: self.media_max_concurrent_fetches,
        })
    }
}

/// Why an image URL was not read. Each variant's text is the reason a client sees, after the
/// part and host.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("fetching image URLs is off (--no-media-fetch); send the image as a data: URL")]
    Disabled,
    #[error("{0}")]
    BadUrl(String),
    #[error("the host is not in --allowed-media-domains")]
    DomainNotAllowed,
    #[error("refused address: the host resolves to {0}, which is not a public address (--allow-private-media-addresses lifts this)")]
    RefusedAddress(IpAddr),
    #[error("unreachable host: {0}")]
    Unreachable(String),
    #[error("the server answered HTTP {0}")]
    HttpStatus(u16),
    #[error("over the size limit: the image is over {limit} bytes (--max-image-bytes)")]
    TooLarge { limit: usize },
    #[error("not an image: {0}")]
    NotAnImage(String),
    #[error("too many redirects (at most {MAX_REDIRECTS} are followed)")]
    TooManyRedirects,
    #[error("timeout: no whole image within {0:?}")]
    Timeout(Duration),
    #[error("{0} image fetches are in flight, the most at once (--media-max-concurrent-fetches); retry later")]
    Busy(usize),
    #[error("refused file: {0}")]
    LocalRefused(String),
    #[error("cannot read the file: {0}")]
    LocalUnreadable(String),
}

impl FetchError {
    /// The metrics label of this outcome.
    pub fn outcome(&self) -> &'static str {
        match self {
            FetchError::Disabled => "disabled",
            FetchError::BadUrl(_) => "bad_url",
            FetchError::DomainNotAllowed => "domain_not_allowed",
            FetchError::RefusedAddress(_) => "refused_address",
            FetchError::Unreachable(_) => "unreachable",
            FetchError::HttpStatus(_) => "http_status",
            FetchError::TooLarge { .. } => "too_large",
            FetchError::NotAnImage(_) => "not_an_image",
            FetchError::TooManyRedirects => "too_many_redirects",
            FetchError::Timeout(_) => "timeout",
            FetchError::Busy(_) => "busy",
            FetchError::LocalRefused(_) => "file_refused",
            FetchError::LocalUnreadable(_) => "file_unreadable",
        }
    }
}

/// Whether `ip` is an address a fetch may reach by default: not loopback, private,
/// link-local, unique-local, CGNAT, unspecified, multicast, broadcast, reserved, or a
/// documentation or benchmarking range, nor an IPv6 form (mapped, NAT64, 6to4) of one.
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_public_v4(v4),
        IpAddr::V6(v6) => is_public_v6(v6),
    }
}

fn is_public_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    !(a == 0 // "this network", 0.0.0.0
        || a == 10
        || a == 127
        || (a == 100 && (64..128).contains(&b)) // CGNAT 100.64/10
        || (a == 169 && b == 254) // link-local
        || (a == 172 && (16..32).contains(&b))
        || (a == 192 && b == 0 && c == 0) // IETF protocol assignments
        || (a == 192 && b == 0 && c == 2) // TEST-NET-1
        || (a == 192 && b == 88 && c == 99) // 6to4 relay anycast
        || (a == 192 && b == 168)
        || (a == 198 && (18..20).contains(&b)) // benchmarking 198.18/15
        || (a == 198 && b == 51 && c == 100) // TEST-NET-2
        || (a == 203 && b == 0 && c == 113) // TEST-NET-3
        || a >= 224) // multicast 224/4, reserved 240/4, broadcast
}

fn is_public_v6(ip: Ipv6Addr) -> bool {
    let s = ip.segments();
    let embedded_v4 = |hi: u16, lo: u16| Ipv4Addr::from(((hi as u32) << 16) | lo as u32);
    if let Some(v4) = ip.to_ipv4_mapped() {
        return is_public_v4(v4);
    }
    // NAT64 (64:ff9b::/96) reaches the IPv4 address it embeds.
    if s[0] == 0x64 && s[1] == 0xff9b && s[2..6] == [0; 4] {
        return is_public_v4(embedded_v4(s[6], s[7]));
    }
    // 6to4 (2002::/16) embeds its IPv4 relay in bits 16..48.
    if s[0] == 0x2002 {
        return is_public_v4(embedded_v4(s[1], s[2]));
    }
    !(ip.is_unspecified()
        || ip.is_loopback()
        || s[0..6] == [0; 6] // IPv4-compatible ::a.b.c.d (deprecated) and ::/96
        || (s[0] & 0xfe00) == 0xfc00 // unique local fc00::/7
        || (s[0] & 0xffc0) == 0xfe80 // link-local fe80::/10
        || (s[0] & 0xffc0) == 0xfec0 // site-local fec0::/10 (deprecated)
        || (s[0] & 0xff00) == 0xff00 // multicast
        || (s[0] == 0x2001 && s[1] == 0x0db8) // documentation 2001:db8::/32
        || (s[0] == 0x3fff && s[1] < 0x1000) // documentation 3fff::/20
        || (s[0] == 0x2001 && s[1] == 0x0002 && s[2] == 0) // benchmarking 2001:2::/48
        || (s[0] == 0x2001 && s[1] == 0) // Teredo 2001::/32 (tunnels to any IPv4)
        || (s[0] == 0x0100 && s[1..4] == [0; 3])) // discard-only 100::/64
}

/// A DNS resolver that hands the HTTP client only public addresses, so every connection it
/// opens, first or after a redirect, reaches an address that passed [`is_public`].
struct PublicOnly;

/// A host that resolves to non-public addresses only; found again in the client's error.
#[derive(Debug, thiserror::Error)]
#[error("{0} is not a public address")]
struct RefusedAddress(IpAddr);

impl reqwest::dns::Resolve for PublicOnly {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let host = name.as_str().to_string();
        Box::pin(async move {
            let all: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let (public, refused): (Vec<_>, Vec<_>) =
                all.into_iter().partition(|a| is_public(a.ip()));
            if public.is_empty() {
                let err: Box<dyn std::error::Error + Send + Sync> = match refused.first() {
                    Some(a) => Box::new(RefusedAddress(a.ip())),
                    None => format!("{host} has no address").into(),
                };
                return Err(err);
            }
            Ok(Box::new(public.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// An image URL of a request, waiting to be fetched into its placeholder part.
#[derive(Clone, Debug)]
pub struct PendingImage {
    pub message: usize,
    pub part: usize,
    pub url: String,
    /// Where the request holds it, for messages: `messages[1].content[0]`.
    pub at: String,
}

/// Whether `url` is one the gateway reads itself (not a `data:` URL): http, https or file.
pub fn is_fetched(url: &str) -> bool {
    let scheme = url.split(':').next().unwrap_or_default();
    ["http", "https", "file"]
        .iter()
        .any(|s| scheme.eq_ignore_ascii_case(s))
}

struct CachedImage {
    bytes: Arc<Vec<u8>>,
    expires: Instant,
}

/// Fetched images by URL, least recently used dropped first, within a byte budget.
struct UrlCache {
    budget: usize,
    used: usize,
    entries: lru::LruCache<String, CachedImage>,
}

impl UrlCache {
    fn get(&mut self, url: &str) -> Option<Arc<Vec<u8>>> {
        let fresh = self.entries.get(url)?.expires > Instant::now();
        if !fresh {
            if let Some(old) = self.entries.pop(url) {
                self.used -= old.bytes.len();
            }
            return None;
        }
        self.entries.get(url).map(|e| e.bytes.clone())
    }

    fn put(&mut self, url: String, bytes: Arc<Vec<u8>>, ttl: Duration) {
        if bytes.len() > self.budget {
            return;
        }
        if let Some(old) = self.entries.pop(&url) {
            self.used -= old.bytes.len();
        }
        while self.used + bytes.len() > self.budget {
            match self.entries.pop_lru() {
                Some((_, old)) => self.used -= old.bytes.len(),
                None => break,
            }
        }
        self.used += bytes.len();
        let expires = Instant::now() + ttl;
        self.entries.put(url, CachedImage { bytes, expires });
    }
}

/// How long a response may be cached: `None` for `no-store`, `no-cache` or `max-age=0`.
fn cache_ttl(headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    let mut ttl = CACHE_TTL;
    for value in headers.get_all(CACHE_CONTROL) {
        let Ok(value) = value.to_str() else { continue };
        for directive in value.split(',') {
            let d = directive.trim().to_ascii_lowercase();
            if d == "no-store" || d == "no-cache" {
                return None;
            }
            if let Some(secs) = d.strip_prefix("max-age=") {
                match secs.trim_matches('"').parse::<u64>() {
                    Ok(0) => return None,
                    Ok(s) => ttl = ttl.min(Duration::from_secs(s)),
                    Err(_) => return None,
                }
            }
        }
    }
    Some(ttl)
}

/// The gateway's reader of image URLs: the rules, an HTTP client built on first use, the cache.
pub struct MediaFetcher {
    pub rules: MediaRules,
    client: OnceLock<reqwest::Client>,
    cache: Mutex<UrlCache>,
    /// One per fetch in flight ([`MediaRules::max_concurrent_fetches`]).
    permits: Arc<tokio::sync::Semaphore>,
    metrics: Metrics,
}

impl MediaFetcher {
    pub fn new(rules: MediaRules, metrics: Metrics) -> Self {
        let cache = Mutex::new(UrlCache {
            budget: rules.cache_bytes,
            used: 0,
            entries: lru::LruCache::unbounded(),
        });
        Self {
            permits: Arc::new(tokio::sync::Semaphore::new(rules.max_concurrent_fetches)),
            rules,
            client: OnceLock::new(),
            cache,
            metrics,
        }
    }

    fn client(&self) -> Result<&reqwest::Client, FetchError> {
        if let Some(c) = self.client.get() {
            return Ok(c);
        }
        let mut builder = reqwest::Client::builder()
            // Redirects are followed by hand, each target checked ([`MAX_REDIRECTS`]).
            .redirect(reqwest::redirect::Policy::none())
            // A proxy would connect for us, past the address check.
            .no_proxy()
            .connect_timeout(self.rules.connect_timeout)
            .timeout(self.rules.fetch_timeout)
            .user_agent(concat!("vlm-gateway/", env!("CARGO_PKG_VERSION")));
        if !self.rules.allow_private_addresses {
            builder = builder.dns_resolver(Arc::new(PublicOnly));
        }
        let client = builder
            .build()
            .map_err(|e| FetchError::Unreachable(format!("cannot start the HTTP client: {e}")))?;
        Ok(self.client.get_or_init(|| client))
    }

    /// Reads every pending image of a request into its placeholder part, concurrently; the
    /// first failure answers for the request.
    pub async fn resolve(
        &self,
        messages: &mut [Message],
        pending: Vec<PendingImage>,
        max_bytes: usize,
    ) -> Result<(), GatewayError> {
        if pending.is_empty() {
            return Ok(());
        }
        let fetched = futures::future::try_join_all(
            pending.iter().map(|p| self.image(&p.url, &p.at, max_bytes)),
        )
        .await?;
        for (p, bytes) in pending.iter().zip(fetched) {
            if let Some(part) = messages
                .get_mut(p.message)
                .and_then(|m| m.parts.get_mut(p.part))
            {
                *part = Part::Image(bytes);
            }
        }
        Ok(())
    }

    /// One image URL's bytes, at most `max_bytes`, or a 400 naming `at` and the reason.
    pub async fn image(
        &self,
        url: &str,
        at: &str,
        max_bytes: usize,
    ) -> Result<Vec<u8>, GatewayError> {
        let parsed = Url::parse(url);
        // The host only: a URL's path and query may carry credentials.
        let host = match &parsed {
            Ok(u) if u.scheme() == "file" => "file".to_string(),
            Ok(u) => u.host_str().unwrap_or_default().to_string(),
            Err(_) => String::new(),
        };
        let span = info_span!(
            "fetch_image",
            host = %host,
            bytes = Empty,
            ms = Empty,
            outcome = Empty,
        );
        let started = Instant::now();
        let result = async {
            let target = check_url(url, &self.rules)?;
            let fetch = self.fetch(target, max_bytes);
            match tokio::time::timeout(self.rules.fetch_timeout, fetch).await {
                Ok(r) => r,
                Err(_) => Err(FetchError::Timeout(self.rules.fetch_timeout)),
            }
        }
        .instrument(span.clone())
        .await;
        span.record("ms", started.elapsed().as_millis() as u64);
        match result {
            Ok((bytes, outcome)) => {
                span.record("bytes", bytes.len());
                span.record("outcome", outcome);
                self.metrics
                    .media_fetches
                    .with_label_values(&[outcome])
                    .inc();
                if outcome == "ok" {
                    self.metrics.media_fetch_bytes.inc_by(bytes.len() as u64);
                }
                Ok(bytes.as_ref().clone())
            }
            Err(e) => {
                span.record("outcome", e.outcome());
                self.metrics
                    .media_fetches
                    .with_label_values(&[e.outcome()])
                    .inc();
                tracing::info!(parent: &span, host = %host, reason = %e, "image URL refused");
                let from = if host.is_empty() || host == "file" {
                    String::new()
                } else {
                    format!(" from {host}")
                };
                let message = format!("{at}: cannot fetch the image{from}: {e}");
                Err(match e {
                    FetchError::Busy(_) => GatewayError::Overloaded(message),
                    _ => GatewayError::Invalid(message),
                })
            }
        }
    }

    /// The bytes and the outcome label ("ok", "cached", "file").
    async fn fetch(
        &self,
        target: UrlTarget,
        max_bytes: usize,
    ) -> Result<(Arc<Vec<u8>>, &'static str), FetchError> {
        let url = match target {
            UrlTarget::File(path) => {
                let dir = self.rules.local_dir.clone();
                let bytes = tokio::task::spawn_blocking(move || {
                    dir.as_ref().map_or(Err(no_local_dir()), |dir| {
                        read_inside(&path, dir, max_bytes)
                    })
                })
                .await
                .map_err(|e| FetchError::LocalUnreadable(e.to_string()))??;
                check_image(&bytes)?;
                return Ok((Arc::new(bytes), "file"));
            }
            UrlTarget::Http(url) => url,
        };
        let key = url.as_str().to_string();
        let cached = self.cache.lock().map(|mut c| c.get(&key)).ok().flatten();
        if let Some(bytes) = cached {
            if bytes.len() <= max_bytes {
                return Ok((bytes, "cached"));
            }
        }
        let _permit = self
            .permits
            .clone()
            .try_acquire_owned()
            .map_err(|_| FetchError::Busy(self.rules.max_concurrent_fetches))?;
        let (bytes, ttl) = self.fetch_http(url, max_bytes).await?;
        check_image(&bytes)?;
        let bytes = Arc::new(bytes);
        if let (Some(ttl), Ok(mut cache)) = (ttl, self.cache.lock()) {
            cache.put(key, bytes.clone(), ttl);
        }
        Ok((bytes, "ok"))
    }

    /// GETs `url`, following at most [`MAX_REDIRECTS`] checked redirects; the body (never
    /// more than `max_bytes` of it read) and how long it may be cached.
    async fn fetch_http(
        &self,
        mut url: Url,
        max_bytes: usize,
    ) -> Result<(Vec<u8>, Option<Duration>), FetchError> {
        let client = self.client()?;
        let mut redirects = 0;
        loop {
            check_target(&url, &self.rules)?;
            let mut resp = client
                .get(url.clone())
                .send()
                .await
                .map_err(|e| self.client_error(&e))?;
            let status = resp.status();
            if matches!(status.as_u16(), 301 | 302 | 303 | 307 | 308) {
                if redirects == MAX_REDIRECTS {
                    return Err(FetchError::TooManyRedirects);
                }
                redirects += 1;
                let location = resp
                    .headers()
                    .get(LOCATION)
                    .and_then(|l| l.to_str().ok())
                    .ok_or(FetchError::HttpStatus(status.as_u16()))?;
                url = url.join(location).map_err(|e| {
                    FetchError::BadUrl(format!("the redirect's Location is not a URL: {e}"))
                })?;
                continue;
            }
            if !status.is_success() {
                return Err(FetchError::HttpStatus(status.as_u16()));
            }
            let too_large = FetchError::TooLarge { limit: max_bytes };
            if resp.content_length().is_some_and(|n| n > max_bytes as u64) {
                return Err(too_large);
            }
            let ttl = cache_ttl(resp.headers());
            let mut body = Vec::new();
            while let Some(chunk) = resp.chunk().await.map_err(|e| self.client_error(&e))? {
                if body.len() + chunk.len() > max_bytes {
                    // Dropping the response closes the connection: nothing more is read.
                    return Err(too_large);
                }
                body.extend_from_slice(&chunk);
            }
            return Ok((body, ttl));
        }
    }

    /// A client error as the reason the client sees.
    fn client_error(&self, e: &reqwest::Error) -> FetchError {
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
        let mut root = e.to_string();
        while let Some(s) = source {
            if let Some(r) = s.downcast_ref::<RefusedAddress>() {
                return FetchError::RefusedAddress(r.0);
            }
            root = s.to_string();
            source = s.source();
        }
        if e.is_timeout() {
            return FetchError::Timeout(self.rules.fetch_timeout);
        }
        FetchError::Unreachable(root)
    }
}

/// The checks a URL gets before any connection, first or redirected: http(s), a host on
/// the allowlist, and an IP-literal host that is public (names are checked as resolved).
fn check_target(url: &Url, rules: &MediaRules) -> Result<(), FetchError> {
    if !matches!(url.scheme(), "http" | "https") {
        return Err(FetchError::BadUrl(format!(
            "only http, https (and file, under --allowed-local-media-path) URLs are fetched, got {}:",
            url.scheme()
        )));
    }
    let Some(host) = url.host_str().filter(|h| !h.is_empty()) else {
        return Err(FetchError::BadUrl("the URL has no host".into()));
    };
    if !rules.allowed_domains.is_empty() {
        let name = host.to_ascii_lowercase();
        let name = name.trim_end_matches('.');
        if !rules.allowed_domains.iter().any(|d| d == name) {
            return Err(FetchError::DomainNotAllowed);
        }
    }
    if !rules.allow_private_addresses {
        // An IP-literal host is connected to as written, without the resolver.
        let literal = host.trim_start_matches('[').trim_end_matches(']');
        if let Some(ip) = literal.parse::<IpAddr>().ok().filter(|ip| !is_public(*ip)) {
            return Err(FetchError::RefusedAddress(ip));
        }
    }
    Ok(())
}

/// Where an image URL leads, once it has passed every check that needs neither the network
/// nor the filesystem ([`check_url`]).
#[derive(Debug)]
pub enum UrlTarget {
    /// An http(s) URL to fetch (its host's addresses are checked as it is resolved).
    Http(Url),
    /// A file under `--allowed-local-media-path` (its symlinks are checked as it is read).
    File(PathBuf),
}

/// Reads an image URL by `rules`: http or https with a host (on the allowlist, an IP literal
/// only if public), or file under the allowed directory; nothing is resolved or opened.
pub fn check_url(url: &str, rules: &MediaRules) -> Result<UrlTarget, FetchError> {
    let url = Url::parse(url).map_err(|e| FetchError::BadUrl(format!("not a valid URL: {e}")))?;
    if url.scheme() == "file" {
        return local_path(&url, rules).map(UrlTarget::File);
    }
    if !rules.fetch && matches!(url.scheme(), "http" | "https") {
        return Err(FetchError::Disabled);
    }
    check_target(&url, rules)?;
    Ok(UrlTarget::Http(url))
}

fn no_local_dir() -> FetchError {
    FetchError::LocalRefused(
        "file: URLs are refused; --allowed-local-media-path DIR allows those under DIR".into(),
    )
}

/// A `file://` URL's path, if it lies under the allowed directory as written (the URL parser
/// has already taken out `.` and `..`), so nothing is learned of files outside.
fn local_path(url: &Url, rules: &MediaRules) -> Result<PathBuf, FetchError> {
    let dir = rules.local_dir.as_ref().ok_or_else(no_local_dir)?;
    if url
        .host_str()
        .is_some_and(|h| !h.is_empty() && h != "localhost")
    {
        return Err(FetchError::LocalRefused(
            "a file: URL may not name a host".into(),
        ));
    }
    let path = url
        .to_file_path()
        .map_err(|_| FetchError::BadUrl("not a file path".into()))?;
    let inside = |d: &Path| {
        path.starts_with(d)
            && !path
                .components()
                .any(|c| matches!(c, std::path::Component::ParentDir))
    };
    if !inside(&dir.given) && !inside(&dir.resolved) {
        return Err(FetchError::LocalRefused(
            "the path is outside --allowed-local-media-path".into(),
        ));
    }
    Ok(path)
}

/// Reads `path` if it, and what it resolves to, lie inside `dir`; at most `max_bytes`.
fn read_inside(path: &Path, dir: &LocalDir, max_bytes: usize) -> Result<Vec<u8>, FetchError> {
    use std::io::Read;
    let outside =
        || FetchError::LocalRefused("the path is outside --allowed-local-media-path".to_string());
    // The URL parser has already taken out `.` and `..`; the path must start inside before
    // the filesystem is asked anything, so nothing is learned of files outside.
    if !path.starts_with(&dir.given) && !path.starts_with(&dir.resolved) {
        return Err(outside());
    }
    let real =
        std::fs::canonicalize(path).map_err(|e| FetchError::LocalUnreadable(e.to_string()))?;
    // A symlink inside may lead outside: the resolved path must stay inside too.
    if !real.starts_with(&dir.resolved) {
        return Err(outside());
    }
    let file =
        std::fs::File::open(&real).map_err(|e| FetchError::LocalUnreadable(e.to_string()))?;
    let meta = file
        .metadata()
        .map_err(|e| FetchError::LocalUnreadable(e.to_string()))?;
    if !meta.is_file() {
        return Err(FetchError::LocalUnreadable("not a regular file".into()));
    }
    if meta.len() > max_bytes as u64 {
        return Err(FetchError::TooLarge { limit: max_bytes });
    }
    let mut bytes = Vec::new();
    file.take(max_bytes as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| FetchError::LocalUnreadable(e.to_string()))?;
    if bytes.len() > max_bytes {
        return Err(FetchError::TooLarge { limit: max_bytes });
    }
    Ok(bytes)
}

/// Refuses a body that is not an image of a format we decode, by its header (the dimension
/// and pixel limits stay with the image rule the vision service applies).
fn check_image(bytes: &[u8]) -> Result<(), FetchError> {
    use vlm_proto::image::{check_header, DecodeLimits, Error};
    match check_header(bytes, &DecodeLimits::default()) {
        Err(Error::BadImage(m)) => Err(FetchError::NotAnImage(m)),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests;
