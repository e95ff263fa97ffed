#!/usr/bin/env bash
# The whole comparison on a GPU machine, in one call: vlm bench, llama.cpp (CUDA) and HF
# transformers at Qwen3-VL-8B's sizes with random weights, then the report (table + plot).
#
#   gateway/bench/run_all.sh VLM_BINARY OUT_DIR
#
# Run from the repository root. PEERS (default ../shared/peers) holds llama.cpp's source and
# GGUF writer (see its README). STEPS picks parts: "ours hf llama report" (the default: all).
# llama.cpp builds in the background (~4.5 min on 16 cores) while ours and HF's run, so the
# whole fits one 10-minute device command; each part's log is in OUT_DIR.
set -euo pipefail
vlm=$(realpath "$1")
out=$(realpath -m "$2")
peers=$(realpath "${PEERS:-../shared/peers}")
steps=" ${STEPS:-ours hf llama report} "
model=deploy/models/qwen3-vl-8b
work=${WORK:-/tmp/vlm-bench}
mkdir -p "$out" "$work"
has() { [[ "$steps" == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt" || true

if has llama && [ ! -x "$work/b/bin/llama-bench" ]; then
  echo "building llama.cpp in the background ($out/llama-build.log)"
  tar xzf "$peers"/llama.cpp-*.tgz -C "$work"
  setsid bash -c "cmake -S $work/llama.cpp -B $work/b -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    && cmake --build $work/b -j$(nproc) --target llama-bench" > "$out/llama-build.log" 2>&1 &
  build_pid=$!
fi

if has ours; then
  echo "== vlm bench"
  "$vlm" bench --device cuda --model "$model" --random-weights --json "$out/ours.json" \
    2>&1 | tee "$out/ours.log"
fi

if has hf; then
  echo "== HF transformers"
  python3 gateway/bench/hf_peer.py "$model" "$out/hf.json" 2>&1 | tee "$out/hf.log" \
    || echo "HF peer failed: see $out/hf.log"
fi

if has llama; then
  echo "== llama.cpp"
  PYTHONPATH="$work/llama.cpp/gguf-py" python3 "$peers/make_qwen3_gguf.py" \
    "$work/llama.cpp/models/ggml-vocab-qwen2.gguf" "$work/q3-8b-f16.gguf" > "$out/llama-gguf.log" 2>&1
  if [ -n "${build_pid:-}" ]; then wait "$build_pid" || { tail -20 "$out/llama-build.log"; exit 1; }; fi
  bench="$work/b/bin/llama-bench -m $work/q3-8b-f16.gguf -ngl 99 -fa 1 -r 3 -o json"
  $bench -p 512,4096 -n 0 > "$out/llama-prefill.json" 2>> "$out/llama.log"
  $bench -p 0 -n 128 > "$out/llama-decode.json" 2>> "$out/llama.log"
  $bench -p 0 -n 128 -d 4096 > "$out/llama-decode-4096.json" 2>> "$out/llama.log"
  rm -f "$work/q3-8b-f16.gguf"
fi

if has report; then
  python3 gateway/bench/report.py "$out/ours.json" --hf "$out/hf.json" \
    --llama "$out/llama-prefill.json" "$out/llama-decode.json" "$out/llama-decode-4096.json" \
    --out "$out"
fi
