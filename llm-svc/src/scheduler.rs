//! Which sequences run in the next engine step, and how many of their tokens.
//!
//! Continuous batching in the manner of vLLM's scheduler, under two limits per step: at most
//! `max_seqs` sequences and `max_tokens` tokens (the budget that bounds a step's time, so a
//! long prompt is prefilled in chunks between decode steps instead of stalling them).
//!
//! 1. Running sequences first, oldest first: a decoding one takes one token, one still
//!    prefilling takes as much of its prompt as the budget leaves. Each gets the cache blocks
//!    its new tokens need; when none are free, the youngest running sequence is preempted:
//!    its blocks go back (their contents stay cached) and it waits at the front of the queue,
//!    to be recomputed when there is room again.
//! 2. Then waiting sequences, first come first served, while the budget, the sequence limit
//!    and free blocks (less a small reserve for the running ones to grow into) allow. A newly
//!    admitted prompt starts after the longest prefix found in the prefix cache. A prompt whose
//!    next uncached block a running sequence is computing now (the same prompt arriving
//!    together: a request's `n` choices, clients that share a long system prompt) waits until
//!    that block is registered, and is admitted sharing it instead of computing it a second
//!    time; those behind it are not held up.
//!
//! Sequences with one token to compute come first in the plan: a GPU runs them through its
//! split-K decode kernel and the rest through flash attention.

use std::collections::VecDeque;

use crate::kv_cache::{BlockHash, BlockPool};
use crate::request::FinishReason;
use crate::sequence::{Pick, Sequence};
use vlm_compute::sampling::NOT_FINITE;

/// Why a sequence left the running set after a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Left {
    /// An eos token, the token budget or the context.
    Finished(FinishReason),
    /// The sampler found no finite largest logit ([`NOT_FINITE`]): NaN everywhere, as an
    /// activation that overflowed leaves the logits, or an infinity. No token was appended.
    NoFiniteLogits,
}

#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Most sequences in one step.
    pub max_seqs: usize,
    /// Most tokens in one step (decodes count one each).
    pub max_tokens: usize,
    /// Look prompts up in the prefix cache when they are admitted.
    pub prefix_caching: bool,
}

/// One sequence's share of a step: its next `tokens` uncomputed tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Planned {
    /// The sequence (its request's id in the engine).
    pub id: u64,
    /// Where it is in [`Scheduler::running`] while the step runs.
    pub index: usize,
    pub tokens: usize,
}

pub struct Scheduler {
    pub cfg: SchedulerConfig,
    /// Admitted, in admission order (the oldest first; the youngest is preempted first).
    running: Vec<Sequence>,
    /// Not yet admitted (or preempted), in the order they will be.
    waiting: VecDeque<Sequence>,
    /// Preemptions so far.
    pub preemptions: u64,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Self {
        Self {
            cfg,
            running: Vec::new(),
            waiting: VecDeque::new(),
            preemptions: 0,
        }
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// Queues a new request.
    pub fn add(&mut self, seq: Sequence) {
        self.waiting.push_back(seq);
    }

    /// The sequences admitted, in the order a plan's `index` counts them.
    pub fn running(&self) -> &[Sequence] {
        &self.running
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Takes out every sequence, running or waiting, for which `gone` holds (a client that
    /// went away, a deadline passed); running ones keep their blocks for the caller to free.
    pub fn remove_where(&mut self, mut gone: impl FnMut(&Sequence) -> bool) -> Vec<Sequence> {
        let mut out = Vec::new();
        let waiting = std::mem::take(&mut self.waiting);
        for seq in waiting {
            if gone(&seq) {
                out.push(seq);
            } else {
                self.waiting.push_back(seq);
            }
        }
        let mut i = 0;
        while i < self.running.len() {
            if gone(&self.running[i]) {
                out.push(self.running.remove(i));
            } else {
                i += 1;
            }
        }
        out
    }

    /// The head of the queue when nothing runs and still nothing could be planned: a request
    /// that can never fit (a guard: the context is capped by the cache's size).
    pub fn take_unschedulable(&mut self) -> Option<Sequence> {
        if self.running.is_empty() {
            self.waiting.pop_front()
        } else {
            None
        }
    }

    /// Takes the sequences of `plan` out of the running set (their step failed).
    pub fn remove_planned(&mut self, plan: &[Planned]) -> Vec<Sequence> {
        let ids: std::collections::HashSet<u64> = plan.iter().map(|p| p.id).collect();
        self.remove_where(|s| ids.contains(&s.id))
    }

    /// Applies a step's results to its sequences, by request id (vLLM's
    /// `update_from_output`): their computed tokens, the full blocks now in the prefix cache,
    /// and each pick (`picks`, in plan order, an entry for every sequence whose prompt and
    /// tokens are all computed: `None` where its grammar's mask was late) appended and sent to
    /// its caller. Returns the sequences that left, out of the running set, with why: finished
    /// (an eos token, the token budget or the context), or given no token (a pick of
    /// [`NOT_FINITE`], which is not appended).
    pub fn update_from_output(
        &mut self,
        plan: &[Planned],
        picks: Vec<Option<Pick>>,
        pool: &mut BlockPool,
        eos: &[u32],
    ) -> Vec<(Sequence, Left)> {
        let bs = pool.block_size();
        let mut picks = picks.into_iter();
        let mut done = Vec::new();
        for p in plan {
            let i = match self.running.get(p.index) {
                Some(s) if s.id == p.id => p.index,
                _ => match self.running.iter().position(|s| s.id == p.id) {
                    Some(i) => i,
                    None => continue,
                },
            };
            let seq = &mut self.running[i];
            let computed = seq.computed + p.tokens;
            let pick = if computed == seq.tokens.len() {
                picks
                    .next()
                    .expect("an entry for every sequence that sampled")
            } else {
                None
            };
            // A sequence whose grammar's mask was late took no pick: its last token is
            // computed again next step (the same keys and values, into the same slot), and
            // the pick made then is the one this step would have made.
            seq.computed = if computed == seq.tokens.len() && pick.is_none() {
                computed - 1
            } else {
                computed
            };
            seq.hash_full_blocks(bs);
            let full = seq.computed / bs;
            for b in seq.registered..full {
                pool.register(seq.blocks[b], seq.hashes[b]);
            }
            seq.registered = seq.registered.max(full);
            let Some(pick) = pick else {
                continue;
            };
            if pick.token == NOT_FINITE {
                done.push((seq.id, Left::NoFiniteLogits));
                continue;
            }
            seq.push_token(pick);
            if let Some(f) = seq.finish_reason(eos) {
                done.push((seq.id, Left::Finished(f)));
            }
        }
        done.into_iter()
            .map(|(id, f)| {
                let i = self
                    .running
                    .iter()
                    .position(|s| s.id == id)
                    .expect("finished this step");
                (self.running.remove(i), f)
            })
            .collect()
    }

    /// Gives `seq`'s blocks back (last first, so its tail is reused first) and resets it to
    /// be computed again from the start.
    fn preempt(seq: &mut Sequence, pool: &mut BlockPool) {
        pool.release(seq.blocks.drain(..).rev());
        seq.computed = 0;
        seq.registered = 0;
        seq.preemptions += 1;
    }

    /// Whether a running sequence is to compute block `index` of its tokens under `hash` and
    /// has not yet (the block is registered once it has).
    fn computing(running: &[Sequence], index: usize, hash: BlockHash) -> bool {
        running
            .iter()
            .any(|r| r.registered <= index && r.hashes.get(index) == Some(&hash))
    }

    /// Plans the next step, allocating the blocks it needs. Empty when there is nothing to do.
    pub fn schedule(&mut self, pool: &mut BlockPool) -> Vec<Planned> {
        let mut budget = self.cfg.max_tokens;
        let mut plan = Vec::new();
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let seq = &self.running[i];
            let n = seq.uncomputed().min(budget);
            let need = pool
                .blocks_for(seq.computed + n)
                .saturating_sub(seq.blocks.len());
            let granted = loop {
                if let Some(blocks) = pool.allocate(need) {
                    break Some(blocks);
                }
                preempted = true;
                self.preemptions += 1;
                // The youngest goes; if that is this one, it waits and the step is what it is.
                let mut victim = self.running.pop().expect("sequence i is running");
                Self::preempt(&mut victim, pool);
                self.waiting.push_front(victim);
                if self.running.len() == i {
                    break None;
                }
            };
            let Some(blocks) = granted else { break };
            self.running[i].blocks.extend(blocks);
            plan.push(Planned {
                id: self.running[i].id,
                index: i,
                tokens: n,
            });
            budget -= n;
            i += 1;
        }
        // New admissions only when nothing had to give way this step.
        let reserve = pool.capacity() / 100;
        // The next waiting sequence to consider: those before it wait for a running one's
        // blocks.
        let mut next = 0;
        while !preempted && budget > 0 && self.running.len() < self.cfg.max_seqs {
            let Some(seq) = self.waiting.get_mut(next) else {
                break;
            };
            let bs = pool.block_size();
            let mut hit = Vec::new();
            if self.cfg.prefix_caching && seq.computed == 0 {
                seq.hash_full_blocks(bs);
                // At least the last token is computed: its logits pick the next one.
                let usable = (seq.tokens.len() - 1) / bs;
                let cached = pool.cached_prefix(&seq.hashes[..usable]);
                if cached < usable && Self::computing(&self.running, cached, seq.hashes[cached]) {
                    next += 1;
                    continue;
                }
                hit = pool.lookup(&seq.hashes[..usable]);
            }
            let computed = hit.len() * bs;
            let n = (seq.tokens.len() - computed).min(budget);
            let need = pool.blocks_for(computed + n) - hit.len();
            let fresh = if pool.num_free() >= need + reserve {
                pool.allocate(need)
            } else {
                None
            };
            let Some(fresh) = fresh else {
                // Wait for room; do not hold cached blocks meanwhile.
                pool.release(hit.into_iter().rev());
                break;
            };
            let mut seq = self
                .waiting
                .remove(next)
                .expect("sequence `next` is waiting");
            if seq.cached_tokens.is_none() {
                pool.count_lookup(seq.prompt_len, computed.min(seq.prompt_len));
                seq.cached_tokens = Some(computed.min(seq.prompt_len));
            }
            seq.registered = hit.len();
            seq.blocks = hit;
            seq.blocks.extend(fresh);
            seq.computed = computed;
            plan.push(Planned {
                id: seq.id,
                index: self.running.len(),
                tokens: n,
            });
            self.running.push(seq);
            budget -= n;
        }
        // Single-token work first (stable: otherwise oldest first).
        plan.sort_by_key(|p| p.tokens != 1);
        plan
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::mrope::PromptPositions;
    use crate::sampler::SamplingParams;
    use crate::sequence::SequenceLimits;

    /// A step's pick of `token`, with nothing else asked for.
    fn pick(token: u32) -> Option<Pick> {
        Some(Pick {
            token,
            logits: None,
            logprob: None,
        })
    }

    fn seq(id: u64, prompt: usize) -> Sequence {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        std::mem::forget(rx);
        Sequence::new(
            id,
            (0..prompt as u32).map(|t| t + 100 * id as u32).collect(),
            PromptPositions {
                positions: (0..prompt as u32).map(|p| [p; 3]).collect(),
                delta: 0,
            },
            Vec::new(),
            (SamplingParams::greedy(), 0),
            SequenceLimits {
                max_new_tokens: 100,
                max_len: 1000,
                ignore_eos: true,
                return_logits: false,
                deadline: None,
            },
            tx,
            tracing::Span::none(),
        )
    }

    fn sched(max_seqs: usize, max_tokens: usize) -> Scheduler {
        Scheduler::new(SchedulerConfig {
            max_seqs,
            max_tokens,
            prefix_caching: true,
        })
    }

    /// What the engine does after a step: the planned tokens are computed and each sequence
    /// that reached its end gets one more token.
    fn run(s: &mut Scheduler, plan: &[Planned]) {
        for p in plan {
            let seq = &mut s.running[p.index];
            seq.computed += p.tokens;
            if seq.computed == seq.tokens.len() {
                seq.tokens.push(7);
            }
        }
    }

    #[test]
    fn a_sequence_without_a_pick_computes_its_last_token_again() {
        let mut pool = BlockPool::new(64, 4);
        let mut s = sched(8, 100);
        s.waiting.push_back(seq(0, 6));
        s.waiting.push_back(seq(1, 6));
        let plan = s.schedule(&mut pool);
        // Sequence 0's mask was late: no pick; its prompt's last token is computed again.
        let done = s.update_from_output(&plan, vec![None, pick(9)], &mut pool, &[]);
        assert!(done.is_empty());
        assert_eq!((s.running[0].tokens.len(), s.running[0].computed), (6, 5));
        assert_eq!((s.running[1].tokens.len(), s.running[1].computed), (7, 6));
        // Only the full block of computed tokens is in the prefix cache.
        assert_eq!(s.running[0].registered, 1);
        let plan = s.schedule(&mut pool);
        assert_eq!(plan.iter().map(|p| p.tokens).collect::<Vec<_>>(), [1, 1]);
        s.update_from_output(&plan, vec![pick(8), pick(9)], &mut pool, &[]);
        assert_eq!(s.running[0].tokens[6..], [8]);
        assert_eq!(s.running[0].computed, 6);
    }

    #[test]
    fn a_pick_of_no_finite_logit_ends_its_sequence_without_a_token() {
        let mut pool = BlockPool::new(64, 4);
        let mut s = sched(8, 100);
        s.waiting.push_back(seq(0, 6));
        s.waiting.push_back(seq(1, 6));
        let plan = s.schedule(&mut pool);
        let left = s.update_from_output(&plan, vec![pick(NOT_FINITE), pick(9)], &mut pool, &[]);
        assert_eq!(left.len(), 1);
        assert_eq!((left[0].0.id, left[0].1), (0, Left::NoFiniteLogits));
        assert_eq!(left[0].0.tokens.len(), 6, "nothing appended");
        // The other sequence of the step goes on with its token.
        assert_eq!(s.running.len(), 1);
        assert_eq!(s.running[0].tokens[6..], [9]);
    }

    #[test]
    fn long_prompts_are_chunked_under_the_token_budget_and_decodes_go_first() {
        let mut pool = BlockPool::new(64, 4);
        let mut s = sched(8, 10);
        s.waiting.push_back(seq(0, 3));
        s.waiting.push_back(seq(1, 25));
        let plan = s.schedule(&mut pool);
        assert_eq!(
            plan,
            [
                Planned {
                    id: 0,
                    index: 0,
                    tokens: 3
                },
                Planned {
                    id: 1,
                    index: 1,
                    tokens: 7
                }
            ]
        );
        run(&mut s, &plan);
        // Sequence 0 decodes (one token, first); sequence 1 continues its prompt.
        let plan = s.schedule(&mut pool);
        assert_eq!(
            plan,
            [
                Planned {
                    id: 0,
                    index: 0,
                    tokens: 1
                },
                Planned {
                    id: 1,
                    index: 1,
                    tokens: 9
                }
            ]
        );
        assert_eq!(s.running[1].blocks.len(), 4, "16 tokens in blocks of 4");
        assert_eq!(s.running[0].blocks.len(), 1);
    }

    #[test]
    fn the_youngest_is_preempted_when_blocks_run_out_and_resumes_later() {
        // 4 usable blocks of 2 tokens: two sequences of 3-token prompts take 2 blocks each.
        let mut pool = BlockPool::new(5, 2);
        let mut s = sched(8, 100);
        s.waiting.push_back(seq(0, 3));
        s.waiting.push_back(seq(1, 3));
        let plan = s.schedule(&mut pool);
        assert_eq!(plan.len(), 2);
        run(&mut s, &plan);
        // Both decode: token 4 fits in their second blocks.
        let plan = s.schedule(&mut pool);
        assert_eq!(plan.len(), 2);
        run(&mut s, &plan);
        // Token 5 needs a third block each: none free, so sequence 1 gives way.
        let plan = s.schedule(&mut pool);
        assert_eq!(
            plan,
            [Planned {
                id: 0,
                index: 0,
                tokens: 1
            }]
        );
        assert_eq!(s.preemptions, 1);
        assert_eq!(s.waiting.len(), 1);
        let waiting = &s.waiting[0];
        assert_eq!(
            (waiting.id, waiting.computed, waiting.blocks.len()),
            (1, 0, 0)
        );
        assert_eq!(waiting.tokens.len(), 5, "its generated tokens are kept");
        run(&mut s, &plan);
        // Sequence 0 finishes: its blocks come back and sequence 1 is recomputed.
        let done = s.running.remove(0);
        pool.release(done.blocks.iter().rev().copied());
        let plan = s.schedule(&mut pool);
        assert_eq!(
            plan,
            [Planned {
                id: 1,
                index: 0,
                tokens: 5
            }]
        );
    }

    #[test]
    fn admission_stops_at_the_sequence_limit_and_keeps_order() {
        let mut pool = BlockPool::new(64, 4);
        let mut s = sched(2, 100);
        for id in 0..4 {
            s.waiting.push_back(seq(id, 2));
        }
        let plan = s.schedule(&mut pool);
        assert_eq!(plan.len(), 2);
        let ids: Vec<u64> = s.running.iter().map(|q| q.id).collect();
        assert_eq!(ids, [0, 1]);
        assert_eq!(s.waiting.front().unwrap().id, 2);
    }

    #[test]
    fn a_shared_prefix_is_found_in_the_cache_and_not_recomputed() {
        let mut pool = BlockPool::new(64, 4);
        let mut s = sched(8, 100);
        s.waiting.push_back(seq(0, 10));
        let plan = s.schedule(&mut pool);
        run(&mut s, &plan);
        // What the engine does once blocks are computed: register them.
        let first = &mut s.running[0];
        first.hash_full_blocks(4);
        for (b, h) in first.blocks.iter().zip(&first.hashes) {
            pool.register(*b, *h);
        }
        // The same 10-token prompt: its two full blocks are hits, 2 tokens remain.
        s.waiting.push_back(seq(0, 10));
        let plan = s.schedule(&mut pool);
        assert_eq!(
            plan[1],
            Planned {
                id: 0,
                index: 1,
                tokens: 2
            }
        );
        let again = &s.running[1];
        assert_eq!(again.cached_tokens, Some(8));
        assert_eq!(again.blocks[..2], s.running[0].blocks[..2]);
        assert_eq!(pool.stats().hit_tokens, 8);
    }

    #[test]
    fn a_prompt_being_computed_is_waited_for_and_shared_and_others_go_ahead() {
        let mut pool = BlockPool::new(64, 4);
        let mut s = sched(8, 100);
        // Two choices of one request (the same 10 tokens), then another prompt.
        s.waiting.push_back(seq(0, 10));
        s.waiting.push_back(seq(0, 10));
        s.waiting.push_back(seq(1, 10));
        let plan = s.schedule(&mut pool);
        let ids: Vec<u64> = s.running.iter().map(|q| q.id).collect();
        assert_eq!(
            ids,
            [0, 1],
            "the second choice waits, the other prompt does not"
        );
        assert_eq!(plan.iter().map(|p| p.tokens).sum::<usize>(), 20);
        assert_eq!(s.waiting.len(), 1);
        // Nothing computed yet: it still waits.
        assert_eq!(s.schedule(&mut pool).len(), 2);
        assert_eq!(s.waiting.len(), 1);
        // The engine computes and registers the first one's blocks ...
        let plan = [
            Planned {
                id: 0,
                index: 0,
                tokens: 10,
            },
            Planned {
                id: 1,
                index: 1,
                tokens: 10,
            },
        ];
        run(&mut s, &plan);
        for r in &mut s.running {
            r.hash_full_blocks(4);
            for (b, h) in r.blocks.iter().zip(&r.hashes) {
                pool.register(*b, *h);
            }
            r.registered = r.hashes.len();
        }
        // ... and the second choice comes in sharing its two full blocks.
        let plan = s.schedule(&mut pool);
        assert_eq!(
            plan.last(),
            Some(&Planned {
                id: 0,
                index: 2,
                tokens: 2
            })
        );
        let second = &s.running[2];
        assert_eq!(second.cached_tokens, Some(8));
        assert_eq!(second.blocks[..2], s.running[0].blocks[..2]);
    }
}
