#!/usr/bin/python3
"""Combines bench/harness/vs_pytorch.sh's JSON lines into a Markdown table and an SVG plot.

    /usr/bin/python3 bench/harness/vs_pytorch_table.py RESULTS.jsonl --model gpt --command "bash bench/harness/vs_pytorch.sh ..." \
        --md bench/results/vs_pytorch_gpt.md --svg bench/results/vs_pytorch_gpt.svg

Input: one JSON object per line, from bench/harness/pytorch_twin.py --json (no "side" key; variants
eager or parts joined by "+": accum:K, ckpt_seq:S, autocast_bf16 — the peer grid; a row with
"error" is a variant the model could not run) and from bench/vs_pytorch_memfit ("side": "memfit"; variants
plain, fp32_plan, mixed_plan, microbatch). Budgets are the distinct budget_bytes of the memfit
rows; each is shown as a percentage of PyTorch's eager peak.

Per budget the table shows PyTorch eager (if its peak fits), the fastest grid point whose
measured peak fits (peak <= budget) in fp32 and with bf16 allowed, memfit's fp32 plan and
memfit's mixed-precision plan,
each with its measured peak and its median step time as a ratio to PyTorch eager's, measured in
the same run. The plot is the memory/time frontier: x = measured peak, y = step time / PyTorch
eager. Standard library only (the driver runs it with Debian's python3).
"""
import argparse
import json
import statistics
import math
import sys
from html import escape

MIB = 1024.0 * 1024.0


def load(path, model):
    torch_rows, memfit_rows, base = [], [], {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if r.get("model") != model:
                continue
            if r.get("base"):
                base.setdefault(r.get("side") == "memfit", []).append(r["median_step_s"])
                continue
            if r.get("error"):
                FAILED.append(r)
                continue
            (memfit_rows if r.get("side") == "memfit" else torch_rows).append(r)
    # Cross-side times: the two sides ran minutes apart, and the machine's speed drifts. The base
    # comparison (PyTorch eager and memfit plain alternating, at the end of the run) gives the
    # ratio memfit plain / PyTorch eager measured close together; memfit's rows are rescaled so
    # that its plain step stands at that ratio to this run's PyTorch eager. Within each side
    # the times are as measured.
    eager = next((r for r in torch_rows if r["variant"] == "eager"), None)
    plain = next((r for r in memfit_rows if r["variant"] == "plain"), None)
    if base.get(True) and base.get(False) and eager and plain and plain.get("median_step_s"):
        ratio = statistics.median(base[True]) / statistics.median(base[False])
        scale = ratio * eager["median_step_s"] / plain["median_step_s"]
        for r in memfit_rows:
            if r.get("median_step_s") is not None:
                r["median_step_s_measured"] = r["median_step_s"]
                r["median_step_s"] = r["median_step_s"] * scale
        eager["base_ratio"] = ratio
        eager["base_scale"] = scale
    return torch_rows, memfit_rows


FAILED = []  # PyTorch grid points the model could not run (their "error")


def parts(variant):
    """{"accum": K, "segments": S, "bf16": bool} of a grid variant (pytorch_twin.parse_variant)."""
    p = {"accum": 1, "segments": 0, "bf16": False}
    for part in variant.split("+"):
        name, _, value = part.partition(":")
        if name == "accum":
            p["accum"] = int(value)
        elif name == "ckpt_seq":
            p["segments"] = int(value)
        elif part == "autocast_bf16":
            p["bf16"] = True
    return p


def describe(variant):
    """"accum 4, 3 segments, bf16" for a grid variant."""
    p = parts(variant)
    out = ["accum %d" % p["accum"] if p["accum"] > 1 else "whole batch"]
    out.append("%d segments" % p["segments"] if p["segments"] else "no checkpoint")
    out.append("bf16" if p["bf16"] else "fp32")
    return ", ".join(out)


def fastest_fitting(rows, budget, bf16_allowed):
    """The fastest grid row whose measured peak fits the budget, or None."""
    fitting = [r for r in rows if r["peak_bytes"] <= budget and (bf16_allowed or not parts(r["variant"])["bf16"])]
    return min(fitting, key=lambda r: r["median_step_s"]) if fitting else None


def mib(b):
    return ("%.1f" if b >= MIB else "%.3f") % (b / MIB)


def ratio(seconds, eager_s):
    return "%.2fx" % (seconds / eager_s) if seconds is not None and eager_s else "-"


# ----------------------------------------------------------------------------- Markdown


def memfit_cell(r):
    """(configuration, peak bytes or None, seconds or None) of a memfit row."""
    if r is None:
        return "not run", None, None
    if not r["fits"]:
        if not r.get("feasible", True):
            return r["plan"], None, None
        failed = [n for n in r.get("notes", []) if " failed: " in n]
        return (failed[-1] if failed else r["plan"] + ": OutOfMemoryError under the budget"), None, None
    conf = r["plan"]
    if r.get("attempts", 1) > 1:  # replanned tighter after running out of memory
        conf += " (plan %d: the first ran out of memory)" % r["attempts"]
    return conf, r["peak_bytes"], r["median_step_s"]


def header(w, model, command, eager, torch_rows):
    eager_s = eager["median_step_s"]
    w("# memfit vs PyTorch %s: %s" % (eager.get("torch", "?"), model))
    w("")
    w("Reproduce: `%s`" % command)
    w("")
    cfg = eager.get("config", {})
    w("Model: %s. Batch %s, %s threads (torch and OpenBLAS on both sides), AdamW(lr 1e-3), "
      "gradients released after each step. PyTorch runs the grid a user can hand-pick: gradient "
      "accumulation x checkpoint_sequential segments x {fp32, bf16 autocast}, each configuration "
      "measured. Peak bytes are exact: PyTorch's from the legacy profiler's allocator records "
      "(bench/PYTORCH_SIDE.md), memfit's from its tracker; memfit runs every plan under "
      "BudgetAllocator at the budget (an allocation past it throws). Times are medians of %s steps, "
      "as ratios to PyTorch eager's median (%.3f s) from the same run." %
      (", ".join("%s %s" % (k, v) for k, v in cfg.items() if k not in ("batch", "threads", "optimizer")),
       cfg.get("batch", "?"), cfg.get("threads", "?"), len(eager.get("step_times_s", [])) or "?", eager_s))
    if "base_ratio" in eager:
        w("memfit's times are scaled by %.3f: in the base comparison at the end of the run (PyTorch eager "
          "and memfit's plain step alternating, 3 runs of 3 steps each) memfit's plain step took %.3fx "
          "PyTorch eager's, and memfit's rows are placed at that ratio (the machine's speed drifts over "
          "the minutes between the two halves of the run); raw seconds are in the JSON lines "
          "(median_step_s)." % (eager["base_scale"], eager["base_ratio"]))
    loads = [r["loadavg_1m"] for r in torch_rows if "loadavg_1m" in r]
    if loads:
        w("PyTorch runs' 1-minute load averages ranged %.2f-%.2f; above ~0.5 the times are unreliable "
          "on 2 cores." % (min(min(l) for l in loads), max(max(l) for l in loads)))
    for r in FAILED:
        w("PyTorch %s could not run: %s" % (describe(r["variant"]), r["error"]))
    w("")


def grid_row(w, label, r, eager_s):
    if r is None:
        w("| | %s | none fits | - | - | no | - |" % label)
    else:
        w("| | %s | %s | %d | %s | yes | %s |" % (label, describe(r["variant"]), r["peak_bytes"], mib(r["peak_bytes"]),
                                                 ratio(r["median_step_s"], eager_s)))


def per_budget_table(w, budgets, eager, grid, memfit_at):
    eager_peak, eager_s = eager["peak_bytes"], eager["median_step_s"]
    w("| budget | variant | configuration | measured peak (B) | MiB | fits | time × PyTorch eager |")
    w("|---|---|---|---:|---:|:-:|---:|")
    for b in budgets:
        fits = eager_peak <= b
        w("| %d%% (%s MiB) | PyTorch eager | - | %d | %s | %s | %s |" % (
            round(100.0 * b / eager_peak), mib(b), eager_peak, mib(eager_peak), "yes" if fits else "no",
            "1.00x" if fits else "-"))
        grid_row(w, "fastest PyTorch grid point, fp32", fastest_fitting(grid, b, False), eager_s)
        grid_row(w, "fastest PyTorch grid point, bf16 allowed", fastest_fitting(grid, b, True), eager_s)
        for variant, name in (("fp32_plan", "memfit fp32 plan"), ("mixed_plan", "memfit, mixed precision allowed")):
            conf, peak, secs = memfit_cell(memfit_at(variant, b))
            w("| | %s | %s | %s | %s | %s | %s |" % (
                name, conf, peak if peak is not None else "-", mib(peak) if peak is not None else "-",
                "yes" if peak is not None else "no", ratio(secs, eager_s)))


def summary_table(w, budgets, eager, grid, memfit_at):
    """memfit against the fastest fitting grid point, fp32 only and mixed precision allowed."""
    eager_peak, eager_s = eager["peak_bytes"], eager["median_step_s"]
    w("## Summary: memfit / the fastest PyTorch grid point that fits, at each budget")
    w("")
    w("| budget | PyTorch fp32 | memfit fp32 | memfit / PyTorch, fp32 | PyTorch, bf16 allowed | memfit, mixed allowed | memfit / PyTorch, mixed |")
    w("|---|---|---:|---:|---|---:|---:|")
    for b in budgets:
        cells = []
        for bf16, variant in ((False, "fp32_plan"), (True, "mixed_plan")):
            best = fastest_fitting(grid, b, bf16)
            _, _, secs = memfit_cell(memfit_at(variant, b))
            peer = "%s: %s" % (describe(best["variant"]), ratio(best["median_step_s"], eager_s)) if best else "none fits"
            both = best is not None and secs is not None
            cells += [peer, ratio(secs, eager_s), "%.2fx" % (secs / best["median_step_s"]) if both else "-"]
        w("| %d%% | %s |" % (round(100.0 * b / eager_peak), " | ".join(cells)))


def markdown(model, command, torch_rows, memfit_rows):
    eager = next(r for r in torch_rows if r["variant"] == "eager")
    eager_peak, eager_s = eager["peak_bytes"], eager["median_step_s"]
    grid = torch_rows  # eager is the grid's all-defaults point
    plain = next((r for r in memfit_rows if r["variant"] == "plain"), None)
    budgets = sorted({r["budget_bytes"] for r in memfit_rows if r["variant"] in ("fp32_plan", "mixed_plan")},
                     reverse=True)

    def memfit_at(variant, budget):
        return next((r for r in memfit_rows if r["variant"] == variant and r["budget_bytes"] == budget), None)

    out = []
    w = out.append
    header(w, model, command, eager, torch_rows)
    per_budget_table(w, budgets, eager, grid, memfit_at)
    micro = next((r for r in memfit_rows if r["variant"] == "microbatch"), None)
    if micro is not None:
        conf, peak, secs = memfit_cell(micro)
        w("| 1.1 × (weights + gradients + AdamW state) = %s MiB | memfit micro-batching | %s | %s | %s | %s | %s |" % (
            mib(micro["budget_bytes"]), conf, peak if peak is not None else "-",
            mib(peak) if peak is not None else "-", "yes" if peak is not None else "no", ratio(secs, eager_s)))
        smallest = min(grid, key=lambda r: r["peak_bytes"])
        w("")
        w("The smallest peak any PyTorch grid point reaches: %d B (%s MiB, %s)." % (
            smallest["peak_bytes"], mib(smallest["peak_bytes"]), describe(smallest["variant"])))
    # A precision the planner dropped (it fails on this model) is said once.
    for n in sorted({n for r in memfit_rows for n in r.get("notes", []) if "not considered" in n}):
        w("")
        w("Planner: %s" % n)
    w("")
    summary_table(w, budgets, eager, grid, memfit_at)
    w("")
    w("## All runs")
    w("")
    w("| side | variant | configuration | measured peak (B) | MiB | median step s | time × PyTorch eager |")
    w("|---|---|---|---:|---:|---:|---:|")
    for r in sorted(grid, key=lambda r: r["peak_bytes"]):
        w("| PyTorch | %s | %s | %d | %s | %.4f | %s |" % (
            r["variant"], describe(r["variant"]), r["peak_bytes"], mib(r["peak_bytes"]), r["median_step_s"],
            ratio(r["median_step_s"], eager_s)))
    for r in memfit_rows:
        budget = "" if r["budget_bytes"] is None else " @ %s MiB" % mib(r["budget_bytes"])
        conf, peak, secs = memfit_cell(r)
        w("| memfit | %s%s | %s | %s | %s | %s | %s |" % (
            r["variant"], budget, conf, peak if peak is not None else "-", mib(peak) if peak is not None else "-",
            "%.4f" % secs if secs is not None else "-", ratio(secs, eager_s)))
    if plain is not None and plain["peak_bytes"] is not None:
        w("")
        w("memfit's plain step (no budget, nothing recomputed) peaks at %d B; PyTorch eager at %d B "
          "(difference %+d B, %+.2f%%)." % (plain["peak_bytes"], eager_peak, plain["peak_bytes"] - eager_peak,
                                           100.0 * (plain["peak_bytes"] - eager_peak) / eager_peak))
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- SVG


def nice_step(span, target_ticks):
    """A 1/2/5 x 10^k step giving about target_ticks ticks over span."""
    raw = span / max(1, target_ticks)
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


def svg(model, command, torch_rows, memfit_rows):
    eager = next(r for r in torch_rows if r["variant"] == "eager")
    eager_s = eager["median_step_s"]
    series = []  # (name, colour, marker, [(peak bytes, time ratio, label)], connect)

    def pts(rows, label):
        return [(r["peak_bytes"], r["median_step_s"] / eager_s, label(r)) for r in rows
                if r.get("peak_bytes") is not None and r.get("median_step_s") is not None]

    fp32 = [r for r in torch_rows if r["variant"] != "eager" and not parts(r["variant"])["bf16"]]
    bf16 = [r for r in torch_rows if parts(r["variant"])["bf16"]]
    series.append(("PyTorch eager", "#444444", "square", pts([eager], lambda r: "eager"), False))
    # Not curves: time is not monotone in the grid's parameters.
    series.append(("PyTorch grid, fp32 (accumulation x segments)", "#1f77b4", "circle",
                   pts(fp32, lambda r: describe(r["variant"])), False))
    if bf16:
        series.append(("PyTorch grid, bf16 autocast", "#9467bd", "diamond", pts(bf16, lambda r: describe(r["variant"])),
                       False))
    for variant, name, colour, marker in (("plain", "memfit plain step (no budget)", "#8c564b", "square"),
                                          ("fp32_plan", "memfit fp32 plans", "#d62728", "triangle"),
                                          ("mixed_plan", "memfit plans, mixed precision allowed", "#ff7f0e",
                                           "triangle"),
                                          ("microbatch", "memfit micro-batching (1.1 × weights+grads+AdamW)",
                                           "#2ca02c", "cross")):
        rows = sorted((r for r in memfit_rows if r["variant"] == variant and r["fits"]), key=lambda r: r["peak_bytes"])
        if rows:
            series.append((name, colour, marker, pts(rows, lambda r: ""), variant in ("fp32_plan", "mixed_plan")))

    all_pts = [p for s in series for p in s[3]]
    budgets = sorted({r["budget_bytes"] for r in memfit_rows if r["variant"] == "fp32_plan"})
    x_max = max([p[0] for p in all_pts] + budgets) / MIB * 1.05
    y_max = max(p[1] for p in all_pts) * 1.1
    W, H = 980, 560
    left, right, top, bottom = 80, 380, 70, 60
    pw, ph = W - left - right, H - top - bottom
    X = lambda b: left + (b / MIB) / x_max * pw  # noqa: E731
    Y = lambda r: top + ph - r / y_max * ph  # noqa: E731

    o = []
    a = o.append
    a('<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" '
      'font-family="sans-serif" font-size="12">' % (W, H, W, H))
    a("<!-- reproduce: %s -->" % escape(command).replace("--", "- -"))
    a('<rect width="100%" height="100%" fill="white"/>')
    a('<text x="%d" y="22" font-size="15" font-weight="bold">memfit vs PyTorch %s, %s: memory/time frontier</text>'
      % (left, escape(str(eager.get("torch", "?"))), escape(model)))
    a('<text x="%d" y="42" font-size="10" fill="#555">%s</text>' % (left, escape(command)))
    # Budgets as faint vertical lines, labelled in % of PyTorch eager's peak.
    for b in budgets:
        x = X(b)
        a('<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#ccc" stroke-dasharray="4 3"/>' % (x, top, x, top + ph))
        a('<text x="%.1f" y="%d" font-size="10" fill="#888" text-anchor="middle">%d%%</text>'
          % (x, top - 4, round(100.0 * b / eager["peak_bytes"])))
    # Axes with ticks.
    a('<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>' % (left, top + ph, left + pw, top + ph))
    a('<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>' % (left, top, left, top + ph))
    step = nice_step(x_max, 8)
    for i in range(int(x_max / step) + 1):
        v = i * step
        x = left + v / x_max * pw
        a('<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="black"/>' % (x, top + ph, x, top + ph + 5))
        a('<text x="%.1f" y="%d" text-anchor="middle">%g</text>' % (x, top + ph + 18, round(v, 6)))
    step = nice_step(y_max, 6)
    for i in range(int(y_max / step) + 1):
        v = i * step
        y = Y(v)
        a('<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="black"/>' % (left - 5, y, left, y))
        a('<text x="%d" y="%.1f" text-anchor="end">%g</text>' % (left - 8, y + 4, round(v, 6)))
    a('<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#999"/>' % (left, Y(1.0), left + pw, Y(1.0)))
    a('<text x="%d" y="%d" text-anchor="middle">measured peak (MiB, exact bytes from the allocator)</text>'
      % (left + pw // 2, H - 15))
    a('<text transform="translate(22 %d) rotate(-90)" text-anchor="middle">step time / PyTorch eager (medians)</text>'
      % (top + ph // 2))

    def marker(kind, x, y, colour):
        if kind == "circle":
            return '<circle cx="%.1f" cy="%.1f" r="4.5" fill="%s"/>' % (x, y, colour)
        if kind == "square":
            return '<rect x="%.1f" y="%.1f" width="9" height="9" fill="%s"/>' % (x - 4.5, y - 4.5, colour)
        if kind == "diamond":
            return '<path d="M %.1f %.1f l 6 6 l -6 6 l -6 -6 z" fill="%s"/>' % (x, y - 6, colour)
        if kind == "triangle":
            return '<path d="M %.1f %.1f l 6 10 l -12 0 z" fill="%s"/>' % (x, y - 6, colour)
        return ('<path d="M %.1f %.1f l 10 10 M %.1f %.1f l -10 10" stroke="%s" stroke-width="2.5"/>'
                % (x - 5, y - 5, x + 5, y - 5, colour))

    for name, colour, kind, points, connect in series:
        if connect and len(points) > 1:
            a('<polyline fill="none" stroke="%s" stroke-width="1.5" points="%s"/>'
              % (colour, " ".join("%.1f,%.1f" % (X(p[0]), Y(p[1])) for p in points)))
        for p in points:
            a('<g>%s<title>%s: %s, %d B (%.1f MiB), %.2fx</title></g>' % (
                marker(kind, X(p[0]), Y(p[1]), colour), escape(name), escape(p[2]), p[0], p[0] / MIB, p[1]))
    # Legend.
    lx, ly = left + pw + 20, top + 10
    for i, (name, colour, kind, points, connect) in enumerate(series):
        y = ly + i * 24
        a(marker(kind, lx + 6, y, colour))
        a('<text x="%d" y="%d" font-size="11">%s</text>' % (lx + 18, y + 4, escape(name)))
    a("</svg>")
    return "\n".join(o) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("jsonl")
    p.add_argument("--model", required=True, help="gpt, cnn, or the user's TorchScript file as given")
    p.add_argument("--command", required=True, help="the command that reproduces the results")
    p.add_argument("--md", required=True)
    p.add_argument("--svg", required=True)
    a = p.parse_args(argv)
    torch_rows, memfit_rows = load(a.jsonl, a.model)
    if not any(r["variant"] == "eager" for r in torch_rows):
        print("vs_pytorch_table: no PyTorch eager row for %s in %s" % (a.model, a.jsonl), file=sys.stderr)
        return 1
    if not memfit_rows:
        print("vs_pytorch_table: no memfit rows for %s in %s" % (a.model, a.jsonl), file=sys.stderr)
        return 1
    with open(a.md, "w") as f:
        f.write(markdown(a.model, a.command, torch_rows, memfit_rows))
    with open(a.svg, "w") as f:
        f.write(svg(a.model, a.command, torch_rows, memfit_rows))
    print("wrote %s and %s" % (a.md, a.svg), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
