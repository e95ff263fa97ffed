#!/usr/bin/env python3
"""Where a batch-1 decode step's time goes, kernel by kernel, from ktrace's CSV.

A step is the kernels from one `embedding_f16w` to the next; the most common step length is
taken as decode's (prefill steps differ). For each kernel of the step (the layers' GEMVs told
apart by their place: q/k/v, o, gate/up, down, lm_head), over the last 8 steps:

  dur          its own duration (it may start early under programmatic dependent launch),
  adds         how much later it ends than every kernel before it: the step's time, kernel by
               kernel (the adds of a step sum to its span),
  start-prev   when it starts against the end of the kernels before it (negative: early),
  adds/step    its adds summed over a step.

Then the last step's first 16 kernels on the timeline.

  decode_step.py TRACE.csv
"""
import collections
import sys


def steps_of(kernels):
    steps, cur = [], []
    for k in kernels:
        if k[2].startswith("embedding") and cur:
            steps.append(cur)
            cur = []
        cur.append(k)
    steps.append(cur)
    return steps


# A layer's GEMVs in order, whatever their kernels (f16, integer, FP8; normed or not).
ROLES = ("q/k/v", "o", "gate/up", "down")


def labels(step):
    """Each kernel's name, the GEMVs prefixed with the projection they are: the step's last GEMV
    is lm_head, the ones before it each layer's four in order (where they come in fours)."""
    gemvs = [i for i, (_, _, name) in enumerate(step) if "gemv" in name]
    role = {}
    if gemvs:
        role[gemvs[-1]] = "lm_head"
        if (len(gemvs) - 1) % len(ROLES) == 0:
            for j, i in enumerate(gemvs[:-1]):
                role[i] = ROLES[j % len(ROLES)]
    return [f"{role[i]} {name}" if i in role else name for i, (_, _, name) in enumerate(step)]


def main(path):
    kernels = []
    for line in open(path):
        start, end, name = line.rstrip("\n").split(",", 2)
        kernels.append((int(start), int(end), name))
    kernels.sort()
    steps = steps_of(kernels)
    length = collections.Counter(len(s) for s in steps).most_common(1)[0][0]
    decode = [s for s in steps if len(s) == length][-8:]
    print(f"{len(steps)} steps traced; decode's have {length} kernels; the last {len(decode)} used")
    agg = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    spans = []
    for s in decode:
        spans.append((s[-1][1] - s[0][0]) / 1e3)
        prev_end = s[0][0]
        for (start, end, _), name in zip(s, labels(s)):
            a = agg[name]
            a[0] += 1
            a[1] += (end - start) / 1e3
            a[2] += (end - prev_end) / 1e3
            a[3] += (start - prev_end) / 1e3
            prev_end = max(prev_end, end)
    n = len(decode)
    print("step span, us:", [round(t, 1) for t in spans])
    print(f"{'kernel':52} {'/step':>5} {'dur':>7} {'adds':>7} {'start-prev':>10} {'adds/step':>9}")
    for name, (count, dur, adds, gap) in sorted(agg.items(), key=lambda kv: -kv[1][2]):
        print(f"{name[:52]:52} {count / n:5.0f} {dur / count:7.2f} {adds / count:7.2f} "
              f"{gap / count:10.2f} {adds / n:9.1f}")
    last = decode[-1]
    t0 = last[0][0]
    print("\nthe last step's first kernels: start, end (us from the step's start), duration")
    for (start, end, _), name in list(zip(last, labels(last)))[:16]:
        print(f"{(start - t0) / 1e3:9.2f} {(end - t0) / 1e3:9.2f} {(end - start) / 1e3:7.2f}  {name[:60]}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
