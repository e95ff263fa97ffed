#!/usr/bin/env python3
"""HF transformers as a benchmark peer: Qwen3-VL from a config with random weights (bf16, sdpa,
generate with the default cache) timed on the measurements `vlm bench` makes, written as JSON rows
with the same names, so gateway/bench/report.py can set them side by side.

Usage: hf_peer.py MODEL_DIR OUT.json [--repeats 5] [--sides 448,896,1344] [--prefill 512,4096]
                  [--contexts 512,4096] [--decode-tokens 32]
MODEL_DIR holds config.json and preprocessor_config.json (deploy/models/qwen3-vl-8b). Needs a GPU,
torch and transformers >= 5 (what the GPU machine has)."""
import argparse
import io
import json
import statistics
import time

import torch
from PIL import Image
from transformers import AutoImageProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration


def timed(fn, repeats, warmup=1):
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return sorted(out)


def row(name, seconds, work, unit, device, config, note=None):
    med = statistics.median(seconds)
    r = {"name": name, "system": "hf transformers", "device": device, "config": config,
         "median_ms": med * 1e3, "min_ms": seconds[0] * 1e3, "max_ms": seconds[-1] * 1e3,
         "runs": len(seconds), "throughput": work / med, "unit": unit}
    if note:
        r["note"] = note
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sides", default="448,896,1344")
    ap.add_argument("--prefill", default="512,4096")
    ap.add_argument("--contexts", default="512,4096")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--ttft-text-tokens", type=int, default=32)
    a = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",") if x]

    cfg = Qwen3VLConfig.from_pretrained(a.model_dir)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3VLForConditionalGeneration._from_config(
            cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    device = f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    config = f"{a.model_dir} (random weights, bf16, sdpa)"
    vc, tc = cfg.vision_config, cfg.text_config
    rows = []
    vocab = tc.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(0)
    text_ids = lambda n: torch.randint(1000, 100000, (1, n), generator=gen).cuda()

    with torch.inference_mode():
        factor = vc.patch_size * vc.spatial_merge_size
        patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
        for side in ints(a.sides):
            g = max(side // factor, 1) * vc.spatial_merge_size
            pixels = torch.full((g * g, patch_dim), 0.1, dtype=torch.bfloat16, device="cuda")
            grid = torch.tensor([[1, g, g]], device="cuda")
            s = timed(lambda: model.model.visual(pixels, grid_thw=grid), a.repeats)
            rows.append(row(f"vision: ViT + mergers {side}x{side} ({g * g} patches)", s, 1.0,
                            "run/s", device, config))

        for n in ints(a.prefill):
            ids = text_ids(n)
            s = timed(lambda: model(input_ids=ids, use_cache=True), a.repeats)
            rows.append(row(f"prefill: {n} text tokens", s, n, "token/s", device, config))

        # Image + text, first token: PNG decode and preprocessing included, as in ours.
        proc = AutoImageProcessor.from_pretrained(a.model_dir)
        side = 448
        img = Image.new("RGB", (side, side))
        img.putdata([(x * 255 // side, y * 255 // side, 128) for y in range(side) for x in range(side)])
        png = io.BytesIO()
        img.save(png, format="PNG")
        png = png.getvalue()

        def ttft():
            pv = proc(images=[Image.open(io.BytesIO(png)).convert("RGB")], return_tensors="pt")
            grid = pv["image_grid_thw"].cuda()
            tokens = int(grid.prod()) // vc.spatial_merge_size ** 2
            ids = torch.cat([
                torch.tensor([[cfg.vision_start_token_id] + [cfg.image_token_id] * tokens
                              + [cfg.vision_end_token_id]]).cuda(),
                text_ids(a.ttft_text_tokens)], dim=1)
            # transformers 5.x places M-RoPE positions by token type (0 text, 1 image), which its
            # processor returns; ids built by hand need it spelled out.
            out = model(input_ids=ids, pixel_values=pv["pixel_values"].cuda().to(torch.bfloat16),
                        image_grid_thw=grid, mm_token_type_ids=(ids == cfg.image_token_id).int(),
                        use_cache=True)
            return out.logits[0, -1].argmax().item()

        s = timed(ttft, a.repeats)
        rows.append(row(f"image {side}x{side} + {a.ttft_text_tokens} text tokens: time to first token, in process",
                        s, 1.0, "request/s", device, config))

        for ctx in ints(a.contexts):
            ids = text_ids(ctx)
            run = lambda n: model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n,
                                           do_sample=False)
            one = statistics.median(timed(lambda: run(1), max(1, a.repeats // 2)))
            many = timed(lambda: run(1 + a.decode_tokens), a.repeats)
            per_token = [max(t - one, 1e-9) / a.decode_tokens for t in many]
            rows.append(row(f"decode: batch 1 at context {ctx}", per_token, 1.0, "token/s",
                            device, config))

    rows.append({"name": "memory: peak allocated by torch", "system": "hf transformers",
                 "device": device, "config": config, "median_ms": 0.0, "runs": 1,
                 "throughput": torch.cuda.max_memory_allocated(), "unit": "B in use"})
    json.dump(rows, open(a.out, "w"), indent=1)
    for r in rows:
        print(f"{r['name']:<70} {r['median_ms']:10.2f} ms  {r['throughput']:12.1f} {r['unit']}")


if __name__ == "__main__":
    main()
