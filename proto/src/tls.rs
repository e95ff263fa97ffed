//! TLS for every hop, with rustls and the ring provider.
//!
//! - [`ServerIdentity`]: a certificate chain and its key from PEM files, checked at start-up
//!   (each error names the file), for a tonic server ([`ServerIdentity::grpc_config`]) or the
//!   gateway's HTTPS port ([`ServerIdentity::rustls_config`]).
//! - [`ServiceTlsArgs`]: the flags of vision-svc and llm-svc: TLS on their gRPC port, and with
//!   `--tls-client-ca`, mutual TLS (only clients with a certificate signed by that CA get in).
//! - [`client_config`]: the gateway's side of the hop to those services.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// Longest a client may take over its TLS handshake before the connection is dropped, so
/// connections that never finish one cannot pile up.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The PEM text of `path`, with the certificates in it (at least one).
fn read_certs(path: &Path, what: &str) -> anyhow::Result<(Vec<u8>, Vec<CertificateDer<'static>>)> {
    let pem = std::fs::read(path)
        .with_context(|| format!("cannot read the {what} {}", path.display()))?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("the {what} {} is not valid PEM", path.display()))?;
    anyhow::ensure!(
        !certs.is_empty(),
        "the {what} {} holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
        path.display()
    );
    Ok((pem, certs))
}

/// The PEM text of `path`, with the private key in it.
fn read_key(path: &Path) -> anyhow::Result<(Vec<u8>, PrivateKeyDer<'static>)> {
    let pem = std::fs::read(path)
        .with_context(|| format!("cannot read the TLS key {}", path.display()))?;
    let key = PrivateKeyDer::from_pem_slice(&pem).map_err(|e| {
        anyhow::anyhow!(
            "the TLS key {} holds no usable private key (PEM PKCS#8, PKCS#1 or SEC1): {e}",
            path.display()
        )
    })?;
    Ok((pem, key))
}

/// A server's certificate chain and private key, read and checked: both parse, the key is
/// one rustls can sign with, and it belongs to the certificate.
#[derive(Clone)]
pub struct ServerIdentity {
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    rustls: Arc<rustls::ServerConfig>,
}

impl std::fmt::Debug for ServerIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("ServerIdentity").finish_non_exhaustive()
    }
}

impl ServerIdentity {
    /// Reads `cert` (PEM, the leaf first, then any intermediates) and `key` (PEM).
    pub fn load(cert: &Path, key: &Path) -> anyhow::Result<Self> {
        let (cert_pem, certs) = read_certs(cert, "TLS certificate")?;
        let (key_pem, key_der) = read_key(key)?;
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .context("rustls has no protocol version to offer")?
            .with_no_client_auth()
            .with_single_cert(certs, key_der)
            .map_err(|e| {
                anyhow::anyhow!(
                    "the TLS key {} does not go with the certificate {}: {e}",
                    key.display(),
                    cert.display()
                )
            })?;
        // HTTP/2 for gRPC-style clients, HTTP/1.1 for the rest (curl, OpenAI clients).
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Self {
            cert_pem,
            key_pem,
            rustls: Arc::new(config),
        })
    }

    /// rustls's server configuration (no client certificates; ALPN h2 and http/1.1), for an
    /// HTTPS listener.
    pub fn rustls_config(&self) -> Arc<rustls::ServerConfig> {
        self.rustls.clone()
    }

    /// tonic's server configuration; with `client_ca`, every client must present a
    /// certificate signed by it (mutual TLS).
    pub fn grpc_config(&self, client_ca: Option<&ClientCa>) -> ServerTlsConfig {
        let mut config = ServerTlsConfig::new()
            .identity(Identity::from_pem(&self.cert_pem, &self.key_pem))
            .timeout(HANDSHAKE_TIMEOUT);
        if let Some(ca) = client_ca {
            config = config.client_ca_root(Certificate::from_pem(&ca.0));
        }
        config
    }
}

/// The CA whose signature a client certificate must carry, read and checked.
#[derive(Clone, Debug)]
pub struct ClientCa(Vec<u8>);

impl ClientCa {
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let (pem, certs) = read_certs(path, "client CA certificate")?;
        // Every certificate in it must be usable as a trust anchor.
        let mut roots = rustls::RootCertStore::empty();
        for c in certs {
            roots.add(c).with_context(|| {
                format!("the client CA certificate {} is not usable", path.display())
            })?;
        }
        Ok(Self(pem))
    }
}

/// What a model service's gRPC port speaks: plaintext (the default, on loopback), TLS, or
/// mutual TLS.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct ServiceTlsArgs {
    /// Serve gRPC over TLS with this certificate (PEM; the leaf first, then any intermediates).
    #[arg(long, env = "VLM_TLS_CERT", value_name = "PEM", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "VLM_TLS_KEY", value_name = "PEM", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Mutual TLS: refuse every client whose certificate is not signed by this CA (PEM); the
    /// gateway presents one with --upstream-tls-cert. Needs --tls-cert.
    #[arg(
        long,
        env = "VLM_TLS_CLIENT_CA",
        value_name = "PEM",
        requires = "tls_cert"
    )]
    pub tls_client_ca: Option<PathBuf>,
}

impl ServiceTlsArgs {
    /// tonic's TLS configuration these flags ask for (`None`: plaintext), every file read
    /// and checked now, so a bad one stops the start with its name.
    pub fn server_config(&self) -> anyhow::Result<Option<ServerTlsConfig>> {
        let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) else {
            return Ok(None);
        };
        let identity = ServerIdentity::load(cert, key)?;
        let ca = self
            .tls_client_ca
            .as_deref()
            .map(ClientCa::load)
            .transpose()?;
        Ok(Some(identity.grpc_config(ca.as_ref())))
    }
}

/// The client side of TLS to a model service: trust `ca` (PEM) for the server's certificate,
/// and present `identity` (certificate and key PEM files) when the service asks for one
/// (mutual TLS). Files are read and checked now.
pub fn client_config(
    ca: &Path,
    identity: Option<(&Path, &Path)>,
) -> anyhow::Result<ClientTlsConfig> {
    let (ca_pem, _) = read_certs(ca, "upstream CA certificate")?;
    let mut config = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca_pem));
    if let Some((cert, key)) = identity {
        // Parsed and matched like a server's, for the same clear errors.
        let id = ServerIdentity::load(cert, key)?;
        config = config.identity(Identity::from_pem(id.cert_pem, id.key_pem));
    }
    Ok(config)
}
