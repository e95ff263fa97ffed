//! A thread that owns a model's device state (weights, KV cache, recorded steps) and frees it
//! when its loop ends; its handle waits for that when dropped.
//!
//! The services' loops (llm-svc's engine, vision-svc's encoder) end when their last handle
//! drops, and then free their CUDA objects on their own thread. Left detached, a loop ended as
//! the process was exiting could still be freeing them while the CUDA driver tore itself down
//! at exit: GPU test programs crashed (SIGSEGV) after printing that every test passed. So the
//! handle waits for the thread, for at most [`OwnerThread::WAIT`]: a loop still serving
//! requests whose callers hold on past that is left to finish alone, with a warning, rather
//! than hanging whoever dropped the handle.

use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::Duration;

/// The handle: dropping it waits for the thread (see the module's docs).
pub struct OwnerThread {
    name: String,
    /// Disconnected when the thread's closure has returned or unwound, its state freed. (In a
    /// mutex only so that handles can be shared: drop reads it through `&mut`.)
    done: Mutex<Receiver<()>>,
    handle: Option<JoinHandle<()>>,
}

impl OwnerThread {
    /// How long a dropped handle waits for its thread.
    pub const WAIT: Duration = Duration::from_secs(10);

    /// Runs `f` on a new thread named `name`. `f` should end once its input's senders are
    /// gone: the handle is to be dropped after them (a struct's fields drop in order, so
    /// declare the handle after the sender).
    pub fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> std::io::Result<Self> {
        let (finished, done) = channel::<()>();
        let handle = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                // Dropped after f's state, also when f panics.
                let _finished = finished;
                f();
            })?;
        Ok(Self {
            name: name.to_owned(),
            done: Mutex::new(done),
            handle: Some(handle),
        })
    }
}

impl Drop for OwnerThread {
    fn drop(&mut self) {
        let done = self.done.get_mut().unwrap_or_else(|e| e.into_inner());
        match done.recv_timeout(Self::WAIT) {
            Err(RecvTimeoutError::Disconnected) | Ok(()) => {
                if let Some(handle) = self.handle.take() {
                    // It has returned: joining only collects it (a panic was reported already).
                    let _ = handle.join();
                }
            }
            Err(RecvTimeoutError::Timeout) => tracing::warn!(
                thread = %self.name,
                "still running {:?} after its handle was dropped: left to finish alone",
                Self::WAIT
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::OwnerThread;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    /// Dropping the handle waits until the thread's state is freed: the flag its state sets
    /// on drop is up when the drop returns. A panicking thread is waited for too.
    #[test]
    fn dropping_the_handle_waits_for_the_state_to_be_freed() {
        struct State(Arc<AtomicBool>);
        impl Drop for State {
            fn drop(&mut self) {
                std::thread::sleep(Duration::from_millis(50));
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let freed = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let state = State(freed.clone());
        let thread = OwnerThread::spawn("test-owner", move || {
            let _state = state;
            while rx.recv().is_ok() {}
        })
        .unwrap();
        drop(tx);
        drop(thread);
        assert!(
            freed.load(Ordering::SeqCst),
            "dropped before the state was freed"
        );

        let thread = OwnerThread::spawn("test-panics", || panic!("the loop failed")).unwrap();
        drop(thread);
    }
}
