//! Records the commit this build is from (`VLM_BUILD_COMMIT`), for the reports of `vlm bench`
//! and `vlm load`: a binary is often copied to a GPU machine and run in another checkout, whose
//! HEAD says nothing about it. A build with changes to tracked files not yet committed is
//! `<commit>-dirty`, so that a report never names a commit whose code it did not run.
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
        .filter(|s| !s.is_empty())
}

fn main() {
    let commit = git(&["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some();
    let suffix = if dirty { "-dirty" } else { "" };
    println!("cargo:rustc-env=VLM_BUILD_COMMIT={commit}{suffix}");
    // Again when a tracked file changes (the tree's top-level entries, scanned by cargo),
    // so that the suffix follows edits and commits.
    if let Some(top) = git(&["rev-parse", "--show-toplevel"]) {
        for entry in git(&["ls-tree", "--full-tree", "--name-only", "HEAD"])
            .unwrap_or_default()
            .lines()
        {
            println!("cargo:rerun-if-changed={top}/{entry}");
        }
    }
    // Again when HEAD moves: a commit, a checkout (a worktree keeps HEAD in its own git dir,
    // branches in the common one).
    if let (Some(dir), Some(common)) = (
        git(&["rev-parse", "--absolute-git-dir"]),
        git(&["rev-parse", "--path-format=absolute", "--git-common-dir"]),
    ) {
        let branch = git(&["symbolic-ref", "-q", "HEAD"]);
        let files = [
            Some(format!("{dir}/HEAD")),
            Some(format!("{common}/packed-refs")),
            branch.map(|b| format!("{common}/{b}")),
        ];
        // Only files that exist: cargo reruns the script on every build for one that does not.
        for file in files.into_iter().flatten() {
            if std::path::Path::new(&file).exists() {
                println!("cargo:rerun-if-changed={file}");
            }
        }
    } else {
        println!("cargo:rerun-if-changed=build.rs");
    }
}
