//! Who may use the gateway: an optional API key on the public APIs, and the flags that set it
//! and TLS on the public ports.
//!
//! With a key set, `POST /v1/chat/completions`, `GET /v1/models` and `vlm.v1.Gateway` need
//! `Authorization: Bearer <key>` (HTTP header or gRPC metadata); others get 401 /
//! UNAUTHENTICATED before their request body is read. `/health`, `/metrics`, `grpc.health.v1`
//! and reflection stay open: probes and scrapers carry no key, and reflection only describes
//! the API. The key is compared in constant time and is never logged or put in an error.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use subtle::ConstantTimeEq;

/// The key clients must present. Its `Debug` never shows it.
#[derive(Clone)]
pub struct ApiKey(Arc<[u8]>);

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No `Authorization` header / metadata at all.
    Missing,
    /// Present, but not `Bearer <token>`.
    Malformed,
    /// A bearer token that is not the key.
    Wrong,
}

impl Refusal {
    /// What the client is told (never the key, nor what it sent).
    pub fn message(self) -> &'static str {
        match self {
            Refusal::Missing => {
                "no API key: send it as `Authorization: Bearer <key>` (gRPC: `authorization` metadata)"
            }
            Refusal::Malformed => {
                "the Authorization header must be `Bearer <key>` (gRPC: `authorization` metadata)"
            }
            Refusal::Wrong => "invalid API key",
        }
    }
}

impl ApiKey {
    /// A key from its text; surrounding whitespace (a file's trailing newline) is dropped.
    /// `from` says where it came from, for the error.
    pub fn new(text: &str, from: &str) -> anyhow::Result<Self> {
        let key = text.trim();
        anyhow::ensure!(!key.is_empty(), "the API key from {from} is empty");
        // It travels in a header: visible ASCII only, no spaces.
        anyhow::ensure!(
            key.bytes().all(|b| b.is_ascii_graphic()),
            "the API key from {from} must be printable ASCII without spaces"
        );
        Ok(Self(key.as_bytes().into()))
    }

    /// A key read from `path` (its whole content, trimmed).
    pub fn from_file(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the API key file {}", path.display()))?;
        Self::new(&text, &path.display().to_string())
    }

    /// Checks an `Authorization` value (`Bearer <key>`; the scheme is case-insensitive, as
    /// RFC 7235 has it). The token is compared in constant time: how long the comparison
    /// takes says nothing about how much of it matched (only whether the lengths differ).
    pub fn check(&self, authorization: Option<&[u8]>) -> Result<(), Refusal> {
        let value = authorization.ok_or(Refusal::Missing)?;
        let (scheme, token) = match value.iter().position(|&b| b == b' ') {
            Some(i) => (&value[..i], &value[i + 1..]),
            None => return Err(Refusal::Malformed),
        };
        if !scheme.eq_ignore_ascii_case(b"bearer") {
            return Err(Refusal::Malformed);
        }
        let token = token.trim_ascii();
        if bool::from(token.ct_eq(&self.0)) {
            Ok(())
        } else {
            Err(Refusal::Wrong)
        }
    }
}

/// axum middleware: lets a request through only with the key. The 401 carries OpenAI's error
/// shape (`invalid_api_key`, as OpenAI answers a bad key) and `WWW-Authenticate: Bearer`.
pub async fn require_key(State(key): State<ApiKey>, request: Request, next: Next) -> Response {
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(HeaderValue::as_bytes);
    match key.check(given) {
        Ok(()) => next.run(request).await,
        Err(refusal) => {
            let body = json!({"error": {
                "message": refusal.message(),
                "type": "invalid_request_error",
                "param": null,
                "code": "invalid_api_key",
            }});
            let challenge = match refusal {
                Refusal::Missing => "Bearer",
                Refusal::Malformed => "Bearer error=\"invalid_request\"",
                Refusal::Wrong => "Bearer error=\"invalid_token\"",
            };
            let mut response = (StatusCode::UNAUTHORIZED, Json(body)).into_response();
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static(challenge),
            );
            response
        }
    }
}

/// A tonic interceptor for `vlm.v1.Gateway`: UNAUTHENTICATED without the key; everything
/// passes when no key is set.
#[derive(Clone)]
pub struct GrpcAuth(pub Option<ApiKey>);

impl tonic::service::Interceptor for GrpcAuth {
    fn call(&mut self, request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let Some(key) = &self.0 else {
            return Ok(request);
        };
        let given = request
            .metadata()
            .get("authorization")
            .map(|v| v.as_bytes());
        match key.check(given) {
            Ok(()) => Ok(request),
            Err(refusal) => Err(tonic::Status::unauthenticated(refusal.message())),
        }
    }
}

/// The public ports' access flags, shared by `gateway` and `vlm serve`.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct AccessArgs {
    /// Require this API key (`Authorization: Bearer <key>`) on /v1/* and vlm.v1.Gateway;
    /// /health, /metrics, grpc.health.v1 and reflection stay open. Prefer the environment
    /// variable or --api-key-file: a command line is visible to every user of the machine.
    #[arg(
        long,
        env = "VLM_API_KEY",
        hide_env_values = true,
        value_name = "KEY",
        conflicts_with = "api_key_file"
    )]
    pub api_key: Option<String>,
    /// Like --api-key, the key read from this file (surrounding whitespace dropped).
    #[arg(long, env = "VLM_API_KEY_FILE", value_name = "PATH")]
    pub api_key_file: Option<PathBuf>,
    /// Serve HTTPS and gRPC over TLS on the public ports with this certificate (PEM; the leaf
    /// first, then any intermediates).
    #[arg(long, env = "VLM_TLS_CERT", value_name = "PEM", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "VLM_TLS_KEY", value_name = "PEM", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

impl AccessArgs {
    /// The key these flags set, if any (the file read now).
    pub fn api_key(&self) -> anyhow::Result<Option<ApiKey>> {
        match (&self.api_key, &self.api_key_file) {
            (Some(k), _) => ApiKey::new(k, "--api-key / VLM_API_KEY").map(Some),
            (None, Some(path)) => ApiKey::from_file(path).map(Some),
            (None, None) => Ok(None),
        }
    }

    /// The public ports' certificate and key, if given (read and checked now).
    pub fn tls(&self) -> anyhow::Result<Option<vlm_proto::tls::ServerIdentity>> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => vlm_proto::tls::ServerIdentity::load(cert, key).map(Some),
            _ => Ok(None),
        }
    }
}

/// The gateway's side of TLS to vision-svc and llm-svc.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct UpstreamTlsArgs {
    /// Talk TLS to vision-svc and llm-svc, trusting this CA (PEM) for their certificates,
    /// which must name the hosts of --vision-addr and --llm-addr. Addresses without a scheme
    /// then mean https://.
    #[arg(long, env = "VLM_UPSTREAM_TLS_CA", value_name = "PEM")]
    pub upstream_tls_ca: Option<PathBuf>,
    /// Mutual TLS: present this client certificate (PEM) to the services (their
    /// --tls-client-ca must have signed it). Needs --upstream-tls-ca.
    #[arg(
        long,
        env = "VLM_UPSTREAM_TLS_CERT",
        value_name = "PEM",
        requires_all = ["upstream_tls_key", "upstream_tls_ca"]
    )]
    pub upstream_tls_cert: Option<PathBuf>,
    /// The private key of --upstream-tls-cert (PEM).
    #[arg(
        long,
        env = "VLM_UPSTREAM_TLS_KEY",
        value_name = "PEM",
        requires = "upstream_tls_cert"
    )]
    pub upstream_tls_key: Option<PathBuf>,
}

impl UpstreamTlsArgs {
    /// tonic's client TLS configuration these flags ask for (`None`: plaintext).
    pub fn client_config(&self) -> anyhow::Result<Option<tonic::transport::ClientTlsConfig>> {
        let Some(ca) = &self.upstream_tls_ca else {
            return Ok(None);
        };
        let identity = match (&self.upstream_tls_cert, &self.upstream_tls_key) {
            (Some(c), Some(k)) => Some((c.as_path(), k.as_path())),
            _ => None,
        };
        vlm_proto::tls::client_config(ca, identity).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_bearer_key_passes() {
        let key = ApiKey::new("s3cret-key\n", "test").unwrap();
        assert_eq!(key.check(Some(b"Bearer s3cret-key")), Ok(()));
        assert_eq!(key.check(Some(b"bearer s3cret-key")), Ok(()));
        assert_eq!(key.check(None), Err(Refusal::Missing));
        assert_eq!(key.check(Some(b"s3cret-key")), Err(Refusal::Malformed));
        assert_eq!(
            key.check(Some(b"Basic s3cret-key")),
            Err(Refusal::Malformed)
        );
        assert_eq!(key.check(Some(b"Bearer s3cret-ke")), Err(Refusal::Wrong));
        assert_eq!(key.check(Some(b"Bearer s3cret-key2")), Err(Refusal::Wrong));
        assert_eq!(key.check(Some(b"Bearer ")), Err(Refusal::Wrong));
        assert!(!format!("{key:?}").contains("s3cret"));
    }

    #[test]
    fn empty_or_unprintable_keys_are_refused_at_start() {
        assert!(ApiKey::new("  \n", "VLM_API_KEY")
            .unwrap_err()
            .to_string()
            .contains("VLM_API_KEY is empty"));
        assert!(ApiKey::new("a b", "x").is_err());
        assert!(ApiKey::new("k\u{e9}y", "x").is_err());
    }
}
