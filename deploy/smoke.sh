#!/usr/bin/env bash
# Smoke test of the CPU compose stack where a Docker engine (with the compose plugin) exists:
# builds the images, brings the stack up, sends one image request through the gateway, checks
# the answer, and tears everything down. From the repository root: bash deploy/smoke.sh
set -euo pipefail
cd "$(dirname "$0")/.."
compose=(docker compose -f deploy/docker-compose.cpu.yml)
trap '"${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 || true' EXIT
"${compose[@]}" up --build --detach --wait --wait-timeout 600
img=$(base64 -w0 tests/fixtures/tiny-qwen3-vl/images/cat.png)
answer=$(curl -sf http://127.0.0.1:${VLM_HTTP_PORT:-8080}/v1/chat/completions -H 'content-type: application/json' -d '{
  "max_tokens": 8, "messages": [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,'"$img"'"}},
    {"type": "text", "text": "Describe this image."}]}]}')
echo "$answer"
grep -q '"finish_reason":"length"' <<<"$answer"
grep -q '"completion_tokens":8' <<<"$answer"
echo "smoke test passed"
