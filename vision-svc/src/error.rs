//! Errors of the vision stage. Image errors are the caller's fault (bad input); the others are
//! the deployment's (bad checkpoint), the service's state (loading, at its limit) or ours. The
//! one mapping to gRPC statuses is `From<Error> for tonic::Status` below.

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The bytes are not an image we can read: unknown format, truncated or corrupt data.
    #[error("cannot decode image: {0}")]
    BadImage(String),
    /// The image decodes but is outside what we accept (dimensions, memory, aspect ratio).
    #[error("image rejected: {0}")]
    ImageTooLarge(String),
    #[error("image rejected: {0}")]
    BadAspectRatio(String),
    /// The checkpoint's settings are inconsistent or unsupported.
    #[error("vision config: {0}")]
    Config(String),
    /// A checkpoint file that cannot be read (the image-processor settings).
    #[error(transparent)]
    Checkpoint(#[from] vlm_proto::checkpoint::Error),
    #[error(transparent)]
    Compute(#[from] vlm_compute::Error),
    /// The service is up but its model is not loaded yet.
    #[error("the vision model is still loading")]
    Loading,
    /// The service holds its limit of images; the caller should retry later.
    #[error("the vision service holds its limit of {limit} images (preprocessing, queued or encoding); retry later")]
    Overloaded { limit: usize },
    /// The encoder loop failed, panicked or has stopped.
    #[error("{0}")]
    Encoder(String),
}

pub type Result<T> = std::result::Result<T, Error>;

/// The contract's image rule ([`vlm_proto::image`]) refuses with the variants of the same name.
impl From<vlm_proto::image::Error> for Error {
    fn from(e: vlm_proto::image::Error) -> Self {
        use vlm_proto::image::Error as Image;
        match e {
            Image::BadImage(m) => Error::BadImage(m),
            Image::ImageTooLarge(m) => Error::ImageTooLarge(m),
            Image::BadAspectRatio(m) => Error::BadAspectRatio(m),
            Image::Config(m) => Error::Config(m),
            Image::Checkpoint(e) => Error::Checkpoint(e),
        }
    }
}

impl Error {
    /// True when the request, not the server, is at fault (maps to INVALID_ARGUMENT / HTTP 400).
    pub fn is_invalid_input(&self) -> bool {
        matches!(
            self,
            Error::BadImage(_) | Error::ImageTooLarge(_) | Error::BadAspectRatio(_)
        )
    }
}

/// The one place vision errors become gRPC statuses.
impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        use tonic::Code;
        let code = match &e {
            _ if e.is_invalid_input() => Code::InvalidArgument,
            Error::Loading => Code::Unavailable,
            Error::Overloaded { .. } => Code::ResourceExhausted,
            _ => Code::Internal,
        };
        tonic::Status::new(code, e.to_string())
    }
}
