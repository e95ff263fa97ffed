//! What a request through the gateway can fail with: one error type, each kind mapping to one
//! gRPC code and one HTTP status, and the reading of an upstream's status as one of them.

use tonic::{Code, Status};

/// Everything a gateway request can fail with, each mapping to one gRPC and one HTTP status.
#[derive(Debug, Clone, thiserror::Error)]
pub enum GatewayError {
    #[error("{0}")]
    Invalid(String),
    /// The request is bigger than the gateway accepts (`--max-body-bytes`).
    #[error("{0}")]
    TooLarge(String),
    #[error("{0}")]
    Overloaded(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    DeadlineExceeded(String),
    #[error("{0}")]
    Internal(String),
}

impl GatewayError {
    /// Stable label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            GatewayError::Invalid(_) => "invalid_request",
            GatewayError::TooLarge(_) => "request_too_large",
            GatewayError::Overloaded(_) => "overloaded",
            GatewayError::Unavailable(_) => "unavailable",
            GatewayError::DeadlineExceeded(_) => "deadline_exceeded",
            GatewayError::Internal(_) => "internal",
        }
    }

    /// HTTP status for the OpenAI-style API.
    pub fn http_status(&self) -> u16 {
        match self {
            GatewayError::Invalid(_) => 400,
            GatewayError::TooLarge(_) => 413,
            GatewayError::Overloaded(_) => 429,
            GatewayError::Unavailable(_) => 503,
            GatewayError::DeadlineExceeded(_) => 504,
            GatewayError::Internal(_) => 500,
        }
    }

    /// An upstream call's failure, named after the service and address it came from.
    pub(crate) fn upstream(service: &str, addr: &str, s: &Status) -> Self {
        let msg = format!("{service} at {addr}: {}", s.message());
        match s.code() {
            Code::InvalidArgument | Code::OutOfRange => {
                GatewayError::Invalid(s.message().to_string())
            }
            Code::ResourceExhausted => GatewayError::Overloaded(msg),
            _ if upstream_gone(s) => GatewayError::Unavailable(format!(
                "{service} unavailable at {addr}: {}",
                s.message()
            )),
            Code::DeadlineExceeded | Code::Cancelled => GatewayError::DeadlineExceeded(msg),
            _ => GatewayError::Internal(msg),
        }
    }
}

/// Whether an upstream call failed because the service is not there: UNAVAILABLE, or UNKNOWN,
/// which tonic reports when the connection breaks under a call (the process died or was
/// killed) and never comes from our services, which answer every failure with a code.
pub(crate) fn upstream_gone(s: &Status) -> bool {
    matches!(s.code(), Code::Unavailable | Code::Unknown)
}

/// The one place gateway errors become gRPC statuses.
impl From<GatewayError> for Status {
    fn from(e: GatewayError) -> Self {
        let code = match e {
            GatewayError::Invalid(_) => Code::InvalidArgument,
            // gRPC's code for a message over the size limit.
            GatewayError::TooLarge(_) => Code::ResourceExhausted,
            GatewayError::Overloaded(_) => Code::ResourceExhausted,
            GatewayError::Unavailable(_) => Code::Unavailable,
            GatewayError::DeadlineExceeded(_) => Code::DeadlineExceeded,
            GatewayError::Internal(_) => Code::Internal,
        };
        Status::new(code, e.to_string())
    }
}

impl From<crate::Error> for GatewayError {
    fn from(e: crate::Error) -> Self {
        if e.is_invalid_input() {
            GatewayError::Invalid(e.to_string())
        } else {
            GatewayError::Internal(e.to_string())
        }
    }
}
