//! The checks a request passes before it reaches the engine's loop: a prompt that fits the
//! context and the vocabulary, sampling settings in range, and images whose embeddings match
//! their grids and the model. A request that passes gets where its images sit in the prompt.
//! (The engine compiles its grammar after these.)

use crate::mrope::{image_spans, ImageSpan};
use crate::request::GenerateRequest;
use crate::{Error, ModelConfig, Result};

/// Checks `req` against the model of `cfg`, whose sequences hold at most `max_context`
/// tokens, and returns where its images sit in the prompt.
pub(crate) fn check(
    req: &GenerateRequest,
    cfg: &ModelConfig,
    max_context: usize,
) -> Result<Vec<ImageSpan>> {
    if req.prompt.is_empty() {
        return Err(Error::EmptyPrompt);
    }
    if req.prompt.len() >= max_context {
        return Err(Error::PromptTooLong {
            prompt_tokens: req.prompt.len(),
            context: max_context,
        });
    }
    let vocab = cfg.text.vocab_size;
    if let Some((position, &id)) = req
        .prompt
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= vocab)
    {
        return Err(Error::TokenOutOfRange {
            id,
            position,
            vocab,
        });
    }
    req.sampling.validate()?;
    if let Some(&(id, _)) = req
        .sampling
        .logit_bias
        .iter()
        .find(|b| b.0 as usize >= vocab)
    {
        return Err(Error::InvalidParameter(format!(
            "`logit_bias` names token {id}, outside the vocabulary of {vocab}"
        )));
    }
    if req.max_new_tokens == 0 {
        return Err(Error::InvalidParameter(
            "`max_new_tokens` must be at least 1, got 0".into(),
        ));
    }
    let Some(vision) = &cfg.vision else {
        if !req.images.is_empty() {
            return Err(Error::ImagesNotSupported {
                architecture: cfg.architecture.name(),
                images: req.images.len(),
            });
        }
        return Ok(Vec::new());
    };
    let hidden = cfg.text.hidden_size;
    let m = vision.spatial_merge_size;
    for (k, img) in req.images.iter().enumerate() {
        let [t, h, w] = img.grid_thw;
        // Checked: the grid comes off the wire (u32s, whose product overflows).
        let tokens = t
            .checked_mul(h / m)
            .and_then(|n| n.checked_mul(w / m))
            .ok_or_else(|| {
                Error::ImageMismatch(format!("image {k}: grid {:?} is too large", img.grid_thw))
            })?;
        if img.embeds.shape() != [tokens, hidden] {
            return Err(Error::ImageMismatch(format!(
                "image {k}: embeddings {:?}, grid {:?} implies [{tokens}, {hidden}]",
                img.embeds.shape(),
                img.grid_thw
            )));
        }
        if img.deepstack.len() != req.images[0].deepstack.len()
            || img
                .deepstack
                .iter()
                .any(|d| d.shape() != img.embeds.shape())
        {
            return Err(Error::ImageMismatch(format!(
                "image {k}: DeepStack features must all be {:?}, one set per image",
                img.embeds.shape()
            )));
        }
        if t != 1 {
            return Err(Error::ImageMismatch(format!(
                "image {k}: temporal grid {t}; images have 1 (video is not supported)"
            )));
        }
        let features = std::iter::once(("embeddings", &img.embeds))
            .chain(img.deepstack.iter().map(|d| ("DeepStack features", d)));
        for (what, rows) in features {
            if let Some(i) = rows.first_beyond_f16() {
                return Err(Error::BadImage {
                    index: k,
                    message: format!(
                        "{what} value {i} (row {}) is NaN, infinite or past f16's range (|v| > 65504)",
                        i / hidden.max(1)
                    ),
                });
            }
        }
    }
    let grids: Vec<(usize, usize)> = req
        .images
        .iter()
        .map(|i| (i.grid_thw[1] / m, i.grid_thw[2] / m))
        .collect();
    image_spans(&req.prompt, vision.image_token_id, &grids)
}
