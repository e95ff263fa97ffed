#!/usr/bin/env python3
"""Sets `vlm bench --json` beside its peers and writes the comparison.

Usage: report.py OURS.json [--hf HF.json] [--llama LLAMA_BENCH.json ...] --out DIR
Writes DIR/results.json (every row of every system), DIR/table.md (one line per measurement:
each system's median and our speed-up over it) and, when matplotlib is there, DIR/benchmarks.png.
A peer that did not run a measurement shows "not measured", with the reason when one is known.
llama-bench's own JSON (-o json) is mapped onto our names: pp512/pp4096 to the prefill rows,
tg128 at depth 0 and 4096 to the decode rows (its "context 512" row is an empty context)."""
import argparse
import json
import os


def llama_rows(path):
    rows = []
    for r in json.load(open(path)):
        ts = r["avg_ts"]
        if r.get("n_gen", 0) == 0:
            name, per = f"prefill: {r['n_prompt']} text tokens", r["n_prompt"] / ts
            note = None
        else:
            depth = r.get("n_depth", 0)
            name = f"decode: batch 1 at context {4096 if depth >= 4096 else 512}"
            note = f"llama.cpp tg{r['n_gen']} at depth {depth}"
            per = 1.0 / ts
        rows.append({"name": name, "system": "llama.cpp", "median_ms": per * 1e3,
                     "throughput": ts, "unit": "token/s", "note": note,
                     "device": r.get("gpu_info", ""), "config": os.path.basename(r.get("model_filename", ""))})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ours")
    ap.add_argument("--hf")
    ap.add_argument("--llama", nargs="*", default=[])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    ours = json.load(open(a.ours))
    for r in ours:
        r.setdefault("system", "vlm")
    rows = list(ours)
    if a.hf and os.path.exists(a.hf):
        rows += json.load(open(a.hf))
    for p in a.llama:
        if os.path.exists(p):
            rows += llama_rows(p)
    json.dump(rows, open(os.path.join(a.out, "results.json"), "w"), indent=1)

    peers = ["llama.cpp", "hf transformers"]
    # What each peer cannot run, so the table says why instead of leaving a hole.
    cannot = {
        "llama.cpp": {"vision": "no Qwen3-VL ViT timing in llama-bench (mtmd logs it separately)",
                      "image": "llama-bench has no image requests", "limit": "-", "memory": "-",
                      "gateway": "-"},
        "hf transformers": {"limit": "-", "gateway": "no service split"},
    }

    def reason(peer, name):
        for key, why in cannot.get(peer, {}).items():
            if key in name:
                return why
        return "not measured"

    lines = ["| measurement | vlm | " + " | ".join(peers) + " | "
             + " | ".join(f"vlm vs {p}" for p in peers) + " |",
             "|---" * (2 + 2 * len(peers)) + "|"]
    plot = []
    for r in ours:
        name = r["name"]
        if r["unit"].startswith("B in use"):
            # Bytes in "throughput" (as the peers write them); files from before that wrote
            # null there (an amount over zero seconds).
            cell = lambda x: "not recorded" if x.get("throughput") is None else f"{x['throughput'] / 1e9:.2f} GB"
        else:
            cell = lambda x: f"{x['median_ms']:.2f} ms"
        cells, ratios = [], []
        for p in peers:
            match = [x for x in rows if x.get("system") == p and x["name"] == name]
            if match:
                m = match[0]
                cells.append(cell(m) + (f" ({m['note']})" if m.get("note") else ""))
                if not r["unit"].startswith("B in use") and r["median_ms"] > 0:
                    speedup = m["median_ms"] / r["median_ms"]
                    ratios.append(f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower")
                    plot.append((name, p, speedup))
                else:
                    ratios.append("-")
            else:
                cells.append(reason(p, name))
                ratios.append("-")
        lines.append(f"| {name} | {cell(r)} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    table = "\n".join(lines) + "\n"
    open(os.path.join(a.out, "table.md"), "w").write(table)
    print(table)

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    if not plot:
        return
    names = sorted({n for n, _, _ in plot}, key=[r["name"] for r in ours].index)
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(names) + 1.5))
    width = 0.8 / len(peers)
    for i, p in enumerate(peers):
        ys = [next((s for n, q, s in plot if n == name and q == p), 0) for name in names]
        ax.barh([j + i * width for j in range(len(names))], ys, height=width, label=f"vs {p}")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks([j + width * (len(peers) - 1) / 2 for j in range(len(names))])
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("speed-up of vlm over the peer (peer time / our time; > 1 is faster)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "benchmarks.png"), dpi=120)


if __name__ == "__main__":
    main()
