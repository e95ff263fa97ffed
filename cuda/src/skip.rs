//! A test that cannot run here (no GPU, no `/dev/shm`, a checker not installed) says so instead
//! of passing silently: `SKIPPED: why` on stderr, past the harness's capture, and, where
//! `VLM_SKIP_LOG` names a file (`.ci/run` sets it), a line `test<TAB>why` appended to it, so the
//! run's summary counts skipped tests apart from passed ones.

/// Records that the calling test skips, and why.
pub fn note(why: &dyn std::fmt::Display) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED: {why}");
    if let Some(path) = std::env::var_os("VLM_SKIP_LOG").filter(|p| !p.is_empty()) {
        // The test program and the test: names repeat across programs.
        let program = std::env::current_exe()
            .ok()
            .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
            .unwrap_or_default();
        let test = std::thread::current().name().unwrap_or("?").to_string();
        let test = format!("{program} {test}");
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            // One write a line: lines of tests running at once do not interleave.
            let _ = f.write_all(format!("{test}\t{why}\n").as_bytes());
        }
    }
}
