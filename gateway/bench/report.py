#!/usr/bin/env python3
"""Sets `vlm bench --json` and `vlm load --json` beside their peers and writes the comparison.

Usage: report.py OURS.json [--hf HF.json] [--llama LLAMA_BENCH.json ...]
                 [--load LOAD.json] [--llama-batched BATCHED.jsonl] --out DIR
Writes DIR/results.json (every row of every system), DIR/table.md (one line per measurement:
each system's median and our speed-up over it; then, with --load, one line per concurrency) and,
when matplotlib is there, DIR/benchmarks.png and DIR/load.png.
A peer that did not run a measurement shows "not measured", with the reason when one is known.
llama-bench's own JSON (-o json) is mapped onto our names: pp512/pp4096 to the prefill rows,
tg128 at depth 0 and 4096 to the decode rows (its "context 512" row is an empty context).
llama-batched-bench's JSONL (--output-format jsonl) is matched to `vlm load`'s levels by its
number of parallel sequences (pl) = our concurrency."""
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


def batched_rows(path):
    """llama-batched-bench's JSONL lines (results only: its other output is not JSON)."""
    rows = []
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            r = json.loads(line)
            r["system"] = "llama.cpp (llama-batched-bench)"
            rows.append(r)
    return rows


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def load_table(load, batched):
    """One line per concurrency: ours through the gateway beside llama.cpp's batched decoding."""
    by_pl = {r["pl"]: r for r in batched}
    levels = sorted({r["concurrency"] for r in load} | set(by_pl))
    ours = {r["concurrency"]: r for r in load}
    lines = [
        "| concurrency | vlm output tok/s | vlm req/s | vlm TTFT p50 / p99 ms | vlm ITL p50 / p99 ms "
        "| vlm errors | llama.cpp S_TG tok/s (decode only) | llama.cpp tok/s with prefill "
        "| vlm vs llama.cpp with prefill |",
        "|---" * 9 + "|",
    ]
    plot = []
    for c in levels:
        o, b = ours.get(c), by_pl.get(c)
        if o:
            errors = ", ".join(f"{n} {k}" for k, n in o["errors"].items()) or "0"
            cells = [fmt(o["output_tokens_per_s"], ".1f"), fmt(o["requests_per_s"], ".2f"),
                     f"{fmt(o['ttft_p50_ms'], '.0f')} / {fmt(o['ttft_p99_ms'], '.0f')}",
                     f"{fmt(o['itl_p50_ms'], '.1f')} / {fmt(o['itl_p99_ms'], '.1f')}", errors]
        else:
            cells = ["not measured"] + ["-"] * 4
        if b:
            # Generated tokens over prefill + decode time: what a client of a batch would see.
            with_prefill = b["pl"] * b["tg"] / b["t"]
            cells += [fmt(b["speed_tg"], ".1f"), fmt(with_prefill, ".1f")]
        else:
            with_prefill = None
            cells += ["not measured", "-"]
        if o and with_prefill:
            ratio = o["output_tokens_per_s"] / with_prefill
            cells.append(f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower")
        else:
            cells.append("-")
        plot.append((c, o and o["output_tokens_per_s"], b and b["speed_tg"], with_prefill))
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    notes = [
        "",
        "vlm: `vlm load`, streamed chats through the gateway (OpenAI HTTP with SSE and gRPC "
        "ChatStream, alternating), each client sending its next request when its last one ends. "
        "Output tok/s is every generated token over the level's wall time, so it includes "
        "tokenizing, the vision stage for the requests with an image, the service hops, prefill "
        "and the ramp-up and drain of the level; TTFT is from sending a request to its first "
        "token, ITL the gap between consecutive tokens as the client received them.",
        "llama.cpp: `llama-batched-bench`, B sequences of random prompt tokens prefilled together "
        "(T_PP), then decoded together in lockstep (T_TG); no HTTP, no tokenizer, no images. "
        "S_TG = B x TG / T_TG is decode only; 'with prefill' = B x TG / (T_PP + T_TG), the rate "
        "comparable to ours.",
    ]
    if load:
        notes.append(f"vlm config: {load[0].get('config', '')}; device: {load[0].get('device', '')}")
    if batched:
        b = batched[0]
        notes.append(f"llama.cpp config: PP {b['pp']}, TG {b['tg']}, n_kv_max {b['n_kv_max']}, "
                     f"n_batch {b['n_batch']}, n_ubatch {b['n_ubatch']}, flash_attn {b['flash_attn']}")
    return "\n".join(lines + notes) + "\n", plot


def sampled_table(greedy, sampled, text, server):
    """One line per concurrency: sampled beside greedy on the same workload, and the text-only
    sampled HTTP workload on vlm and on llama.cpp's llama-server."""
    by = lambda rows: {r["concurrency"]: r for r in rows}
    g, s, t, v = by(greedy), by(sampled), by(text), by(server)
    levels = sorted(set(g) | set(s) | set(t) | set(v))
    tok = lambda r: fmt(r["output_tokens_per_s"], ".1f") if r else "not measured"
    itl = lambda r: fmt(r["itl_p50_ms"], ".1f") if r else "-"
    lines = [
        "| concurrency | vlm greedy tok/s | vlm sampled tok/s | sampled / greedy "
        "| vlm sampled, text over HTTP: tok/s (ITL p50 ms) "
        "| llama-server, the same: tok/s (ITL p50 ms) | vlm vs llama-server |",
        "|---" * 7 + "|",
    ]
    for c in levels:
        a, b, x, y = g.get(c), s.get(c), t.get(c), v.get(c)
        ratio = f"{100 * b['output_tokens_per_s'] / a['output_tokens_per_s']:.1f}%" if a and b else "-"
        vs = "-"
        if x and y and y["output_tokens_per_s"]:
            r = x["output_tokens_per_s"] / y["output_tokens_per_s"]
            vs = f"{r:.2f}x faster" if r >= 1 else f"{1 / r:.2f}x slower"
        lines.append(f"| {c} | {tok(a)} | {tok(b)} | {ratio} | {tok(x)} ({itl(x)}) "
                     f"| {tok(y)} ({itl(y)}) | {vs} |")
    notes = [
        "",
        "Sampled: temperature 0.7, top-p 0.8, top-k 20, presence penalty 1.5 (Qwen3-VL's model "
        "card), each request seeded with its index. 'Text over HTTP': no images, OpenAI HTTP "
        "with SSE only, the workload llama-server (a text GGUF of the same shapes, one slot per "
        "client of the largest level) takes too; tokens from llama-server are counted by chunk.",
    ]
    for name, rows in [("vlm sampled", sampled), ("vlm text", text), ("llama-server", server)]:
        if rows:
            notes.append(f"{name} config: {rows[0].get('config', '')}")
    return "\n".join(lines + notes) + "\n"


def json_schema_table(sampled, constrained, bench):
    """One line per concurrency: sampled with a JSON schema on every request beside the same
    workload sampled without (the issue's target: at least 90% at 64 streams), then vlm bench's
    grammar-mask rows (the host's time a step, median and p99)."""
    by = lambda rows: {r["concurrency"]: r for r in rows}
    s, j = by(sampled), by(constrained)
    tok = lambda r: fmt(r["output_tokens_per_s"], ".1f") if r else "not measured"
    lines = ["| concurrency | vlm sampled tok/s | with a JSON schema tok/s | JSON / sampled "
             "| ITL p50 / p99 ms, with the schema |", "|---" * 5 + "|"]
    for c in sorted(set(s) | set(j)):
        a, b = s.get(c), j.get(c)
        ratio = f"{100 * b['output_tokens_per_s'] / a['output_tokens_per_s']:.1f}%" if a and b else "-"
        itl = f"{b['itl_p50_ms']:.1f} / {b['itl_p99_ms']:.1f}" if b else "-"
        lines.append(f"| {c} | {tok(a)} | {tok(b)} | {ratio} | {itl} |")
    masks = [r for r in bench if r["name"].startswith(("grammar masks", "grammar pick checks"))]
    if masks:
        lines += ["", "| host work of grammars (vlm bench) | ms |", "|---|---|"]
        lines += [f"| {r['name']} | {r['median_ms']:.3f} |" for r in masks]
    return "\n".join(lines) + "\n"


QUANT_ROWS = ["decode: batch 1 at context 512", "decode: batch 64 at context 512",
              "prefill: 4096 text tokens"]


def quant_columns(ours, ours_int, llama_f16, llama_quant):
    """The weight formats' columns, (system, format, rows): ours in f16 and under --quantize
    int8/int4, llama.cpp's f16 GGUF and its llama-quantize'd Q8_0/Q4_K_M/Q4_0."""
    return ([("vlm", "f16", ours)] + [("vlm", q, rs) for q, rs in ours_int]
            + [("llama.cpp", "f16", llama_f16)] + [("llama.cpp", q, rs) for q, rs in llama_quant])


def throughput(rows, name):
    m = [r for r in rows if r["name"] == name]
    return m[0]["throughput"] if m else None


def quant_table(columns):
    """Weight formats side by side in tok/s (llama-bench has no batch of 64)."""
    lines = ["| tok/s | " + " | ".join(f"{s} {q}" for s, q, _ in columns) + " |",
             "|---" * (1 + len(columns)) + "|"]
    for name in QUANT_ROWS:
        cells = [throughput(rs, name) for _, _, rs in columns]
        cells = [f"{v:,.0f}" if v else "-" for v in cells]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def bits_of(fmt):
    """A format's bits a weight, to group the plot's bars: f16 16, int8 and Q8_0 8, the rest 4."""
    return 16 if fmt == "f16" else 8 if "8" in fmt else 4


def plot_formats(plt, columns, path):
    """Each format's tok/s, ours beside llama.cpp's, grouped by bits a weight: one panel for
    decode at batch 1 (bytes a token) and one for prefill (the GEMMs)."""
    names = [n for n in QUANT_ROWS if "batch 64" not in n]
    fig, axes = plt.subplots(1, len(names), figsize=(11, 3.8))
    colors = {"vlm": "tab:blue", "llama.cpp": "tab:orange"}
    for ax, name in zip(axes, names):
        bars = sorted(((bits_of(q), s != "vlm", s, q, throughput(rs, name))
                       for s, q, rs in columns if throughput(rs, name)), key=lambda b: b[:2])
        xs, x, last = [], 0.0, None
        for bits, *_ in bars:
            x += 1.0 if last in (None, bits) else 1.6
            xs.append(x)
            last = bits
        ax.bar(xs, [b[4] for b in bars], color=[colors[b[2]] for b in bars])
        for xi, (_, _, s, q, v) in zip(xs, bars):
            ax.text(xi, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(xs)
        ax.set_xticklabels([q for *_, q, _ in bars], fontsize=8)
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("tokens/s")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    axes[0].legend(handles, list(colors), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ours")
    ap.add_argument("--hf")
    ap.add_argument("--llama", nargs="*", default=[])
    ap.add_argument("--load", help="vlm load --json output")
    ap.add_argument("--llama-batched", help="llama-batched-bench --output-format jsonl output")
    ap.add_argument("--load-sampled", help="vlm load --json output, sampled as Qwen recommends")
    ap.add_argument("--load-text", help="the same, text only over HTTP")
    ap.add_argument("--server-load", help="vlm load --json output against llama-server")
    ap.add_argument("--load-json", help="vlm load --json output, sampled, --json-schema")
    ap.add_argument("--quant", nargs="*", default=[], metavar="FORMAT=FILE",
                    help="vlm bench --quantize outputs, e.g. int4=ours-int4.json")
    ap.add_argument("--llama-quant", nargs="*", default=[], metavar="FORMAT=FILE",
                    help="llama-bench -o json of quantized GGUFs, e.g. Q4_0=llama-Q4_0.json")
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
    load = json.load(open(a.load)) if a.load and os.path.exists(a.load) else []
    batched = batched_rows(a.llama_batched) if a.llama_batched and os.path.exists(a.llama_batched) else []
    opt = lambda p: json.load(open(p)) if p and os.path.exists(p) else []
    sampled, text, server = opt(a.load_sampled), opt(a.load_text), opt(a.server_load)
    constrained = opt(a.load_json)
    for r in sampled + text:
        r.setdefault("system", "vlm sampled")
    for r in constrained:
        r.setdefault("system", "vlm json_schema")
    for r in server:
        r["system"] = "llama-server"
    json.dump(rows + load + batched + sampled + text + server + constrained,
              open(os.path.join(a.out, "results.json"), "w"), indent=1)

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
    load_plot = []
    if load or batched:
        section, load_plot = load_table(load, batched)
        table += "\n## Many clients at once\n\n" + section
    if sampled or text or server:
        table += "\n## Sampled, as clients ask\n\n" + sampled_table(load, sampled, text, server)
    if constrained:
        table += ("\n## Structured outputs\n\n"
                  + json_schema_table(sampled, constrained, ours))
    pairs = lambda args: [tuple(x.split("=", 1)) for x in args]
    ours_int = [(q, opt(p)) for q, p in pairs(a.quant) if os.path.exists(p)]
    llama_quant = [(q, llama_rows(p)) for q, p in pairs(a.llama_quant) if os.path.exists(p)]
    formats = []
    if ours_int or llama_quant:
        llama_f16 = [r for r in rows if r.get("system") == "llama.cpp"]
        formats = quant_columns(ours, ours_int, llama_f16, llama_quant)
        table += "\n## Weight formats\n\n" + quant_table(formats)
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
    if load_plot:
        fig, ax = plt.subplots(figsize=(7, 4))
        cs = [c for c, *_ in load_plot]
        for i, label in enumerate(["vlm through the gateway (prefill included)",
                                   "llama.cpp decode only (S_TG)", "llama.cpp with prefill"]):
            pts = [(c, v[i]) for c, *v in load_plot if v[i]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs)
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrent requests (llama.cpp: parallel sequences)")
        ax.set_ylabel("generated tokens/s")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, "load.png"), dpi=120)
    if formats:
        plot_formats(plt, formats, os.path.join(a.out, "formats.png"))
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
