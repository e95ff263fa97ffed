//! Records the commit this build is from (`VLM_BUILD_COMMIT`), for the reports of `vlm bench`
//! and `vlm load`: a binary is often copied to a GPU machine and run in another checkout, whose
//! HEAD says nothing about it.
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
    println!("cargo:rustc-env=VLM_BUILD_COMMIT={commit}");
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
