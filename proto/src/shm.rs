//! The same-host path for embeddings: vision-svc writes an image's packed embeddings once into
//! a shared-memory segment (a file in `/dev/shm`), the gateway passes its name on, and llm-svc
//! maps it and reads the tensors in place, instead of the bytes crossing gRPC twice.
//!
//! It is negotiated, never assumed: llm-svc answers every Generate with its [`domain`] (the
//! boot and the `/dev/shm` it sees) in the `vlm-shm-domain` response header; the gateway asks
//! vision-svc for shared memory only once every llm-svc replica has named one domain, and
//! vision-svc uses it only when that domain is its own. Anywhere else (another host, a
//! container with its own `/dev/shm`, not Linux) the bytes go inside the messages as before.
//!
//! Segments never outlive their use: llm-svc removes a segment as soon as it has mapped it
//! (the mapping stays readable); the gateway removes the segments of a request that failed
//! before llm-svc took it; and vision-svc sweeps its own segments older than
//! [`SEGMENT_TTL`] (a gateway killed between the two calls) and, at start, those of its
//! earlier runs.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;

/// Every segment's name starts with this, then the creating process's id.
const PREFIX: &str = "vlm-emb-";

/// How long a segment may wait for llm-svc before vision-svc removes it: far longer than the
/// hop through the gateway takes, short enough that segments of dead requests do not pile up.
pub const SEGMENT_TTL: Duration = Duration::from_secs(60);

fn dir() -> &'static Path {
    Path::new("/dev/shm")
}

/// What identifies the shared memory this process sees: the kernel's boot id, the device
/// and inode of `/dev/shm`, and the user it runs as. Two processes with the same domain can
/// pass segments by name; containers with their own `/dev/shm`, or other hosts, differ. `None`
/// where there is no `/dev/shm` to use.
pub fn domain() -> Option<String> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::MetadataExt;
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let shm = std::fs::metadata(dir()).ok()?;
        if !shm.is_dir() {
            return None;
        }
        // Segments are readable by their owner only: a reader under another user is another
        // domain. /proc/self belongs to this process's effective user.
        let uid = std::fs::metadata("/proc/self").ok()?.uid();
        Some(format!("{}:{}:{}:{uid}", boot.trim(), shm.dev(), shm.ino()))
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// Whether `name` is one of ours: the prefix, then digits, dashes and hex only (no path).
fn valid_name(name: &str) -> bool {
    name.strip_prefix(PREFIX).is_some_and(|rest| {
        !rest.is_empty() && rest.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
    })
}

fn path_of(name: &str) -> Result<PathBuf, String> {
    if valid_name(name) {
        Ok(dir().join(name))
    } else {
        Err(format!("{name:?} is not a shared-memory segment name"))
    }
}

/// Writes `parts` one after another into a new segment; returns its name and each part's
/// offset.
pub fn write(parts: &[&[u8]]) -> std::io::Result<(String, Vec<u64>)> {
    use std::io::Write;
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = format!(
        "{PREFIX}{}-{:x}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        // Only the same user (the other services) may read it.
        options.mode(0o600);
    }
    let path = dir().join(&name);
    let written = (|| {
        let mut file = options.open(&path)?;
        let mut offsets = Vec::with_capacity(parts.len());
        let mut at = 0u64;
        for part in parts {
            offsets.push(at);
            file.write_all(part)?;
            at += part.len() as u64;
        }
        Ok(offsets)
    })();
    match written {
        Ok(offsets) => Ok((name, offsets)),
        Err(e) => {
            let _ = std::fs::remove_file(&path);
            Err(e)
        }
    }
}

/// Maps segment `name` and removes its name (the mapping stays readable until the returned
/// bytes, and every slice of them, are dropped).
pub fn take(name: &str) -> Result<Bytes, String> {
    let path = path_of(name)?;
    let file = std::fs::File::open(&path)
        .map_err(|e| format!("cannot open shared-memory segment {name}: {e}"))?;
    let _ = std::fs::remove_file(&path);
    if file.metadata().map(|m| m.len()).unwrap_or(0) == 0 {
        return Ok(Bytes::new());
    }
    // Populated now, in one call, by the thread that unpacks the request: otherwise every
    // page would fault in on first touch, in the engine's loop as it uploads the rows.
    // SAFETY: the segment is written completely before its name is sent, and no process
    // writes it again: the map is of bytes that do not change.
    let map = unsafe { memmap2::MmapOptions::new().populate().map(&file) }
        .map_err(|e| format!("cannot map shared-memory segment {name}: {e}"))?;
    Ok(Bytes::from_owner(map))
}

/// Removes segment `name` if it is still there (a request that failed before llm-svc took it).
pub fn remove(name: &str) {
    if let Ok(path) = path_of(name) {
        let _ = std::fs::remove_file(path);
    }
}

/// A segment a request holds until llm-svc has taken it: dropped without [`Segment::keep`]
/// (the request failed or was cancelled on the way), it removes the segment.
#[derive(Debug, Default)]
pub struct Segment(Option<String>);

impl Segment {
    pub fn new(name: &str) -> Self {
        Self((!name.is_empty()).then(|| name.to_string()))
    }

    /// llm-svc has the segment: leave it to llm-svc.
    pub fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if let Some(name) = self.0.take() {
            remove(&name);
        }
    }
}

/// Removes this process's segments older than `ttl`, and every segment of a process that is
/// no longer running. Returns how many it removed.
pub fn sweep(ttl: Duration) -> usize {
    let Ok(entries) = std::fs::read_dir(dir()) else {
        return 0;
    };
    let me = std::process::id();
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str().filter(|n| valid_name(n)) else {
            continue;
        };
        let pid: Option<u32> = name[PREFIX.len()..]
            .split('-')
            .next()
            .and_then(|p| p.parse().ok());
        let stale = match pid {
            Some(pid) if pid == me => entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > ttl),
            Some(pid) => !Path::new(&format!("/proc/{pid}")).exists(),
            None => false,
        };
        if stale && std::fs::remove_file(entry.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// This process's segments in `/dev/shm` now (tests).
pub fn segments_of(pid: u32) -> Vec<String> {
    let prefix = format!("{PREFIX}{pid}-");
    std::fs::read_dir(dir())
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn a_segment_is_read_once_then_gone_and_names_are_checked() {
        let Some(_) = domain() else {
            vlm_compute::skip::note(&"no /dev/shm here");
            return;
        };
        let (name, offsets) = write(&[b"abc", b"", b"defg"]).unwrap();
        assert_eq!(offsets, vec![0, 3, 3]);
        assert!(segments_of(std::process::id()).contains(&name));
        let bytes = take(&name).unwrap();
        assert_eq!(&bytes[..], b"abcdefg");
        assert!(
            !segments_of(std::process::id()).contains(&name),
            "removed once mapped"
        );
        assert!(take(&name).unwrap_err().contains("cannot open"));
        for bad in ["../etc/passwd", "vlm-emb-../../x", "other-1-2", "vlm-emb-"] {
            assert!(
                take(bad).unwrap_err().contains("not a shared-memory"),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_sweep_removes_old_segments_and_those_of_dead_processes() {
        let Some(_) = domain() else {
            vlm_compute::skip::note(&"no /dev/shm here");
            return;
        };
        let (mine, _) = write(&[b"x"]).unwrap();
        // No process has this id (above the kernel's pid_max).
        let dead = dir().join(format!("{PREFIX}4294967-1"));
        std::fs::write(&dead, b"y").unwrap();
        sweep(SEGMENT_TTL);
        assert!(!dead.exists(), "a dead process's segment goes");
        assert!(dir().join(&mine).exists(), "a fresh one of ours stays");
        // Aged past its time (other tests' fresh segments are left alone).
        let old = std::time::SystemTime::now() - 2 * SEGMENT_TTL;
        std::fs::File::options()
            .write(true)
            .open(dir().join(&mine))
            .unwrap()
            .set_modified(old)
            .unwrap();
        sweep(SEGMENT_TTL);
        assert!(!dir().join(&mine).exists(), "past its time it goes");
    }
}
