//! `vlm health`: asks a service's `grpc.health.v1` whether it is SERVING (exit 0) or not
//! (exit 1); what the containers' health checks call.

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
}

pub async fn health(args: HealthArgs) -> anyhow::Result<()> {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    let check = async {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", args.addr))?
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
