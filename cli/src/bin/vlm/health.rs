//! `vlm health`: asks a service's `grpc.health.v1` whether it is SERVING (exit 0) or not
//! (exit 1); what the containers' health checks call. With `--tls-ca` (and for mutual TLS
//! `--tls-cert`/`--tls-key`) it asks a service that serves TLS.

use std::path::PathBuf;

use anyhow::{bail, Context};

#[derive(clap::Args)]
pub struct HealthArgs {
    /// host:port of the service's gRPC port.
    #[arg(long, default_value = "127.0.0.1:50050")]
    addr: String,
    /// Service to ask about ("" is the server as a whole).
    #[arg(long, default_value = "")]
    service: String,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 3)]
    timeout_secs: u64,
    /// Ask over TLS, trusting this CA (PEM) for the service's certificate.
    #[arg(long, value_name = "PEM")]
    tls_ca: Option<PathBuf>,
    /// The name the service's certificate must carry, when it is not --addr's host (a
    /// container asking itself at 127.0.0.1 with a certificate for its service name).
    #[arg(long, value_name = "NAME", requires = "tls_ca")]
    tls_domain: Option<String>,
    /// Present this client certificate (PEM), for a service that requires mutual TLS.
    #[arg(long, value_name = "PEM", requires_all = ["tls_key", "tls_ca"])]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "PEM", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

pub async fn health(args: HealthArgs) -> anyhow::Result<()> {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    let tls = match &args.tls_ca {
        Some(ca) => {
            let identity = args.tls_cert.as_deref().zip(args.tls_key.as_deref());
            let mut tls = vlm_proto::tls::client_config(ca, identity)?;
            if let Some(name) = &args.tls_domain {
                tls = tls.domain_name(name.clone());
            }
            Some(tls)
        }
        None => None,
    };
    let check = async {
        let ch = gateway::upstream::upstream_endpoint(&args.addr, tls.as_ref())?
            .connect()
            .await
            .with_context(|| format!("cannot connect to {}", args.addr))?;
        let r = HealthClient::new(ch)
            .check(HealthCheckRequest {
                service: args.service.clone(),
            })
            .await?;
        anyhow::Ok(r.into_inner().status)
    };
    let status = tokio::time::timeout(std::time::Duration::from_secs(args.timeout_secs), check)
        .await
        .with_context(|| format!("no answer from {} within {}s", args.addr, args.timeout_secs))??;
    let status = ServingStatus::try_from(status).unwrap_or(ServingStatus::Unknown);
    println!("{}", status.as_str_name());
    if status != ServingStatus::Serving {
        bail!("{} is {}", args.addr, status.as_str_name());
    }
    Ok(())
}
