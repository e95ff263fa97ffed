//! Errors of the language stage. `is_invalid_input` separates the caller's mistakes (bad token
//! ids, prompt past the context, bad sampling values) from the deployment's and ours; the one
//! mapping to gRPC statuses is `From<Error> for tonic::Status` below.

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {prompt_tokens} tokens; the context holds at most {context} (prompt plus at least one generated token)")]
    PromptTooLong {
        prompt_tokens: usize,
        context: usize,
    },
    #[error("token id {id} at position {position} is outside the vocabulary of {vocab}")]
    TokenOutOfRange {
        id: u32,
        position: usize,
        vocab: usize,
    },
    #[error("images do not match the prompt: {0}")]
    ImageMismatch(String),
    /// Images sent to a text-only checkpoint (`Qwen3ForCausalLM`, `Qwen2ForCausalLM`).
    #[error("`images`: the model ({architecture}) is text-only and takes no images; the request has {images}")]
    ImagesNotSupported {
        architecture: &'static str,
        images: usize,
    },
    /// An image's embeddings on the wire are malformed.
    #[error("images[{index}]: {message}")]
    BadImage { index: usize, message: String },
    #[error("invalid parameter: {0}")]
    InvalidParameter(String),
    #[error("text config: {0}")]
    Config(String),
    #[error("deadline exceeded after {generated} generated tokens")]
    DeadlineExceeded { generated: usize },
    /// The engine could not run a step this request was in (a device error), or has stopped.
    #[error("{0}")]
    Engine(String),
    #[error(transparent)]
    Compute(#[from] vlm_compute::Error),
    /// The service is up but its model is not loaded yet.
    #[error("the language model is still loading")]
    Loading,
    /// The service holds its limit of requests; the caller should retry later.
    #[error(
        "the LLM service holds its limit of {limit} requests (running and queued); retry later"
    )]
    Overloaded { limit: usize },
}

pub type Result<T> = std::result::Result<T, Error>;

/// A sampling field the contract's check refused ([`vlm_proto::sampling`]), message as it is.
impl From<vlm_proto::sampling::InvalidSampling> for Error {
    fn from(e: vlm_proto::sampling::InvalidSampling) -> Self {
        Error::InvalidParameter(e.0)
    }
}

impl Error {
    /// True when the request, not the server, is at fault (maps to INVALID_ARGUMENT / HTTP 400).
    pub fn is_invalid_input(&self) -> bool {
        !matches!(
            self,
            Error::Config(_)
                | Error::Compute(_)
                | Error::DeadlineExceeded { .. }
                | Error::Engine(_)
                | Error::Loading
                | Error::Overloaded { .. }
        )
    }
}

/// The one place language-stage errors become gRPC statuses.
impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        use tonic::Code;
        let code = match &e {
            _ if e.is_invalid_input() => Code::InvalidArgument,
            Error::Loading => Code::Unavailable,
            Error::Overloaded { .. } => Code::ResourceExhausted,
            Error::DeadlineExceeded { .. } => Code::DeadlineExceeded,
            _ => Code::Internal,
        };
        tonic::Status::new(code, e.to_string())
    }
}
