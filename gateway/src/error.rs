//! Errors of the gateway's own work (templating, tokenizing, request checks, reading the
//! checkpoint). `is_invalid_input` decides between "your request is wrong" and "we failed".

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request itself is wrong: empty messages, too many images, a bad parameter.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The model directory is missing or is not a checkpoint.
    #[error("{0}")]
    ModelDir(String),
    /// The checkpoint's generation_config.json cannot give sampling defaults.
    #[error("{}: {message} (--generation-config none ignores the file)", file.display())]
    GenerationConfig {
        file: std::path::PathBuf,
        message: String,
    },
    /// A sampling field outside the contract's rules (`vlm_proto::sampling`).
    #[error(transparent)]
    Sampling(#[from] vlm_proto::sampling::InvalidSampling),
    /// A checkpoint file that cannot be read (tokenizer and template settings).
    #[error(transparent)]
    Checkpoint(#[from] vlm_proto::checkpoint::Error),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// True when the request, not the server, is at fault (INVALID_ARGUMENT / HTTP 400).
    pub fn is_invalid_input(&self) -> bool {
        match self {
            Error::InvalidRequest(_) | Error::Sampling(_) => true,
            Error::Template(_)
            | Error::Tokenizer(_)
            | Error::ModelDir(_)
            | Error::GenerationConfig { .. }
            | Error::Checkpoint(_) => false,
        }
    }
}
