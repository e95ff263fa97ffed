#!/usr/bin/env bash
# The whole comparison on a GPU machine, in one call: vlm bench and vlm load, llama.cpp (CUDA:
# llama-bench and llama-batched-bench) and HF transformers at Qwen3-VL-8B's sizes with random
# weights, then the report (tables + plots). vlm load runs greedy and at Qwen3-VL's recommended
# sampling (what real clients send), and llama.cpp's own server (llama-server -np N, the serving
# peer a user would deploy) takes the same sampled text workload over HTTP as vlm does.
#
#   gateway/bench/run_all.sh VLM_BINARY OUT_DIR
#
# Run from the repository root. PEERS (default ../shared/peers) holds llama.cpp's source and
# GGUF writer (see its README). STEPS picks parts: "ours load sampled hf llama server quant
# report" (the default: all).
#   quant   llama-quantize'd Q8_0, Q4_K_M, Q4_0 GGUFs under llama-bench (prefill 4096, tg128),
#           and vlm bench --quantize int8 / int4 (decode batch 1 and 64, prefill 4096)
# LEVELS replaces the concurrencies (default 1,8,32,64,128); LOAD_ARGS replaces the workload
# flags of vlm load (default below); BENCH_ARGS adds flags to
# vlm bench (e.g. "--ttft-image-sides 448,1344").
#
# Time on one H100 (16 cores), part by part, in the order they run (measured 2026-11-25):
#   llama.cpp build   ~4.5 min, in the background from the start at nice 19 (skipped when
#                     WORK holds a build); HF and the GGUF writer run meanwhile
#   hf      HF transformers                                       ~1 min
#   llama   GGUF ~36 s, then (once built) llama-bench x3 and llama-batched-bench ~2 min
#   ours    vlm bench, 8B random weights, after the build: a compile on the same cores slows
#           every row with host work in it                        ~1.2 min
#   load    vlm load, 8B, concurrency 1 to 128, 20 s of requests
#           each plus the drain of the last ones                   ~2 min
#   sampled vlm load at 0.7 / 0.8 / 20, presence 1.5: the same workload, then text only
#           over HTTP (llama-server's workload)                    ~4 min
#   json    vlm load, sampled, a JSON schema on every request (structured outputs, against
#           the sampled part's rates)                              ~2 min
#   server  llama-server with as many slots as the largest level, the same text-only sampled
#           workload over HTTP                                     ~2.5 min
#   quant   llama-quantize Q8_0 / Q4_0 / Q4_K_M 26 / 24 / 83 s, llama-bench ~5 s each, vlm bench
#           --quantize int8 and int4 ~0.5 min each (H200, 2026-11-28)     ~2.5 min
#   report  seconds
# About 12.5 minutes on a fresh machine (the build took 5.5 min on an H200 beside other work),
# 8 with the build in WORK; each part's log is in OUT_DIR. Where one command may run 10
# minutes, run the parts in two commands on the same machine, WORK kept between them (e.g.
# STEPS="hf llama ours load", then STEPS="sampled json server quant report").
set -euo pipefail
vlm=$(realpath "$1")
out=$(realpath -m "$2")
peers=$(realpath -m "${PEERS:-../shared/peers}")
steps=" ${STEPS:-ours load sampled json hf llama server quant report} "
model=deploy/models/qwen3-vl-8b
work=${WORK:-/tmp/vlm-bench}
# The concurrencies vlm load runs and llama-batched-bench's parallel sequences: the same list.
levels=${LEVELS:-1,8,32,64,128}
most=${levels##*,}
# 512-token prompts (ours: drawn from 256-768, mean 512), 128 generated, as llama-batched-bench's
# -npp 512 -ntg 128; one request in 8 carries a 448x448 image (llama-batched-bench has none).
load_args=${LOAD_ARGS:---prompt-tokens 512 --max-tokens 128 --image-every 8 --image-side 448 --duration 20}
# Qwen3-VL's model card's sampling; the text-only HTTP workload both servers take.
sampled_args="--temperature 0.7 --top-p 0.8 --top-k 20 --presence-penalty 1.5"
text_args="--prompt-tokens 512 --max-tokens 128 --image-every 0 --duration 20 --api http"
mkdir -p "$out" "$work"
has() { [[ "$steps" == *" $1 "* ]]; }
part() { echo "== $1 (at ${SECONDS}s)"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt" || true

# The peers' llama.cpp leaves out the web UI's sources (tools/ui), which the server target links
# (llama-ui) and its CMake adds: a stub with no assets serves the API without the pages.
stub_llama_ui() {
  [ -d "$1" ] && return
  mkdir -p "$1"
  cat > "$1/CMakeLists.txt" <<'CMAKE'
add_library(llama-ui STATIC ui.cpp)
set_target_properties(llama-ui PROPERTIES POSITION_INDEPENDENT_CODE ON)
target_include_directories(llama-ui PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
add_custom_target(llama-ui-assets)
CMAKE
  cat > "$1/ui.h" <<'HEADER'
#pragma once
#include <cstddef>
#include <string>
#include <vector>
struct llama_ui_asset {
    std::string name, type, etag;
    const unsigned char * data;
    size_t size;
};
const std::vector<llama_ui_asset> & llama_ui_get_assets();
const llama_ui_asset * llama_ui_find_asset(const std::string & name);
bool llama_ui_use_gzip();
HEADER
  cat > "$1/ui.cpp" <<'SOURCE'
#include "ui.h"
const std::vector<llama_ui_asset> & llama_ui_get_assets() {
    static const std::vector<llama_ui_asset> none;
    return none;
}
const llama_ui_asset * llama_ui_find_asset(const std::string &) { return nullptr; }
bool llama_ui_use_gzip() { return false; }
SOURCE
}
built() {
  [ -x "$work/b/bin/llama-bench" ] && [ -x "$work/b/bin/llama-batched-bench" ] \
    && [ -x "$work/b/bin/llama-server" ] && [ -x "$work/b/bin/llama-quantize" ]
}
# Waits for the background build, if one was started and is not waited for yet.
wait_build() {
  if [ -n "${build_pid:-}" ]; then
    wait "$build_pid" || { tail -20 "$out/llama-build.log"; exit 1; }
    build_pid=
  fi
}
if { has llama || has server || has quant; } && ! built; then
  echo "building llama.cpp in the background ($out/llama-build.log)"
  tar xzf "$peers"/llama.cpp-*.tgz -C "$work"
  stub_llama_ui "$work/llama.cpp/tools/ui"
  setsid nice -n 19 bash -c "cmake -S $work/llama.cpp -B $work/b -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    && cmake --build $work/b -j$(nproc) --target llama-bench llama-batched-bench llama-server llama-quantize" > "$out/llama-build.log" 2>&1 &
  build_pid=$!
fi

if has hf; then
  part "HF transformers"
  python3 gateway/bench/hf_peer.py "$model" "$out/hf.json" 2>&1 | tee "$out/hf.log" \
    || echo "HF peer failed: see $out/hf.log"
fi

gguf() {
  [ -f "$work/q3-8b-f16.gguf" ] || PYTHONPATH="$work/llama.cpp/gguf-py" python3 "$peers/make_qwen3_gguf.py" \
    "$work/llama.cpp/models/ggml-vocab-qwen2.gguf" "$work/q3-8b-f16.gguf" > "$out/llama-gguf.log" 2>&1
}
if has llama; then
  part "llama.cpp"
  gguf
  wait_build
  bench="$work/b/bin/llama-bench -m $work/q3-8b-f16.gguf -ngl 99 -fa 1 -r 3 -o json"
  $bench -p 512,4096 -n 0 > "$out/llama-prefill.json" 2>> "$out/llama.log"
  $bench -p 0 -n 128 > "$out/llama-decode.json" 2>> "$out/llama.log"
  $bench -p 0 -n 128 -d 4096 > "$out/llama-decode-4096.json" 2>> "$out/llama.log"
  # B sequences of 512 prompt tokens prefilled together, then 128 tokens decoded for all of them
  # in lockstep, for each B in $levels; one KV stream per sequence (its default), so the context
  # must hold B x (512 + 128) tokens for the largest B. Results are JSON lines on stdout,
  # everything else on stderr.
  part "llama-batched-bench"
  "$work/b/bin/llama-batched-bench" -m "$work/q3-8b-f16.gguf" -ngl 99 -fa on \
    -c $((most * (512 + 128))) -b 2048 -ub 512 -npp 512 -ntg 128 -npl "$levels" \
    --output-format jsonl > "$out/llama-batched.jsonl" 2>> "$out/llama.log"
  cat "$out/llama-batched.jsonl"
fi

# Ours after llama.cpp's build: sharing the cores with a compile slowed every row with host work
# in it (PNG decoding 1.5 -> 8.1 ms, the ViT at 896 20 -> 30 ms, TTFT 448 17 -> 20 ms on the H100).
wait_build
if has ours; then
  part "vlm bench"
  # shellcheck disable=SC2086 # BENCH_ARGS is a list of flags
  "$vlm" bench --device cuda --model "$model" --random-weights ${BENCH_ARGS:-} \
    --json "$out/ours.json" 2>&1 | tee "$out/ours.log"
fi

if has load; then
  part "vlm load"
  # shellcheck disable=SC2086 # load_args is a list of flags
  "$vlm" load --device cuda --model "$model" --random-weights --concurrency "$levels" $load_args \
    --json "$out/load.json" 2>&1 | tee "$out/load.log" || echo "vlm load failed: see $out/load.log"
fi

if has sampled; then
  part "vlm load, sampled"
  # shellcheck disable=SC2086 # lists of flags
  "$vlm" load --device cuda --model "$model" --random-weights --concurrency "$levels" $load_args \
    $sampled_args --json "$out/load-sampled.json" 2>&1 | tee "$out/load-sampled.log" \
    || echo "vlm load failed: see $out/load-sampled.log"
  part "vlm load, sampled, text only over HTTP"
  # shellcheck disable=SC2086
  "$vlm" load --device cuda --model "$model" --random-weights --concurrency "$levels" $text_args \
    $sampled_args --json "$out/load-text.json" 2>&1 | tee "$out/load-text.log" \
    || echo "vlm load failed: see $out/load-text.log"
fi

if has json; then
  part "vlm load, sampled, a JSON schema on every request"
  # shellcheck disable=SC2086 # lists of flags
  "$vlm" load --device cuda --model "$model" --random-weights --concurrency "$levels" $load_args \
    $sampled_args --json-schema --json "$out/load-json.json" 2>&1 | tee "$out/load-json.log" \
    || echo "vlm load failed: see $out/load-json.log"
fi

if has server; then
  part "llama-server under vlm load"
  gguf
  wait_build
  # One slot per client of the largest level, each with room for a prompt and its answer.
  "$work/b/bin/llama-server" -m "$work/q3-8b-f16.gguf" -ngl 99 -fa on -np "$most" \
    -c $((most * (768 + 128 + 64))) --port 8091 > "$out/llama-server.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 120); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8091/health')" 2> /dev/null && break
    sleep 1
  done
  # shellcheck disable=SC2086
  "$vlm" load --http http://127.0.0.1:8091 --model "$model" --concurrency "$levels" $text_args \
    $sampled_args --json "$out/server-load.json" 2>&1 | tee "$out/server-load.log" \
    || echo "vlm load against llama-server failed: see $out/server-load.log"
  kill "$server_pid" 2> /dev/null || true
fi
if has quant; then
  part "weight formats: llama.cpp Q8_0 / Q4_K_M / Q4_0, vlm --quantize int8 / int4"
  gguf
  wait_build
  for q in Q8_0 Q4_K_M Q4_0; do
    "$work/b/bin/llama-quantize" "$work/q3-8b-f16.gguf" "$work/q3-8b-$q.gguf" "$q" \
      >> "$out/llama-quantize.log" 2>&1
    "$work/b/bin/llama-bench" -m "$work/q3-8b-$q.gguf" -ngl 99 -fa 1 -r 3 -o json -p 4096 -n 128 \
      > "$out/llama-$q.json" 2>> "$out/llama.log"
    rm -f "$work/q3-8b-$q.gguf"
  done
  for q in int8 int4; do
    "$vlm" bench --device cuda --model "$model" --random-weights --quantize "$q" --no-gateway \
      --greedy-only --image-sides '' --ttft-image-sides '' --prefill-tokens 4096 \
      --decode-contexts 512 --decode-batches 1,64 --json "$out/ours-$q.json" 2>&1 \
      | tee "$out/ours-$q.log"
  done
fi
rm -f "$work/q3-8b-f16.gguf"

if has report; then
  part "report"
  python3 gateway/bench/report.py "$out/ours.json" --hf "$out/hf.json" \
    --llama "$out/llama-prefill.json" "$out/llama-decode.json" "$out/llama-decode-4096.json" \
    --load "$out/load.json" --llama-batched "$out/llama-batched.jsonl" \
    --load-sampled "$out/load-sampled.json" --load-text "$out/load-text.json" \
    --server-load "$out/server-load.json" --load-json "$out/load-json.json" \
    --quant int8="$out/ours-int8.json" int4="$out/ours-int4.json" \
    --llama-quant Q8_0="$out/llama-Q8_0.json" Q4_K_M="$out/llama-Q4_K_M.json" \
      Q4_0="$out/llama-Q4_0.json" \
    --out "$out"
fi
echo "done in ${SECONDS}s"
