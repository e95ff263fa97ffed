#!/usr/bin/env bash
# Batch-1 decode steps on the GPU's timeline, kernel by kernel, without Nsight Systems: builds
# the CUPTI tracer (ktrace.c), runs `vlm bench` at batch 1 and the given context under it, and
# prints decode_step.py's breakdown (also kept in OUT_DIR with the raw trace).
#
#   cuda/bench/ktrace/trace_decode.sh VLM CONTEXT [OUT_DIR]
#
# Run from the repository root on the GPU machine (gcc and a CUDA toolkit with CUPTI, found
# under $CUDA_HOME or /usr/local/cuda). The environment passes through: VLM_KERNEL_DIR to time
# kernels from disk, with VLM_UNCHECKED=1 to time a kernel made empty (what it costs a step).
# BENCH_ARGS adds flags to vlm bench (e.g. "--quantize int4" for a quantized model's step).
# CUPTI slows the process, not the GPU's timestamps: the step spans it prints match `vlm
# bench`'s decode rows within ~1%.
set -euo pipefail
[ $# -ge 2 ] || { sed -n '5p' "$0" | sed 's/^# *//' >&2; exit 2; }
vlm=$1 context=$2 out=${3:-/tmp/ktrace}
here=$(dirname "$0")
cuda=${CUDA_HOME:-/usr/local/cuda}
for d in "$cuda/extras/CUPTI" "$cuda"; do
  [ -f "$d/include/cupti.h" ] && cupti=$d && break
done
[ -n "${cupti:-}" ] || { echo "no cupti.h under $cuda" >&2; exit 1; }
lib=$cupti/lib64
[ -d "$lib" ] || lib=$cupti/lib
# The newest kernel record this CUPTI declares.
record=$(grep -o 'CUpti_ActivityKernel[0-9]*' "$cupti/include/cupti_activity.h" | sort -V | tail -1)
mkdir -p "$out"
gcc -shared -fPIC -O2 "$here/ktrace.c" -I"$cupti/include" -I"$cuda/include" -L"$lib" -lcupti \
  -DKREC="$record" -o "$out/libktrace.so"
trace=$out/decode-$context.csv
LD_LIBRARY_PATH=$lib:${LD_LIBRARY_PATH:-} CUDA_INJECTION64_PATH=$out/libktrace.so KTRACE_OUT=$trace \
  "$vlm" bench --device cuda --model deploy/models/qwen3-vl-8b --random-weights --warmup 1 \
  --repeats 3 --no-gateway --image-sides '' --ttft-image-sides '' --prefill-tokens '' \
  --decode-contexts "$context" --decode-batches 1 ${BENCH_ARGS:-} | grep '^decode'
python3 "$here/decode_step.py" "$trace" | tee "$out/decode-$context.txt"
