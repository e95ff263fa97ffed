//! Choosing each sequence's next token from its logits: the rule, written once, that the CPU
//! reference computes here and `cuda/kernels/sampling_f32.cu` computes on the GPU, with the
//! same result to the bit (the twin tests demand the same token from the same inputs).
//!
//! Per row, in this order (vLLM's and HF's):
//! 1. **Processing.** `x = logit + logit_bias`, then the penalties: repetition (HF's: a seen
//!    token's positive logit divided by it, a negative one multiplied; seen = in the prompt or
//!    generated), frequency (minus `frequency × times generated`) and presence (minus
//!    `presence` once generated). Then `y = x / temperature`. A row with a token mask (a
//!    grammar's allowed tokens, one bit a token) gives every token it does not allow
//!    `y = -inf`, so neither greedy nor a draw can pick it.
//! 2. **Greedy** at temperature 0: the largest `y`, the lowest id on ties.
//! 3. **Candidates**: tokens within [`CUTOFF`] of the best `y` (weight `e^(y - max)` at least
//!    2^-31 of the best's). The rest can never be drawn.
//! 4. **top-k** keeps the `k` largest `y` (and every token tied with the k-th, as HF).
//! 5. **top-p** keeps, of those, each token whose better tokens hold less than `top_p` of the
//!    kept mass (ties kept together; at least the best).
//! 6. **min-p** keeps, of those, tokens with at least `min_p` of the best's probability.
//! 7. **The draw**: one 64-bit uniform from Philox4x32-10 keyed by the request's seed, counted
//!    by the token's position (and the choice's index), picks by inverse CDF in token-id order
//!    over the kept weights.
//!
//! A row whose largest `y` is not finite has no token: [`NOT_FINITE`], nothing counted. NaN
//! everywhere is what an activation that overflowed upstream (past f16's 65504, say) leaves in
//! the logits, and greedy would otherwise pick token 0 from them, silently; an infinity or a
//! mask that allows nothing is no better. The engine ends such a request with an error.
//!
//! Why every step is exact: weights are integers (`floor(e^(y - max) × 2^31)` from [`det_exp`],
//! a few correctly rounded f32 operations that the GPU performs identically), thresholds are
//! comparisons of keys that order floats, and masses are integer sums, which no summation
//! order changes. So a seeded request draws the same tokens alone or in any batch, on the CPU
//! and on the GPU, and nothing sorts the vocabulary (the kernel finds thresholds by radix
//! selection, as FlashInfer's and vLLM's sorting-free samplers avoid a sort).
//!
//! Logprobs are of the raw logits (before bias, penalties and temperature), as vLLM's default
//! `raw_logprobs` and what OpenAI's clients expect: the model's own likelihood of each token.

/// `u32` words of one row's parameters (the layout [`RowParams::to_words`] writes).
pub const SAMPLE_WORDS: usize = 16;
/// Most alternatives a row can ask for with its logprobs (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: usize = 20;
/// Columns of a step's logprobs output: the pick's, then up to [`MAX_TOP_LOGPROBS`] others.
pub const LOGPROB_COLS: usize = 1 + MAX_TOP_LOGPROBS;
/// Candidates the device's draw keeps in shared memory (`S_LIST` in the kernel).
pub const SAMPLE_LIST: usize = 2048;
/// Bins of the device's candidate histogram (`S_BINS`).
pub const SAMPLE_BINS: usize = 2048;

/// Blocks a row's heavy passes are spread over on the device for a step of `rows` rows: about
/// two waves of an H100's 132 SMs, at most 32 a row.
pub fn split_for(rows: usize) -> usize {
    (256 / rows.max(1)).clamp(1, 32)
}

/// `u32` words of the device's work buffer for a step of `rows` rows (the kernels' `SWork`:
/// each slice's largest, the histograms, each slice's candidates and weight).
pub fn work_words(rows: usize) -> usize {
    let split = split_for(rows);
    rows * (3 * SAMPLE_BINS + split * (5 + SAMPLE_LIST)) + 1
}

/// A row that keeps no token counts (no penalty asks for them).
pub const NO_SLOT: u32 = u32::MAX;

/// The pick of a row whose largest processed logit is not finite (`S_NOT_FINITE` in the
/// kernel): not a token id, as no vocabulary has 2^32 - 1 tokens.
pub const NOT_FINITE: u32 = u32::MAX;

/// `u32` words of one row's token mask over `vocab` tokens: bit `t % 32` of word `t / 32` is
/// set where token `t` is allowed.
pub fn mask_words(vocab: usize) -> usize {
    vocab.div_ceil(32)
}

/// Whether `mask` (a row of [`mask_words`]) allows token `t`.
pub fn mask_allows(mask: &[u32], t: usize) -> bool {
    mask.get(t / 32).is_some_and(|w| w >> (t % 32) & 1 != 0)
}
/// Candidates are tokens with `y - max(y) > CUTOFF`: `e^-21` is 7.6e-10, so each has a weight
/// of at least 1 in units of 2^-31 of the best's. The largest Gumbel or inverse-CDF advantage a
/// 24-bit uniform gives is far smaller, so the tokens left out could never have been drawn.
pub const CUTOFF: f32 = -21.0;
/// Weights are `e^(y - max)` in units of 2^-31 (the best token weighs exactly 2^31).
const WEIGHT_ONE: f32 = 2_147_483_648.0;
/// Bit 31 of a token's count: the token is in the prompt (for the repetition penalty).
pub const IN_PROMPT: u32 = 1 << 31;
/// The third Philox counter word of sampling draws ("samp"), so no other use of the same seed
/// and position shares its numbers.
const PHILOX_SALT: u32 = 0x7361_6d70;

/// One row's sampling parameters, as the engine fills them for a sequence each step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowParams {
    /// 0: greedy. Otherwise the logits are divided by it.
    pub temperature: f32,
    /// Keep the `top_k` largest; 0 keeps all.
    pub top_k: u32,
    /// In (0, 1]; 1 keeps all.
    pub top_p: f32,
    /// In [0, 1]; 0 keeps all.
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// 1 is off.
    pub repetition_penalty: f32,
    pub seed: u64,
    /// Index of the token being chosen in its sequence (prompt included): the draw's counter.
    pub position: u32,
    /// Which of a request's choices this is (`n` > 1 draws differently for each).
    pub stream: u32,
    /// Row of the token-count table this sequence updates, or [`NO_SLOT`].
    pub slot: u32,
    /// 0: no logprobs; `1 + n`: the pick's logprob and the `n` most likely tokens'.
    pub logprobs: u32,
    /// This row's `logit_bias` entries: a range of the step's bias pairs.
    pub bias_start: u32,
    pub bias_len: u32,
    /// Whether row `r` of the step's masks ([`mask_words`] words a row) says which tokens the
    /// row may pick; otherwise any.
    pub masked: bool,
}

impl Default for RowParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            seed: 0,
            position: 0,
            stream: 0,
            slot: NO_SLOT,
            logprobs: 0,
            bias_start: 0,
            bias_len: 0,
            masked: false,
        }
    }
}

impl RowParams {
    /// The words the kernel reads (layout shared with `sampling_f32.cu`'s `P_*` indices).
    pub fn to_words(&self) -> [u32; SAMPLE_WORDS] {
        [
            self.temperature.to_bits(),
            self.top_k,
            self.top_p.to_bits(),
            self.min_p.to_bits(),
            self.presence_penalty.to_bits(),
            self.frequency_penalty.to_bits(),
            self.repetition_penalty.to_bits(),
            self.seed as u32,
            (self.seed >> 32) as u32,
            self.position,
            self.stream,
            self.slot,
            self.logprobs,
            self.bias_start,
            self.bias_len,
            self.masked as u32,
        ]
    }

    pub fn from_words(w: &[u32]) -> Self {
        Self {
            temperature: f32::from_bits(w[0]),
            top_k: w[1],
            top_p: f32::from_bits(w[2]),
            min_p: f32::from_bits(w[3]),
            presence_penalty: f32::from_bits(w[4]),
            frequency_penalty: f32::from_bits(w[5]),
            repetition_penalty: f32::from_bits(w[6]),
            seed: w[7] as u64 | (w[8] as u64) << 32,
            position: w[9],
            stream: w[10],
            slot: w[11],
            logprobs: w[12],
            bias_start: w[13],
            bias_len: w[14],
            masked: w[15] != 0,
        }
    }

    /// Whether the row's token is the largest raw logit: nothing changes the logits and
    /// nothing is drawn.
    pub fn is_plain_greedy(&self) -> bool {
        self.temperature == 0.0 && self.slot == NO_SLOT && self.bias_len == 0 && !self.masked
    }
}

/// Every buffer of a [`crate::Backend::sample_rows`] call for `rows` rows, owned together: for
/// callers that sample one batch shape over and over (the twin tests, the benchmark). The
/// engine's recorded steps share some of these between batch sizes and keep their own.
pub struct SampleBuffers<B: crate::Backend> {
    /// `[rows × SAMPLE_WORDS]`: write each row's [`RowParams::to_words`] here.
    pub params: B::Ids,
    pub bias: B::Ids,
    /// `[rows × mask_words(vocab)]`: the masked rows' allowed tokens.
    pub masks: B::Ids,
    pub counts: B::Ids,
    pub scratch: B::Tensor,
    pub picks: B::Ids,
    pub logprobs: B::Tensor,
    pub top_ids: B::Ids,
    pub work: B::Ids,
}

impl<B: crate::Backend> SampleBuffers<B> {
    /// For `rows` rows of `vocab` logits with `params` (one [`RowParams`] a row), `bias` (the
    /// rows' `logit_bias` entries), `masks` (`[rows × mask_words(vocab)]`, or empty where no
    /// row is masked) and `counts` (`[slots × vocab]`, the rows' slots).
    pub fn new(
        be: &B,
        vocab: usize,
        params: &[RowParams],
        bias: &[(u32, f32)],
        masks: &[u32],
        counts: &[u32],
    ) -> crate::Result<Self> {
        let rows = params.len();
        let words: Vec<u32> = params.iter().flat_map(|p| p.to_words()).collect();
        let mut mask_rows = masks.to_vec();
        mask_rows.resize(rows * mask_words(vocab), 0);
        Ok(Self {
            params: be.upload_ids(&words)?,
            // Never empty: a device buffer of no bytes has no address.
            bias: be.upload_ids(&[bias_words(bias), vec![0, 0]].concat())?,
            masks: be.upload_ids(&mask_rows)?,
            counts: be.upload_ids(if counts.is_empty() { &[0] } else { counts })?,
            scratch: be.zeros(&[rows, vocab])?,
            picks: be.upload_ids(&vec![0; rows])?,
            logprobs: be.zeros(&[rows, LOGPROB_COLS])?,
            top_ids: be.upload_ids(&vec![0; rows * MAX_TOP_LOGPROBS])?,
            work: be.upload_ids(&vec![0; work_words(rows)])?,
        })
    }

    /// Each row's pick from `logits` into `picks` (and `logprobs`, `top_ids`, `counts`).
    pub fn sample(&mut self, be: &B, logits: &B::Tensor) -> crate::Result<()> {
        be.sample_rows(
            logits,
            crate::SampleIo {
                params: &self.params,
                bias: &self.bias,
                masks: &self.masks,
                counts: &mut self.counts,
                scratch: &mut self.scratch,
                picks: &mut self.picks,
                logprobs: &mut self.logprobs,
                top_ids: &mut self.top_ids,
                work: &mut self.work,
            },
        )
    }
}

/// A logit bias entry as the kernel reads it: token id, then the bias's bits.
pub fn bias_words(entries: &[(u32, f32)]) -> Vec<u32> {
    entries
        .iter()
        .flat_map(|&(t, b)| [t, b.to_bits()])
        .collect()
}

/// What a row's draw gives back.
#[derive(Clone, Debug, PartialEq)]
pub struct Pick {
    pub token: u32,
    /// The pick's raw logprob (NaN where the row asked for none).
    pub logprob: f32,
    /// The most likely tokens by raw logit and their logprobs, best first (ties: lower id).
    pub top: Vec<(u32, f32)>,
}

/// `e^d` for `d` in (-21, 0], from correctly rounded f32 operations only (a multiply, a
/// floor, a subtraction, fused multiply-adds and an exact power of two), so that the GPU, which
/// has the same operations, computes the same bits. Relative error under 1e-7.
pub fn det_exp(d: f32) -> f32 {
    let t = d * std::f32::consts::LOG2_E;
    let k = (t + 0.5).floor();
    // f in [-0.5, 0.5]: 2^f by its Taylor series to degree 7 (error < 4e-9).
    let f = t - k;
    let mut p = 1.525_273_4e-5_f32;
    for c in [
        1.540_353_1e-4,
        1.333_355_8e-3,
        9.618_129e-3,
        5.550_411e-2,
        2.402_265e-1,
        6.931_472e-1,
        1.0,
    ] {
        p = p.mul_add(f, c);
    }
    // 2^k exactly (k in [-31, 0] for the candidates).
    p * f32::from_bits(((k as i32 + 127) as u32) << 23)
}

/// A token's weight: `e^d` in units of 2^-31.
fn weight(d: f32) -> u32 {
    (det_exp(d) * WEIGHT_ONE) as u32
}

/// A u32 that orders as the f32 does (negative below positive; -0 and +0 are one value).
pub fn order_key(y: f32) -> u32 {
    let b = (y + 0.0).to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011), as
/// cuRAND and PyTorch use it.
pub fn philox(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for round in 0..10 {
        if round > 0 {
            k[0] = k[0].wrapping_add(0x9E37_79B9);
            k[1] = k[1].wrapping_add(0xBB67_AE85);
        }
        let p0 = 0xD251_1F53u64 * c[0] as u64;
        let p1 = 0xCD9E_8D57u64 * c[2] as u64;
        c = [
            ((p1 >> 32) as u32) ^ c[1] ^ k[0],
            p1 as u32,
            ((p0 >> 32) as u32) ^ c[3] ^ k[1],
            p0 as u32,
        ];
    }
    c
}

/// The 64 random bits of the draw for `p`'s token.
pub fn draw_bits(p: &RowParams) -> u64 {
    let x = philox(
        [p.position, p.stream, PHILOX_SALT, 0],
        [p.seed as u32, (p.seed >> 32) as u32],
    );
    (x[0] as u64) << 32 | x[1] as u64
}

/// Step 1: the processed logit of a token with raw logit `l`, bias `bias` and count word
/// `count` (generated times, [`IN_PROMPT`]), before the temperature.
pub fn process(l: f32, bias: f32, count: u32, p: &RowParams) -> f32 {
    let mut x = l + bias;
    if p.slot != NO_SLOT {
        let n = count & !IN_PROMPT;
        if (n > 0 || count & IN_PROMPT != 0) && p.repetition_penalty != 1.0 {
            x = if x > 0.0 {
                x / p.repetition_penalty
            } else {
                x * p.repetition_penalty
            };
        }
        x -= p.frequency_penalty * n as f32;
        if n > 0 {
            x -= p.presence_penalty;
        }
    }
    x
}

/// The temperature's division (none at 0, greedy).
fn temper(x: f32, p: &RowParams) -> f32 {
    if p.temperature > 0.0 {
        x / p.temperature
    } else {
        x
    }
}

/// The raw logprobs of the pick and of the `n` most likely tokens.
fn raw_logprobs(logits: &[f32], n: usize, token: u32) -> (f32, Vec<(u32, f32)>) {
    let max = logits
        .iter()
        .fold(f32::NEG_INFINITY, |m, &l| if l > m { l } else { m });
    let sum: f64 = logits
        .iter()
        .filter(|l| !l.is_nan())
        .map(|&l| ((l - max) as f64).exp())
        .sum();
    let lse = max + sum.ln() as f32;
    let mut order: Vec<u32> = (0..logits.len() as u32)
        .filter(|&i| !logits[i as usize].is_nan())
        .collect();
    let by_value = |a: &u32, b: &u32| {
        order_key(logits[*b as usize])
            .cmp(&order_key(logits[*a as usize]))
            .then(a.cmp(b))
    };
    if n < order.len() && n > 0 {
        order.select_nth_unstable_by(n - 1, by_value);
    }
    order.truncate(n);
    order.sort_by(by_value);
    let top = order
        .iter()
        .map(|&i| (i, logits[i as usize] - lse))
        .collect();
    (logits[token as usize] - lse, top)
}

/// Steps 1 and 2 for a row: its processed, tempered logits (`count(i)` is token `i`'s count
/// word; tokens `mask` does not allow are -inf), their largest, and the first token that has
/// it (greedy's pick, and the fallback of a draw with no finite logit).
fn tempered(
    logits: &[f32],
    p: &RowParams,
    bias: &[(u32, f32)],
    mask: Option<&[u32]>,
    count: impl Fn(usize) -> u32,
) -> (Vec<f32>, f32, u32) {
    let mut y: Vec<f32> = (0..logits.len())
        .map(|i| temper(process(logits[i], 0.0, count(i), p), p))
        .collect();
    for &(t, b) in bias {
        y[t as usize] = temper(process(logits[t as usize], b, count(t as usize), p), p);
    }
    if let Some(mask) = mask {
        for (t, x) in y.iter_mut().enumerate() {
            if !mask_allows(mask, t) {
                *x = f32::NEG_INFINITY;
            }
        }
    }
    let (mut max, mut greedy) = (f32::NEG_INFINITY, 0u32);
    for (i, &x) in y.iter().enumerate() {
        if x > max {
            (max, greedy) = (x, i as u32);
        }
    }
    (y, max, greedy)
}

/// The token for one row, by the rule in this module's header; updates `counts` (the row's
/// slot, `[vocab]`) with the pick. `bias` is the row's `logit_bias` entries.
pub fn sample_row(
    logits: &[f32],
    p: &RowParams,
    bias: &[(u32, f32)],
    counts: Option<&mut [u32]>,
) -> Pick {
    sample_masked_row(logits, p, bias, None, counts)
}

/// [`sample_row`] for a row that may pick only the tokens `mask` allows (a row of
/// [`mask_words`]), where it has one. A mask that allows no token gives [`NOT_FINITE`].
pub fn sample_masked_row(
    logits: &[f32],
    p: &RowParams,
    bias: &[(u32, f32)],
    mask: Option<&[u32]>,
    mut counts: Option<&mut [u32]>,
) -> Pick {
    let count = |i: usize| counts.as_ref().map_or(0, |c| c[i]);
    let (y, max, greedy) = tempered(logits, p, bias, mask, count);
    if !max.is_finite() {
        return Pick {
            token: NOT_FINITE,
            logprob: f32::NAN,
            top: Vec::new(),
        };
    }
    let token = if p.temperature > 0.0 && max.is_finite() {
        draw(&y, max, p).unwrap_or(greedy)
    } else {
        greedy
    };
    if let Some(c) = counts.as_mut() {
        c[token as usize] += 1;
    }
    let (logprob, top) = if p.logprobs > 0 {
        raw_logprobs(logits, p.logprobs as usize - 1, token)
    } else {
        (f32::NAN, Vec::new())
    };
    Pick {
        token,
        logprob,
        top,
    }
}

/// Steps 3 to 7 over the tempered logits `y` whose largest is `max`; `None` if no token is a
/// candidate.
fn draw(y: &[f32], max: f32, p: &RowParams) -> Option<u32> {
    let cand = kept(y, max, p);
    if cand.is_empty() {
        return None;
    }
    let total: u64 = cand.iter().map(|c| c.2 as u64).sum();
    let target = ((draw_bits(p) as u128 * total as u128) >> 64) as u64;
    let mut acc = 0u64;
    for c in &cand {
        acc += c.2 as u64;
        if acc > target {
            return Some(c.0);
        }
    }
    unreachable!("target < total")
}

/// Steps 3 to 6: the tokens a draw over the tempered logits `y` (largest `max`) can give, as
/// (id, key, weight) in id order.
fn kept(y: &[f32], max: f32, p: &RowParams) -> Vec<(u32, u32, u32)> {
    let mut cand: Vec<(u32, u32, u32)> = y
        .iter()
        .enumerate()
        .filter(|(_, &x)| x - max > CUTOFF)
        .map(|(i, &x)| (i as u32, order_key(x), weight(x - max)))
        .collect();
    if cand.is_empty() {
        return cand;
    }
    // Keys best first, to find the thresholds.
    let mut keys: Vec<(u32, u32)> = cand.iter().map(|c| (c.1, c.2)).collect();
    keys.sort_unstable_by_key(|c| std::cmp::Reverse(c.0));
    let k = p.top_k as usize;
    if k > 0 && k < keys.len() {
        let kth = keys[k - 1].0;
        keys.retain(|c| c.0 >= kth);
        cand.retain(|c| c.1 >= kth);
    }
    if p.top_p < 1.0 {
        let total: u64 = keys.iter().map(|c| c.1 as u64).sum();
        let bound = ((p.top_p as f64 * total as f64) as u64).max(1);
        // The lowest key whose strictly better tokens weigh less than the bound.
        let (mut above, mut i, mut lowest) = (0u64, 0, keys[0].0);
        while i < keys.len() && above < bound {
            let key = keys[i].0;
            lowest = key;
            while i < keys.len() && keys[i].0 == key {
                above += keys[i].1 as u64;
                i += 1;
            }
        }
        cand.retain(|c| c.1 >= lowest);
    }
    if p.min_p > 0.0 {
        let least = min_p_weight(p.min_p);
        cand.retain(|c| c.2 as f64 >= least);
    }
    cand
}

/// The tokens a row can give (greedy: the one it gives), by the same steps as
/// [`sample_row`]: for checking the rule against HF's warpers. `counts` as `sample_row`'s
/// (not updated).
pub fn kept_tokens(logits: &[f32], p: &RowParams, bias: &[(u32, f32)], counts: &[u32]) -> Vec<u32> {
    let count = |i: usize| if p.slot == NO_SLOT { 0 } else { counts[i] };
    let (y, max, greedy) = tempered(logits, p, bias, None, count);
    if p.temperature > 0.0 && max.is_finite() {
        kept(&y, max, p).into_iter().map(|c| c.0).collect()
    } else {
        vec![greedy]
    }
}

/// The least weight min-p keeps (the best weighs 2^31).
fn min_p_weight(min_p: f32) -> f64 {
    min_p as f64 * WEIGHT_ONE as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: u32, top_p: f32, seed: u64) -> RowParams {
        RowParams {
            temperature,
            top_k,
            top_p,
            seed,
            ..Default::default()
        }
    }

    #[test]
    fn philox_matches_the_published_known_answers() {
        // Random123's kat_vectors for philox4x32_10.
        assert_eq!(
            philox([0; 4], [0; 2]),
            [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
        );
        assert_eq!(
            philox([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
        );
        assert_eq!(
            philox(
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0]
            ),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    #[test]
    fn det_exp_is_exp_to_a_few_ulps_and_exactly_one_at_zero() {
        assert_eq!(det_exp(0.0), 1.0);
        assert_eq!(weight(0.0), 1 << 31);
        for i in 0..=21_000 {
            let d = -(i as f32) * 1e-3;
            let (got, want) = (det_exp(d) as f64, (d as f64).exp());
            assert!(((got - want) / want).abs() < 1e-6, "e^{d}: {got} vs {want}");
        }
        assert!(
            weight(CUTOFF + 1e-5) >= 1,
            "every candidate weighs something"
        );
    }

    #[test]
    fn keys_order_as_the_floats() {
        let xs = [
            f32::NEG_INFINITY,
            -3.5,
            -1e-30,
            -0.0,
            0.0,
            1e-30,
            2.0,
            f32::INFINITY,
        ];
        for w in xs.windows(2) {
            assert!(order_key(w[0]) <= order_key(w[1]), "{w:?}");
        }
        assert_eq!(order_key(-0.0), order_key(0.0));
    }

    #[test]
    fn a_row_without_a_finite_largest_logit_has_no_token_and_counts_nothing() {
        let nan = f32::NAN;
        let mut counts = vec![0u32; 4];
        for (logits, temperature) in [
            ([nan; 4], 0.0),
            ([nan; 4], 0.7),
            ([0.5, f32::INFINITY, 1.0, nan], 0.0),
            ([0.5, f32::INFINITY, 1.0, 2.0], 0.7),
        ] {
            let p = RowParams {
                temperature,
                logprobs: 3,
                slot: 0,
                ..Default::default()
            };
            let pick = sample_row(&logits, &p, &[], Some(&mut counts));
            assert_eq!(pick.token, NOT_FINITE, "{logits:?} at {temperature}");
            assert!(pick.logprob.is_nan() && pick.top.is_empty());
        }
        // A mask that allows nothing leaves every logit at -inf.
        let mask = vec![0u32; mask_words(4)];
        let masked = sample_masked_row(&[1.0; 4], &RowParams::default(), &[], Some(&mask), None);
        assert_eq!(masked.token, NOT_FINITE);
        assert_eq!(counts, [0; 4]);
        // A NaN among finite logits never wins, and is no reason to give up the row.
        let some = sample_row(&[0.5, nan, 1.0, nan], &RowParams::default(), &[], None);
        assert_eq!(some.token, 2);
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let pick = sample_row(&[0.1, 3.0, 3.0, -1.0], &RowParams::default(), &[], None);
        assert_eq!(pick.token, 1);
    }

    #[test]
    fn top_k_top_p_and_min_p_restrict_the_candidates() {
        let logits = [5.0, 4.9, 0.0, -1.0, 4.8];
        let drawn = |p: RowParams| {
            (0..300)
                .map(|pos| sample_row(&logits, &RowParams { position: pos, ..p }, &[], None).token)
                .collect::<std::collections::BTreeSet<_>>()
        };
        assert_eq!(drawn(params(1.0, 2, 1.0, 7)), [0, 1].into());
        // Token 0 alone holds over 30% of the mass, so top_p = 0.3 keeps only it.
        assert_eq!(drawn(params(1.0, 0, 0.3, 7)), [0].into());
        // 0, 1 and 4 are within e^-0.2 of the best; 2 and 3 under 1% of it.
        let min_p = RowParams {
            min_p: 0.5,
            ..params(1.0, 0, 1.0, 7)
        };
        assert_eq!(drawn(min_p), [0, 1, 4].into());
        assert_eq!(drawn(params(1.0, 0, 1.0, 7)), [0, 1, 2, 3, 4].into());
    }

    #[test]
    fn top_p_keeps_tied_tokens_together() {
        // Four equal tokens, a quarter of the mass each: 0.3 needs two, and the ties keep all.
        let logits = [1.0, 1.0, 1.0, 1.0, -30.0];
        let p = params(1.0, 0, 0.3, 1);
        let got: std::collections::BTreeSet<_> = (0..200)
            .map(|pos| sample_row(&logits, &RowParams { position: pos, ..p }, &[], None).token)
            .collect();
        assert_eq!(got, [0, 1, 2, 3].into());
    }

    #[test]
    fn draws_follow_the_distribution() {
        // p = softmax([ln 1, ln 2, ln 3, ln 4]) = 0.1 .. 0.4, over 20,000 positions.
        let logits = [1f32, 2., 3., 4.].map(f32::ln);
        let mut seen = [0usize; 4];
        for pos in 0..20_000 {
            let p = RowParams {
                position: pos,
                ..params(1.0, 0, 1.0, 99)
            };
            seen[sample_row(&logits, &p, &[], None).token as usize] += 1;
        }
        for (i, &n) in seen.iter().enumerate() {
            let want = 2000.0 * (i + 1) as f64;
            // Four standard deviations of a binomial(20000, 0.4) are under 300.
            assert!((n as f64 - want).abs() < 300.0, "token {i}: {n} vs {want}");
        }
    }

    #[test]
    fn seed_and_position_alone_decide_the_draw() {
        let logits: Vec<f32> = (0..500).map(|i| (i as f32 * 0.37).sin()).collect();
        let run = |seed| {
            (0..64)
                .map(|pos| {
                    let p = RowParams {
                        position: pos,
                        ..params(1.0, 0, 1.0, seed)
                    };
                    sample_row(&logits, &p, &[], None).token
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(3), run(3));
        assert_ne!(run(3), run(4));
        let distinct: std::collections::HashSet<_> = run(3).into_iter().collect();
        assert!(distinct.len() > 30, "flat logits spread the draws");
    }

    #[test]
    fn penalties_follow_openai_and_hf() {
        let p = RowParams {
            slot: 0,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            repetition_penalty: 2.0,
            ..Default::default()
        };
        // Generated twice: repetition (4 / 2), then 2 x 0.25 and 0.5.
        assert_eq!(process(4.0, 0.0, 2, &p), 1.0);
        // Only in the prompt: repetition alone, a negative logit multiplied.
        assert_eq!(process(-1.0, 0.0, IN_PROMPT, &p), -2.0);
        // Never seen: unchanged, but the bias applies first.
        assert_eq!(process(1.0, 3.0, 0, &p), 4.0);
        // Penalties change the greedy pick, and the pick is counted.
        let mut counts = vec![0, 5, 0];
        let pick = sample_row(&[1.0, 3.0, 2.0], &p, &[], Some(&mut counts));
        assert_eq!(pick.token, 2);
        assert_eq!(counts, [0, 5, 1]);
    }

    #[test]
    fn logit_bias_can_force_or_ban_a_token() {
        let logits = [3.0, 1.0, 2.0];
        let greedy = RowParams::default();
        assert_eq!(sample_row(&logits, &greedy, &[(1, 100.0)], None).token, 1);
        assert_eq!(sample_row(&logits, &greedy, &[(0, -100.0)], None).token, 2);
        let sampled = params(1.0, 0, 1.0, 5);
        for pos in 0..100 {
            let p = RowParams {
                position: pos,
                ..sampled
            };
            assert_ne!(sample_row(&logits, &p, &[(0, -100.0)], None).token, 0);
        }
    }

    #[test]
    fn a_mask_limits_greedy_and_draws_to_its_tokens_even_against_the_bias() {
        // 40 tokens; the mask allows 3, 17 and 33, the logits favour others.
        let logits: Vec<f32> = (0..40).map(|t| (t % 7) as f32).collect();
        let mut mask = vec![0u32; mask_words(40)];
        for t in [3usize, 17, 33] {
            mask[t / 32] |= 1 << (t % 32);
        }
        assert!(mask_allows(&mask, 33) && !mask_allows(&mask, 34) && !mask_allows(&mask, 99));
        let greedy = RowParams {
            masked: true,
            ..Default::default()
        };
        assert!(!greedy.is_plain_greedy());
        // 17 % 7 = 3 beats 3 and 33 (5); a bias of +100 on a banned token changes nothing.
        let pick = sample_masked_row(&logits, &greedy, &[(6, 100.0)], Some(&mask), None);
        assert_eq!(pick.token, 33);
        let drawn = RowParams {
            masked: true,
            ..params(2.0, 0, 1.0, 9)
        };
        let mut seen = std::collections::HashSet::new();
        for pos in 0..200 {
            let p = RowParams {
                position: pos,
                ..drawn
            };
            seen.insert(sample_masked_row(&logits, &p, &[], Some(&mask), None).token);
        }
        assert_eq!(seen, [3, 17, 33].into_iter().collect());
        // The words carry the flag.
        assert_eq!(RowParams::from_words(&drawn.to_words()), drawn);
    }

    #[test]
    fn logprobs_are_the_raw_log_softmax() {
        let logits = [2.0f32, 1.0, 4.0, 3.0];
        let p = RowParams {
            logprobs: 1 + 2,
            temperature: 0.5,
            presence_penalty: 1.0,
            slot: 0,
            ..Default::default()
        };
        let mut counts = vec![0; 4];
        let pick = sample_row(&logits, &p, &[], Some(&mut counts));
        let lse = logits.iter().map(|l| l.exp()).sum::<f32>().ln();
        assert!((pick.logprob - (logits[pick.token as usize] - lse)).abs() < 1e-6);
        assert_eq!(pick.top.iter().map(|t| t.0).collect::<Vec<_>>(), [2, 3]);
        assert!((pick.top[0].1 - (4.0 - lse)).abs() < 1e-6);
    }

    #[test]
    fn words_round_trip() {
        let p = RowParams {
            temperature: 0.7,
            top_k: 20,
            top_p: 0.8,
            min_p: 0.05,
            presence_penalty: 1.5,
            frequency_penalty: -0.5,
            repetition_penalty: 1.1,
            seed: 0x1234_5678_9abc_def0,
            position: 77,
            stream: 2,
            slot: 5,
            logprobs: 6,
            bias_start: 3,
            bias_len: 4,
            masked: true,
        };
        assert_eq!(RowParams::from_words(&p.to_words()), p);
    }
}
