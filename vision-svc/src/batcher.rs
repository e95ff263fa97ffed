//! The encoder loop: one thread per device runs the ViT for every request of the service,
//! several images per pass.
//!
//! ```text
//! handler ─preprocess (blocking thread)─▶ Batcher::encode ─▶ queue
//!   loop: every queued image up to the patch budget (callers that left are skipped)
//!     ─▶ VisionModel::forward_batch, once ─▶ each caller its own output (oneshot)
//! ```
//! While a pass runs, new images queue for the next one. A loop that is alone on its device
//! gives the device memory its allocator cached back once it has been idle a while (a large
//! image's peak would otherwise stay held for the life of the process). Images are taken in
//! arrival order and never overtake each other, so a large image is not starved by a stream of
//! small ones; an image over the budget on its own runs alone. Each image gets one
//! `vision_encode` span, under its request's span, covering the pass it ran in and recording
//! how many images and patches that pass held.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, OwnedSemaphorePermit};
use tracing::{info_span, Span};
use vlm_compute::owner_thread::OwnerThread;
use vlm_compute::Backend;

use crate::metrics::VisionMetrics;
use crate::{Delivery, Error, Patches, VisionEncoder, VisionOutput};

/// An image waiting for its pass.
struct QueuedImage {
    patches: Patches,
    delivery: Delivery,
    caller: Caller,
}

/// Who waits for an image's output, and what the image holds while it is in the service.
struct Caller {
    /// The request's span (`vision.encode`); the image's `vision_encode` span goes under it.
    span: Span,
    queued_at: Instant,
    reply: oneshot::Sender<Result<VisionOutput, Error>>,
    /// The image's place in the service's `max_concurrent`, given back when the image leaves
    /// the queue: answered, failed, or skipped because its caller has gone.
    _permit: OwnedSemaphorePermit,
}

/// A handle on the encoder loop; the loop ends when the handle is dropped, and the drop waits
/// for it to let go of the encoder ([`OwnerThread`]).
pub struct Batcher {
    queue: Sender<QueuedImage>,
    /// After `queue`: fields drop in order, so the channel is closed before the drop waits.
    _thread: OwnerThread,
}

impl Batcher {
    /// Starts the loop on a thread of its own, running `encoder`'s model over at most
    /// `max_batch_patches` patches per pass (an image with more runs alone). `idle_trim`: once
    /// no image has come for that long, the device's cached memory is given back
    /// ([`vlm_compute::release_idle_memory`]); `None` where another loop owns that (an llm-svc
    /// engine in the same process, whose device pool this is too).
    pub fn start<B: Backend>(
        encoder: Arc<VisionEncoder<B>>,
        max_batch_patches: usize,
        idle_trim: Option<Duration>,
        metrics: VisionMetrics,
    ) -> std::io::Result<Self> {
        let (queue, waiting) = std::sync::mpsc::channel();
        let thread = OwnerThread::spawn("vision-encoder", move || {
            run(
                &encoder,
                waiting,
                max_batch_patches.max(1),
                idle_trim,
                &metrics,
            )
        })?;
        Ok(Self {
            queue,
            _thread: thread,
        })
    }

    /// Queues `patches` for the next pass and waits for its output. `span` is the request's;
    /// `permit` is the request's place in the service, held until the image leaves the queue.
    /// Dropping the returned future (the client went away) takes the image out of any pass
    /// that has not started yet.
    pub async fn encode(
        &self,
        patches: Patches,
        delivery: Delivery,
        permit: OwnedSemaphorePermit,
        span: Span,
    ) -> Result<VisionOutput, Error> {
        let (reply, output) = oneshot::channel();
        let caller = Caller {
            span,
            queued_at: Instant::now(),
            reply,
            _permit: permit,
        };
        self.queue
            .send(QueuedImage {
                patches,
                delivery,
                caller,
            })
            .map_err(|_| Error::Encoder("the vision encoder loop has stopped".into()))?;
        output.await.map_err(|_| {
            Error::Encoder("the vision encoder loop dropped the image unanswered".into())
        })?
    }
}

/// The loop: wait for an image, gather what else has queued, run one pass, repeat; ends when
/// the [`Batcher`] is dropped. With `idle_trim`, a wait that lasts that long trims the device's
/// memory pool once, then goes on waiting.
fn run<B: Backend>(
    encoder: &VisionEncoder<B>,
    incoming: Receiver<QueuedImage>,
    max_batch_patches: usize,
    idle_trim: Option<Duration>,
    metrics: &VisionMetrics,
) {
    let mut queue = VecDeque::new();
    // Whether a pass has run since the last trim: an idle loop trims once, not every period.
    let mut worked = false;
    loop {
        if queue.is_empty() {
            let next = match idle_trim.filter(|_| worked) {
                Some(after) => match incoming.recv_timeout(after) {
                    Ok(image) => Some(image),
                    Err(RecvTimeoutError::Timeout) => {
                        vlm_compute::release_idle_memory(encoder.model.backend(), "vision");
                        worked = false;
                        incoming.recv().ok()
                    }
                    Err(RecvTimeoutError::Disconnected) => None,
                },
                None => incoming.recv().ok(),
            };
            match next {
                Some(image) => queue.push_back(image),
                None => return,
            }
        }
        queue.extend(incoming.try_iter());
        let batch = take_batch(
            &mut queue,
            max_batch_patches,
            |image| image.patches.rows(),
            |image| image.caller.reply.is_closed(),
        );
        if !batch.is_empty() {
            run_pass(encoder, batch, metrics);
            worked = true;
        }
    }
}

/// Takes the images of the next pass from the front of `queue`: in order, while their patches
/// fit in `budget` (the first always does), dropping on the way those whose caller `gone`.
fn take_batch<T>(
    queue: &mut VecDeque<T>,
    budget: usize,
    patches: impl Fn(&T) -> usize,
    gone: impl Fn(&T) -> bool,
) -> Vec<T> {
    let mut batch = Vec::new();
    let mut total = 0;
    while let Some(next) = queue.front() {
        if gone(next) {
            queue.pop_front();
            continue;
        }
        let n = patches(next);
        if !batch.is_empty() && total + n > budget {
            break;
        }
        total += n;
        batch.extend(queue.pop_front());
    }
    batch
}

/// Runs one pass over `batch` and answers each caller. A failure (or a panic) of the pass
/// fails every image in it; the loop goes on with the next.
fn run_pass<B: Backend>(
    encoder: &VisionEncoder<B>,
    batch: Vec<QueuedImage>,
    metrics: &VisionMetrics,
) {
    let (mut patches, mut deliveries, mut callers) = (Vec::new(), Vec::new(), Vec::new());
    for image in batch {
        patches.push(image.patches);
        deliveries.push(image.delivery);
        callers.push(image.caller);
    }
    let batch_patches: usize = patches.iter().map(|p| p.rows()).sum();
    metrics.batch_images.observe(patches.len() as f64);
    let spans: Vec<Span> = patches
        .iter()
        .zip(&callers)
        .map(|(p, c)| {
            info_span!(
                parent: &c.span,
                "vision_encode",
                patches = p.rows(),
                batch_images = patches.len(),
                batch_patches,
                queued_ms = c.queued_at.elapsed().as_secs_f64() * 1e3
            )
        })
        .collect();
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
        encoder.model.forward_delivered(&patches, &deliveries)
    }));
    // Every caller of a failed pass gets the same message (the error itself is not Clone).
    let failed = |what: String| -> Vec<Result<VisionOutput, Error>> {
        (0..callers.len())
            .map(|_| Err(Error::Encoder(what.clone())))
            .collect()
    };
    let outputs: Vec<Result<VisionOutput, Error>> = match result {
        Ok(Ok(outputs)) => outputs.into_iter().map(Ok).collect(),
        Ok(Err(e)) => failed(format!("the vision encoder failed: {e}")),
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("a panic");
            failed(format!("the vision encoder failed: {what}"))
        }
    };
    for ((caller, span), output) in callers.into_iter().zip(spans).zip(outputs) {
        if let Err(e) = &output {
            tracing::error!(parent: &span, error = %e, "vision pass failed");
        }
        // The span ends with the pass, and the place in the service is given back, before
        // the caller goes on (a client that has its answer may send the next image at once).
        drop(span);
        let Caller { reply, _permit, .. } = caller;
        drop(_permit);
        // A caller that left during the pass no longer wants its output.
        let _ = reply.send(output);
    }
}

#[cfg(test)]
mod tests {
    use super::take_batch;
    use std::collections::VecDeque;

    /// (patches, caller gone) pairs.
    fn queue(items: &[(usize, bool)]) -> VecDeque<(usize, bool)> {
        items.iter().copied().collect()
    }

    fn take(q: &mut VecDeque<(usize, bool)>, budget: usize) -> Vec<usize> {
        take_batch(q, budget, |i| i.0, |i| i.1)
            .into_iter()
            .map(|i| i.0)
            .collect()
    }

    #[test]
    fn takes_images_in_order_while_they_fit_the_budget() {
        let mut q = queue(&[(300, false), (500, false), (200, false), (100, false)]);
        assert_eq!(take(&mut q, 1000), [300, 500, 200]);
        assert_eq!(take(&mut q, 1000), [100]);
        assert!(q.is_empty());
    }

    #[test]
    fn an_image_that_does_not_fit_waits_and_later_ones_do_not_overtake_it() {
        let mut q = queue(&[(600, false), (600, false), (10, false)]);
        assert_eq!(take(&mut q, 1000), [600]);
        assert_eq!(take(&mut q, 1000), [600, 10]);
    }

    #[test]
    fn an_image_over_the_budget_runs_alone() {
        let mut q = queue(&[(5000, false), (10, false)]);
        assert_eq!(take(&mut q, 1000), [5000]);
        assert_eq!(take(&mut q, 1000), [10]);
    }

    #[test]
    fn images_whose_caller_left_are_dropped_without_a_pass() {
        let mut q = queue(&[(100, true), (900, false), (800, true), (100, false)]);
        assert_eq!(take(&mut q, 1000), [900, 100]);
        assert!(q.is_empty());
        let mut q = queue(&[(100, true)]);
        assert!(take(&mut q, 1000).is_empty());
        assert!(q.is_empty());
    }
}
