//! Errors of the vision stage. Image errors are the caller's fault (bad input); the others are
//! the deployment's (bad checkpoint) or ours.

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
    #[error(transparent)]
    Compute(#[from] vlm_compute::Error),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// True when the request, not the server, is at fault (maps to INVALID_ARGUMENT / HTTP 400).
    pub fn is_invalid_input(&self) -> bool {
        matches!(
            self,
            Error::BadImage(_) | Error::ImageTooLarge(_) | Error::BadAspectRatio(_)
        )
    }
}
