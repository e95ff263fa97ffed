//! Errors of the in-process path (`vlm run`, `vlm bench`): the gateway's own (templating,
//! tokenizing, request checks) and the stages' it drives. `is_invalid_input` decides between
//! "your request is wrong" and "we failed".

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Gateway(#[from] gateway::Error),
    /// Which image of the request failed, and why (not a `#[source]`: the message says it all).
    #[error("image {index}: {error}")]
    Image {
        index: usize,
        error: vision_svc::Error,
    },
    #[error(transparent)]
    Vision(#[from] vision_svc::Error),
    #[error(transparent)]
    Llm(#[from] llm_svc::Error),
    #[error(transparent)]
    Compute(#[from] vlm_compute::Error),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// True when the request, not the server, is at fault.
    pub fn is_invalid_input(&self) -> bool {
        match self {
            Error::Gateway(e) => e.is_invalid_input(),
            Error::Image { error, .. } => error.is_invalid_input(),
            Error::Vision(e) => e.is_invalid_input(),
            Error::Llm(e) => e.is_invalid_input(),
            Error::Compute(_) => false,
        }
    }
}

/// A sampling field outside the contract's rules, as the gateway reports it.
impl From<vlm_proto::sampling::InvalidSampling> for Error {
    fn from(e: vlm_proto::sampling::InvalidSampling) -> Self {
        Error::Gateway(e.into())
    }
}
