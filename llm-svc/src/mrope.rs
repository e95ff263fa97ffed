//! Multimodal RoPE positions, as transformers' `Qwen3VLModel.get_rope_index`.
//!
//! Every token gets three positions (t, h, w). Text tokens count up with all three equal. An
//! image's tokens, laid out row by row over its merged grid, get (cur, cur + row, cur + col),
//! and the text after it resumes at cur + max(rows, cols). During decoding all three streams
//! are `slot + delta`, where `delta = max position + 1 - prompt length`.
//!
//! The rotary angle of frequency `j` comes from stream h when `j % 3 == 1` (and `j < 3·s_h`),
//! from w when `j % 3 == 2` (and `j < 3·s_w`), else from t: the *interleaved* layout of
//! Qwen3-VL, with sections `mrope_section = [s_t, s_h, s_w]`.

use vlm_compute::HostTensor;

use crate::{Error, Result, TextConfig};

/// Positions of a prompt: one `[t, h, w]` per token, and the decode offset.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptPositions {
    pub positions: Vec<[u32; 3]>,
    /// Added to a cache slot to get its position while decoding.
    pub delta: i64,
}

/// Where each image sits in the prompt: its first token index and merged grid (rows, cols).
#[derive(Clone, Debug, PartialEq)]
pub struct ImageSpan {
    pub start: usize,
    pub rows: usize,
    pub cols: usize,
}

impl ImageSpan {
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Finds the runs of `image_token_id` and pairs them, in order, with the merged grids of the
/// images supplied; each run must be exactly as long as its image's token count.
pub fn image_spans(
    ids: &[u32],
    image_token_id: u32,
    grids: &[(usize, usize)],
) -> Result<Vec<ImageSpan>> {
    let mut spans = Vec::new();
    let mut i = 0;
    while i < ids.len() {
        if ids[i] != image_token_id {
            i += 1;
            continue;
        }
        let k = spans.len();
        let Some(&(rows, cols)) = grids.get(k) else {
            return Err(Error::ImageMismatch(format!(
                "the prompt has more image placeholder runs than the {} image(s) given",
                grids.len()
            )));
        };
        let run = ids[i..]
            .iter()
            .take_while(|&&t| t == image_token_id)
            .count();
        if run != rows * cols {
            return Err(Error::ImageMismatch(format!(
                "image {k} has {} embeddings ({rows}x{cols}) but its placeholder run at token {i} has {run} tokens",
                rows * cols
            )));
        }
        spans.push(ImageSpan {
            start: i,
            rows,
            cols,
        });
        i += run;
    }
    if spans.len() != grids.len() {
        return Err(Error::ImageMismatch(format!(
            "{} image(s) given but the prompt has {} placeholder run(s)",
            grids.len(),
            spans.len()
        )));
    }
    Ok(spans)
}

/// M-RoPE positions for a prompt of `len` tokens with images at `spans`.
pub fn prompt_positions(len: usize, spans: &[ImageSpan]) -> PromptPositions {
    let mut positions = Vec::with_capacity(len);
    let mut cur: u32 = 0;
    let mut spans = spans.iter().peekable();
    let mut i = 0;
    while i < len {
        if let Some(s) = spans.next_if(|s| s.start == i) {
            for r in 0..s.rows as u32 {
                for c in 0..s.cols as u32 {
                    positions.push([cur, cur + r, cur + c]);
                }
            }
            cur += s.rows.max(s.cols) as u32;
            i += s.len();
        } else {
            positions.push([cur; 3]);
            cur += 1;
            i += 1;
        }
    }
    let max = positions
        .iter()
        .flatten()
        .copied()
        .max()
        .map_or(-1, i64::from);
    PromptPositions {
        positions,
        delta: max + 1 - len as i64,
    }
}

/// Rotary inverse frequencies, `head_dim / 2` of them, in f32 as transformers computes them.
pub fn inv_freq(cfg: &TextConfig) -> Vec<f32> {
    let d = cfg.head_dim;
    let base = cfg.rope_theta as f32;
    (0..d / 2)
        .map(|j| 1.0 / base.powf((2 * j) as f32 / d as f32))
        .collect()
}

/// cos and sin tables `[tokens, head_dim]` (both halves filled) for the given positions.
pub fn rope_tables(
    cfg: &TextConfig,
    inv_freq: &[f32],
    positions: &[[u32; 3]],
) -> Result<(HostTensor, HostTensor)> {
    let d = cfg.head_dim;
    let half = d / 2;
    let [_, sh, sw] = cfg.mrope_section;
    let stream: Vec<usize> = (0..half)
        .map(|j| match j % 3 {
            1 if j < 3 * sh => 1,
            2 if j < 3 * sw => 2,
            _ => 0,
        })
        .collect();
    let mut cos = vec![0f32; positions.len() * d];
    let mut sin = vec![0f32; positions.len() * d];
    for (i, p) in positions.iter().enumerate() {
        for j in 0..half {
            let angle = p[stream[j]] as f32 * inv_freq[j];
            let (s, c) = angle.sin_cos();
            cos[i * d + j] = c;
            cos[i * d + half + j] = c;
            sin[i * d + j] = s;
            sin[i * d + half + j] = s;
        }
    }
    Ok((
        HostTensor::new(vec![positions.len(), d], cos)?,
        HostTensor::new(vec![positions.len(), d], sin)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_only_positions_count_up_with_zero_delta() {
        let p = prompt_positions(4, &[]);
        assert_eq!(p.positions, vec![[0; 3], [1; 3], [2; 3], [3; 3]]);
        assert_eq!(p.delta, 0);
    }

    #[test]
    fn image_positions_follow_the_grid_and_text_resumes_after_the_longer_side() {
        // 2 text tokens, a 2x3 image, 1 text token.
        let ids = [1, 2, 9, 9, 9, 9, 9, 9, 3];
        let spans = image_spans(&ids, 9, &[(2, 3)]).unwrap();
        let p = prompt_positions(ids.len(), &spans);
        assert_eq!(
            p.positions,
            vec![
                [0, 0, 0],
                [1, 1, 1],
                [2, 2, 2],
                [2, 2, 3],
                [2, 2, 4],
                [2, 3, 2],
                [2, 3, 3],
                [2, 3, 4],
                [5, 5, 5],
            ]
        );
        // max position 5, so decoding continues at 6 = slot 9 + delta.
        assert_eq!(p.delta, 6 - 9);
    }

    #[test]
    fn placeholder_runs_must_match_the_images() {
        assert!(image_spans(&[9, 9, 9], 9, &[(2, 2)]).is_err());
        assert!(image_spans(&[9, 9, 1], 9, &[]).is_err());
        assert!(image_spans(&[1, 2], 9, &[(1, 1)]).is_err());
        let two = image_spans(&[9, 1, 9, 9], 9, &[(1, 1), (1, 2)]).unwrap();
        assert_eq!(
            two[1],
            ImageSpan {
                start: 2,
                rows: 1,
                cols: 2
            }
        );
    }
}
