#!/usr/bin/env bash
# Every GPU test program, each from its crate's directory (the golden tests find their fixtures
# from there), with VLM_REQUIRE_GPU=1 so that a test unable to reach the GPU fails instead of
# saying SKIPPED. For a GPU machine without Rust: build on a machine with Rust, carry the
# archive, run it there from a checkout of the same commit.
#
#   gateway/bench/gpu_tests.sh build DIR          # with Rust: the programs and vlm, DIR + DIR.tar.gz
#   gateway/bench/gpu_tests.sh run DIR [LOG_DIR]  # on the GPU machine (DIR or DIR.tar.gz)
#
# Run from the repository root. The programs: cuda_twin (every kernel against its CPU twin, at
# small sizes and at the 8B and ViT sizes), golden_vision and golden_text (HF's outputs),
# vision-svc's and llm-svc's batching (batched results equal each request run alone), the
# gateway's stack (the three services give what `vlm run` gives), llm-svc's constrained (answers
# under a JSON schema validate, with the device sampler applying the grammar's masks) and fp8_kv
# (an FP8 KV cache against the f16 one, batched against alone). `run` prints a line a program
# and its passed/failed counts, keeps each program's output in LOG_DIR (default DIR-logs) and
# exits non-zero if any program failed. VLM_REQUIRE_GPU=0 runs them where there is no GPU
# (every GPU test then says SKIPPED): a check of the bundle itself.
set -euo pipefail

usage() {
  sed -n '7,8p' "$0" | sed 's/^# *//' >&2
  exit 2
}
[ $# -ge 2 ] || usage
cmd=$1
dir=${2%.tar.gz}
[ -f Cargo.toml ] && [ -d gateway/bench ] || { echo "run from the repository root" >&2; exit 2; }

# Test programs by crate: cargo's --test names (batching is both vision-svc's and llm-svc's).
packages=(-p vlm-compute -p vision-svc -p llm-svc -p vlm-cli)
tests=(--test cuda_twin --test golden_vision --test batching --test golden_text --test constrained --test fp8_kv --test stack)

case "$cmd" in
build)
  rm -rf "$dir"
  mkdir -p "$dir"
  # cargo names each program's executable in its JSON messages, wherever CARGO_TARGET_DIR puts
  # it: vlm goes to DIR, each test program to DIR/<crate's directory>/<test name>. The other
  # binaries cargo builds for the tests (llm-svc, vision-svc) are left out.
  {
    cargo build --release --message-format=json -p vlm-cli --bin vlm
    cargo test --release --no-run --message-format=json "${packages[@]}" "${tests[@]}"
  } | python3 -c '
import json, os, shutil, sys
root, out = os.getcwd(), sys.argv[1]
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
        continue
    kind, name = msg["target"]["kind"], msg["target"]["name"]
    if kind == ["bin"] and name == "vlm":
        dest = os.path.join(out, name)
    elif kind == ["test"]:
        crate = os.path.relpath(os.path.dirname(msg["manifest_path"]), root)
        os.makedirs(os.path.join(out, crate), exist_ok=True)
        dest = os.path.join(out, crate, name)
    else:
        continue
    shutil.copy2(msg["executable"], dest)
    print(dest)
' "$dir"
  tar czf "$dir.tar.gz" -C "$(dirname "$dir")" "$(basename "$dir")"
  echo "$dir.tar.gz: $(du -h "$dir.tar.gz" | cut -f1)"
  ;;
run)
  if [ ! -d "$dir" ] && [ -f "$dir.tar.gz" ]; then
    tar xzf "$dir.tar.gz" -C "$(dirname "$dir")"
  fi
  [ -d "$dir" ] || { echo "no $dir or $dir.tar.gz: build it first" >&2; exit 2; }
  bundle=$(realpath "$dir")
  logs=$(realpath -m "${3:-$dir-logs}")
  mkdir -p "$logs"
  export VLM_REQUIRE_GPU=${VLM_REQUIRE_GPU:-1}
  failed=0 ran=0
  printf '%-28s %s\n' program result
  for exe in "$bundle"/*/*; do
    [ -f "$exe" ] && [ -x "$exe" ] || continue
    ran=$((ran + 1))
    crate=$(basename "$(dirname "$exe")")
    name=$(basename "$exe")
    log="$logs/$crate-$name.log"
    rc=0
    (cd "$crate" && "$exe" --nocapture) >"$log" 2>&1 || rc=$?
    # Each suite's "test result: ok. P passed; F failed; ...", summed as .ci/run sums them.
    read -r passed fails < <(awk '/^test result:/ { p += $4; f += $6 } END { print p + 0, f + 0 }' "$log")
    if [ "$rc" -ne 0 ]; then
      failed=1
      result="FAILED (exit $rc): $passed passed, $fails failed; see $log"
    else
      result="$passed passed"
    fi
    printf '%-28s %s\n' "$crate/$name" "$result"
  done
  [ "$ran" -gt 0 ] || { echo "no test programs in $bundle" >&2; exit 1; }
  exit "$failed"
  ;;
*)
  usage
  ;;
esac
