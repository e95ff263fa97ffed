//! A global allocator that counts live heap bytes and stops the process when one allocation,
//! or everything live, passes a cap: how a fuzz run catches an input that makes the code
//! allocate without bound (a header claiming 10^12 elements, a length read as u64) before the
//! machine runs out of memory.
//!
//! Allocators may not unwind, so an allocation over the cap prints what happened and where the
//! input being run is saved (the runner writes each input to `artifacts/<target>/current`
//! before running it), then aborts; the test that ran it fails.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Default cap, for one allocation and for the live total: 2 GiB. The largest legitimate
/// allocation on these paths is a decoded 64 Mpx image (256 MiB as RGBA).
pub const DEFAULT_CAP_BYTES: usize = 2 << 30;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static CAP: AtomicUsize = AtomicUsize::new(DEFAULT_CAP_BYTES);

thread_local! {
    /// The fuzz target this thread runs, for the message when the cap is hit.
    static TARGET: Cell<&'static str> = const { Cell::new("") };
}

/// [`System`] with a byte count and a cap; install it with `#[global_allocator]`.
pub struct CappedAlloc;

impl CappedAlloc {
    /// Sets the cap (bytes) for single allocations and for the live total.
    pub fn set_cap(bytes: usize) {
        CAP.store(bytes, Ordering::Relaxed);
    }

    pub fn cap() -> usize {
        CAP.load(Ordering::Relaxed)
    }

    /// Bytes allocated and not yet freed.
    pub fn live() -> usize {
        LIVE.load(Ordering::Relaxed)
    }

    /// Most bytes live at once since the last [`CappedAlloc::reset_peak`].
    pub fn peak() -> usize {
        PEAK.load(Ordering::Relaxed)
    }

    pub fn reset_peak() {
        PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    /// Names the target the calling thread runs, for the over-cap message.
    pub fn set_thread_target(name: &'static str) {
        TARGET.with(|t| t.set(name));
    }

    fn admit(size: usize) {
        let cap = CAP.load(Ordering::Relaxed);
        let live = LIVE.fetch_add(size, Ordering::Relaxed) + size;
        PEAK.fetch_max(live, Ordering::Relaxed);
        if size > cap || live > cap {
            over_cap(size, live, cap);
        }
    }
}

#[cold]
fn over_cap(size: usize, live: usize, cap: usize) -> ! {
    // No allocation from here on: the message is formatted straight to stderr.
    let target = TARGET.try_with(|t| t.get()).unwrap_or("");
    eprintln!(
        "\nFUZZ FAILURE (unbounded allocation): an allocation of {size} bytes brings the live heap to {live} bytes, over the cap of {cap} bytes"
    );
    // Copy `current` before running again: the next run overwrites it.
    if target.is_empty() {
        // A pool thread (rayon) working for one of the targets running now.
        eprintln!("the input each running target was given is in fuzz/artifacts/<target>/current");
        eprintln!(
            "replay: cargo run -p vlm-fuzz -- replay <target> fuzz/artifacts/<target>/current"
        );
    } else {
        eprintln!("target {target}: the input is in fuzz/artifacts/{target}/current");
        eprintln!(
            "replay: cargo run -p vlm-fuzz -- replay {target} fuzz/artifacts/{target}/current"
        );
    }
    std::process::abort()
}

unsafe impl GlobalAlloc for CappedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        Self::admit(layout.size());
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        Self::admit(layout.size());
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() {
            Self::admit(new_size - layout.size());
            // A single buffer grown past the cap is one allocation past it.
            if new_size > CAP.load(Ordering::Relaxed) {
                over_cap(
                    new_size,
                    LIVE.load(Ordering::Relaxed),
                    CAP.load(Ordering::Relaxed),
                );
            }
        } else {
            LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
        }
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}
