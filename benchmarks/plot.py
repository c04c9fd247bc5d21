"""Turn benchmarks/results/<name>.json into PNGs next to them (matplotlib, Agg backend).

    python benchmarks/plot.py            # the full results -> <name>.png
    python benchmarks/plot.py --quick    # the smoke-test results -> <name>-quick.png

A missing (or unreadable) JSON is skipped with a note, never an error: run_all
calls this after whatever benchmarks ran.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

BLUE, ORANGE, GREY, GREEN, RED = "#1f77b4", "#ff7f0e", "#9a9a9a", "#2ca02c", "#d62728"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 9, "axes.titlesize": 10, "axes.spines.top": False,
                         "axes.spines.right": False})
    return plt


def _subtitle(data: dict) -> str:
    m = data.get("machine", {})
    quick = "  QUICK (smoke-test sizes: not a result)" if data.get("quick") else ""
    return (f"{m.get('cores')} cores, TF {m.get('tensorflow')}, Keras {m.get('keras')}, "
            f"stratkit {m.get('stratkit')}, {m.get('date')}{quick}")


def _finish(plt, fig, data: dict, title: str, path: Path) -> Path:
    fig.suptitle(title, fontsize=11, fontweight="bold")
    fig.text(0.5, 0.005, _subtitle(data), ha="center", va="bottom", fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def _wrap(text: str, width: int = 34) -> str:
    words, lines, line = text.split(), [], ""
    for word in words:
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return "\n".join(lines + [line])


# -- scaling ------------------------------------------------------------------------------------
def plot_scaling(data: dict, path: Path) -> Path:
    plt = _pyplot()
    rows = data["rows"]
    names = [_wrap(r["setting"]) for r in rows]
    y = list(range(len(rows)))[::-1]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 2.6 + 0.75 * len(rows)), sharey=True)

    h = 0.38
    two = [r["2-worker ex/s"] or 0 for r in rows]
    pair = [r["pair ex/s"] or 0 for r in rows]
    left.barh([v + h / 2 for v in y], two, h, color=BLUE, label="2-worker MWMS job")
    left.barh([v - h / 2 for v in y], pair, h, color=GREY, label="2 independent jobs at once (sum)")
    alone = rows[0].get("alone ex/s")
    if alone:
        left.axvline(alone, color=ORANGE, ls=":", lw=1.2, label="1 job alone")
        left.axvline(2 * alone, color=ORANGE, ls="--", lw=1.2, label="2 x 1 job alone (naive)")
    left.set_yticks(y, names)
    left.set_xlabel("examples / second (steady state, median)")
    left.set_title("Throughput")
    left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=7, frameon=False)

    eff = [r["efficiency"] or 0 for r in rows]
    colors = [GREEN if e >= data.get("goal_efficiency", 0.97) else RED for e in eff]
    right.barh(y, eff, 0.6, color=colors)
    # Rounds (bench_scaling.py): the mean, with the spread over rounds as a min-max whisker.
    spread = [(r.get("eff min"), r.get("eff max")) for r in rows]
    for yi, e, (lo, hi) in zip(y, eff, spread):
        if e and lo is not None and hi is not None and hi > lo:
            right.errorbar(e, yi, xerr=[[e - lo], [hi - e]], color="black", capsize=3, lw=1)
    for yi, e, r in zip(y, eff, rows):
        n = r.get("rounds")
        text = f"{e:.3f}" + (f" (n={n}, {r['eff min']:.2f}-{r['eff max']:.2f})" if n and n > 1 else "")
        if not r["efficiency"]:
            right.text(0.01, yi, "failed (see JSON)", va="center", fontsize=8, color=RED)
        elif e > 0.45:
            right.text(0.02, yi, text, va="center", ha="left", fontsize=8, color="white", fontweight="bold")
        else:
            right.text(e + 0.015, yi, text, va="center", fontsize=8)
    naive = rows[0].get("naive")
    if naive:
        right.plot([naive], [y[0] + 0.38], marker="v", markersize=8, color=ORANGE, ls="none",
                   label=f"naive, 2-worker / (2 x 1 job alone): {naive:.3f}")
    goal = data.get("goal_efficiency", 0.97)
    right.axvline(goal, color="black", ls="--", lw=1, label=f"goal {goal}")
    right.axvline(1.0, color=GREY, lw=0.8)
    right.set_xlim(0, max(1.1, max(eff) + 0.1))
    rounds = data.get("rounds")
    right.set_xlabel("efficiency = 2-worker / (2 simultaneous single jobs)")
    right.set_title("Scaling efficiency (fair baseline)"
                    + (f"\nmean of {rounds} alternating rounds, whisker = min-max" if rounds else ""))
    right.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=7, frameon=False)
    model = data.get("model", {})
    title = (f"2-worker MultiWorkerMirrored on loopback: ResNet-style, {model.get('params') or '?'} params, "
             f"batch {model.get('per_replica_batch')}/worker")
    return _finish(plt, fig, data, title, path)


# -- overhead -----------------------------------------------------------------------------------
def plot_overhead(data: dict, path: Path) -> Path:
    plt = _pyplot()
    rows = data["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = [f"{_wrap(r['strategy'], 18)}\n({r['replicas']} replica{'s' if r['replicas'] != 1 else ''})" for r in rows]
    x = range(len(rows))
    w = 0.38
    left.bar([i - w / 2 for i in x], [r["stratkit steps/s"] for r in rows], w, color=BLUE, label="trainer.fit")
    left.bar([i + w / 2 for i in x], [r["hand steps/s"] for r in rows], w, color=GREY,
             label="strategy.scope() + model.fit")
    left.set_xticks(list(x), names)
    left.set_ylabel("steps / second (median)")
    left.set_title("Throughput")
    left.legend(fontsize=7, frameon=False)
    ratios = [r["ratio"] for r in rows]
    goal = data.get("goal_ratio", 0.97)
    right.bar(list(x), ratios, 0.5, color=[GREEN if v >= goal else RED for v in ratios])
    for i, v in zip(x, ratios):
        right.text(i, v - 0.012, f"{v:.3f}", ha="center", va="top", fontsize=8, color="white", fontweight="bold")
    right.axhline(goal, color="black", ls="--", lw=1, label=f"goal {goal}")
    right.set_ylim(min(0.8, min(ratios) - 0.05), max(1.1, max(ratios) + 0.05))
    right.set_xticks(list(x), names)
    right.set_ylabel("stratkit / hand-written")
    right.set_title("Ratio")
    right.legend(fontsize=7, frameon=False, loc="upper right")
    return _finish(plt, fig, data, "stratkit Trainer overhead vs hand-written tf.distribute + Keras", path)


# -- all-reduce ---------------------------------------------------------------------------------
def plot_allreduce(data: dict, path: Path) -> Path:
    plt = _pyplot()
    rows = data["rows"]
    sizes = [r["bytes"] for r in rows]
    gradients = data.get("gradient_rows") or []
    sets = data.get("gradient_sets") or []
    if sets:
        fig, (ax, grad_ax) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [3, 3]})
        _plot_gradient_sets(grad_ax, sets, data.get("gradient_goal", 0.5))
    elif gradients:
        fig, (ax, grad_ax) = plt.subplots(1, 2, figsize=(13, 5.5), gridspec_kw={"width_ratios": [3, 2]})
        _plot_gradient_list(grad_ax, gradients, data.get("gradient_goal", 0.5))
    else:
        fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.plot(sizes, [r["busbw_MBps"] for r in rows], marker="o", color=BLUE, lw=2,
            label=f"MWMS all-reduce busbw ({data['workers']} workers, {data.get('strategy')})")
    ax.plot(sizes, [r["tcp_same_size_MBps"] for r in rows], marker=".", color=GREY, ls="--",
            label="loopback TCP, one-way transfer of the same size")
    tcp = data["tcp_bandwidth_Bps"] / 1e6
    ax.axhline(tcp, color=ORANGE, lw=1.5,
               label=f"loopback TCP B = {tcp:,.0f} MB/s  (bound: busbw <= B, i.e. t >= S/B * 2(n-1)/n)")
    peak = max(rows, key=lambda r: r["busbw_MBps"])
    ax.annotate(f"peak {peak['busbw_MBps']:,.0f} MB/s = {peak['busbw/TCP']:.2f} x B", (peak["bytes"],
                peak["busbw_MBps"]), textcoords="offset points", xytext=(-10, -28), fontsize=8, ha="right",
                arrowprops={"arrowstyle": "->", "color": "#555555"})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [f"{s // (1 << 20)} MiB" if s >= 1 << 20 else f"{s // 1024} KiB" for s in sizes],
                  rotation=35, ha="right")
    ax.minorticks_off()
    ax.set_xlabel("message size S (float32 tensor)")
    ax.set_ylabel("MB / second")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=1)
    return _finish(plt, fig, data, "All-reduce bus bandwidth vs loopback TCP", path)


def _plot_gradient_list(ax, rows: list[dict], goal: float) -> None:
    """Bars: the model's gradient list all-reduced per wire dtype (median, whisker = quartiles)."""
    names = [f"{r['dtype']}\ngradient_compression={r['compression']}\n{r['MB on wire']:.2f} MB on wire" for r in rows]
    t = [r["time_ms"] for r in rows]
    err = [[max(0.0, v - r["q1_ms"]) for v, r in zip(t, rows)], [max(0.0, r["q3_ms"] - v) for v, r in zip(t, rows)]]
    colors = [GREY if r["dtype"] == "float32" else BLUE for r in rows]
    x = list(range(len(rows)))
    ax.bar(x, t, 0.55, color=colors, yerr=err, capsize=4)
    for i, r in zip(x, rows):
        if r.get("vs float32") is not None:
            ax.text(i, t[i] / 2, f"x{r['vs float32']:.2f}", ha="center", va="center", fontsize=9, color="white",
                    fontweight="bold")
    base = next((r["time_ms"] for r in rows if r["dtype"] == "float32"), None)
    if base:
        ax.axhline(base * goal, color="black", ls="--", lw=1, label=f"goal: {goal:g} x float32")
        ax.legend(fontsize=7, frameon=False, loc="upper right")
    ax.set_xticks(x, names, fontsize=7)
    ax.set_ylabel("ms per all-reduce of the whole list (median)")
    ax.set_title(f"The scaling model's gradients ({rows[0]['tensors']} tensors), one step's all-reduce")


def _plot_gradient_sets(ax, rows: list[dict], goal: float) -> None:
    """Bars: 16-bit / float32 time of each gradient list on each link (mean over rounds, whisker = min-max)."""
    groups = list(dict.fromkeys((r["list"], r["link"]) for r in rows))
    width = 0.38
    for k, (dtype, color) in enumerate((("bfloat16", BLUE), ("float16", ORANGE))):
        mine = [next((r for r in rows if (r["list"], r["link"]) == g and r["dtype"] == dtype), None) for g in groups]
        x = [i + (k - 0.5) * width for i in range(len(groups))]
        v = [r["vs float32"] if r else 0.0 for r in mine]
        err = [[max(0.0, a - r["vs min"]) if r else 0 for a, r in zip(v, mine)],
               [max(0.0, r["vs max"] - a) if r else 0 for a, r in zip(v, mine)]]
        ax.bar(x, v, width, color=color, yerr=err, capsize=3, label=f"{dtype} / float32")
        for xi, a in zip(x, v):
            ax.text(xi, a + 0.03, f"{a:.2f}", ha="center", va="bottom", fontsize=7)
    ax.axhline(goal, color="black", ls="--", lw=1, label=f"goal: {goal:g} x float32")
    ax.axhline(1.0, color=GREY, lw=0.8)
    names = []
    for name, on in groups:
        base = next(r for r in rows if (r["list"], r["link"]) == (name, on) and r["dtype"] == "float32")
        names.append(f"{name}\n{base['MB on wire']:.0f} MB\n{on}\nfloat32 {base['time_ms']:.0f} ms")
    ax.set_xticks(range(len(groups)), names, fontsize=7)
    ax.set_ylim(0, 1.3)
    ax.set_ylabel("time of one step's gradient all-reduce, vs float32")
    ax.set_title("gradient_compression: one step's all-reduce, by model and link\n"
                 "(mean of alternating rounds; whisker = min-max over rounds)", fontsize=9)
    ax.legend(fontsize=7, frameon=False, loc="upper right")


# -- spark --------------------------------------------------------------------------------------
def plot_spark(data: dict, path: Path) -> Path:
    plt = _pyplot()
    rows = data["rows"]
    bars = []  # (label, breakdown or None, row)
    for row in rows:
        name = f"{row['way']}" + (f"\n{row['master']}" if row["master"] != "-" else "")
        runs = row.get("breakdown") or []
        if not runs:
            bars.append((name, None, row))
            continue
        chosen = [runs[0]] + ([runs[-1]] if len(runs) > 1 else [])
        for run in chosen:
            bars.append((f"{name}\n{'cold' if run['run'] == 'cold' else 'warm'} run", run, row))
    fig, ax = plt.subplots(figsize=(9.5, 2.0 + 0.62 * len(bars)))
    y = list(range(len(bars)))[::-1]
    seen = set()

    def label(text):
        if text in seen:
            return None
        seen.add(text)
        return text

    for yi, (_, run, row) in zip(y, bars):
        if run is None:
            ax.text(0.2, yi, _wrap(row.get("status", "no data"), 90), va="center", fontsize=7, color=RED)
            continue
        alpha = 0.55 if run["run"] == "cold" else 1.0
        first, train, rest = run["to_first_step_begin"], run["training"], max(0.0, run["after_training"])
        ax.barh(yi, first, 0.6, color=ORANGE, alpha=alpha, label=label("call -> first step begins"))
        ax.barh(yi, train, 0.6, left=first, color=BLUE, alpha=alpha,
                label=label("training (first step's tracing included)"))
        ax.barh(yi, rest, 0.6, left=first + train, color=GREY, alpha=alpha, label=label("end of training -> return"))
        note = f"{run['wall']:.1f}s"
        if run["run"] == "cold" and row.get("session s"):
            note += f"  (+ SparkSession start {row['session s']:.1f}s, once per application)"
        ax.text(run["wall"] + 0.3, yi, note, va="center", fontsize=7)
    ax.set_yticks(y, [b[0] for b in bars], fontsize=8)
    ax.set_xlabel("seconds from the run() / launch() call (cold: first run in the session; warm: a later one)")
    if seen:
        ax.legend(fontsize=7, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.1 - 0.3 / len(bars)),
                  ncol=3)
    xmax = max([b[1]["wall"] for b in bars if b[1]] + [1])
    ax.set_xlim(0, xmax * 1.75)
    job = data.get("job", {})
    title = (f"Same 2-worker training ({job.get('epochs')} x {job.get('steps')} steps, MLP): "
             "Spark runners vs stratkit launch")
    timelines = next((row["timeline"] for row in rows if row.get("timeline")), None)
    if timelines:
        _finish(plt, fig, data, title, path)
        return plot_spark_timeline(data, timelines, path.with_name(path.stem + "-timeline.png"))
    return _finish(plt, fig, data, title, path)


#: SparkRunner's phases as drawn: each segment ends at its milestone (who, event); missing ones are skipped.
SPARK_MILESTONES = [
    ("driver", "slots checked", "slot check"),
    ("driver", "stage submitted (attempt 1)", "stage submit"),
    ("worker:0", "task start", "Spark starts the task"),
    ("worker:0", "addresses gathered", "address all-gather"),
    ("worker:0", "run received", "TF import (overlapping the all-gather) / hand-over"),
    ("worker:0", "strategy ready", "strategy: all workers connected"),
    ("worker:0", "first step done", "first step (tracing, first collective)"),
    ("worker:0", "training ends", "training"),
    ("worker:0", "function returns", "after fit, in train_fn"),
    ("worker:0", "process exited", "training process exit"),
    ("driver", "run() returns", "result back, run() returns"),
]


def plot_spark_timeline(data: dict, timelines: dict, path: Path) -> Path:
    plt = _pyplot()
    colors = plt.get_cmap("tab20").colors
    fig, ax = plt.subplots(figsize=(9.5, 3.4))
    names = list(timelines)
    seen = set()
    for yi, name in enumerate(names[::-1]):
        events = {(e["who"], e["event"]): e["s"] for e in timelines[name]}
        previous = 0.0
        for index, (who, event, label) in enumerate(SPARK_MILESTONES):
            if (who, event) not in events:
                continue
            end = max(events[(who, event)], previous)
            ax.barh(yi, end - previous, 0.6, left=previous, color=colors[index % len(colors)],
                    label=None if label in seen else label)
            seen.add(label)
            previous = end
        ax.text(previous + 0.2, yi, f"{previous:.1f}s", va="center", fontsize=7)
    ax.set_yticks(range(len(names)), [f"SparkRunner\n{n} run" for n in names[::-1]], fontsize=8)
    ax.set_xlabel("seconds from the run() call (chief's task: worker:0)")
    ax.legend(fontsize=6.5, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3)
    return _finish(plt, fig, data, "SparkRunner per-phase timeline (RunReport.timeline)", path)


# -- input --------------------------------------------------------------------------------------
def plot_input(data: dict, path: Path) -> Path:
    plt = _pyplot()
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    models = []
    for r in rows:
        if r["model"] not in models:
            models.append(r["model"])
    w = 0.26
    for i, model in enumerate(models):
        mine = [r for r in rows if r["model"] == model]
        for j, r in enumerate(mine):
            ax.bar(i + (j - 1) * w, r["reader rows/s"], w, color=[BLUE, GREY][j % 2],
                   label=r["reader"] if i == 0 else None)
            ax.text(i + (j - 1) * w, r["reader rows/s"] * 1.08, f"{r['ratio']:.1f}x", ha="center", fontsize=8)
        ax.bar(i + (len(mine) - 1) * w, mine[0]["model ex/s"], w, color=ORANGE,
               label="model consumption (examples/s)" if i == 0 else None)
        ax.plot([i - 1.5 * w, i + 1.5 * w], [mine[0]["model ex/s"] * data["goal_ratio"]] * 2, color="black",
                ls="--", lw=1, label=f"goal: {data['goal_ratio']:g} x consumption" if i == 0 else None)
    ax.set_yscale("log")
    ax.set_xticks(range(len(models)), [{"mlp": "MLP (64 features)", "conv": "ResNet-style (32x32x3)"}.get(m, m)
                                       for m in models])
    ax.set_ylabel("rows (examples) / second, one worker")
    ax.legend(fontsize=7, frameon=False, loc="upper right")
    ax.set_ylim(top=ax.get_ylim()[1] * 3)
    return _finish(plt, fig, data, "Parquet -> tf.data reader vs model consumption (labels: reader / model)", path)


# -- ps (written by bench_ps.py) ----------------------------------------------------------------
def plot_ps(data: dict, path: Path) -> Path:
    plt = _pyplot()
    runs = data["runs"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for workers, color in ((1, GREY), (2, BLUE)):
        values = [r["examples_per_sec"] for r in runs if r["workers"] == workers]
        ax.scatter([workers] * len(values), values, color=color, alpha=0.6, zorder=3)
        ax.bar(workers, data["median_examples_per_sec"][str(workers)], 0.5, color=color, alpha=0.5)
    ax.set_xticks([1, 2], ["1 worker", "2 workers"])
    ax.set_ylabel("chief's examples / second")
    ratio = data.get("ratio_2_vs_1")
    ax.set_title(f"2 / 1 workers: {ratio:.2f}x (goal {data.get('goal_ratio')}x)" if ratio else "")
    return _finish(plt, fig, data, "Parameter-server training, 1 ps", path)


# -- elastic (written by bench_elastic.py) ------------------------------------------------------
def plot_elastic(data: dict, path: Path) -> Path:
    """Median seconds per event (dots: each run); with a baseline, its rows ("before") in grey above each."""
    plt = _pyplot()
    rows = [dict(r, label=f"before: {r['event']}") for r in data.get("before_rows") or []]
    rows += [dict(r, label=(f"after: {r['event']}" if rows else r["event"])) for r in data["rows"]]
    rows.sort(key=lambda r: (r["event"], not r["label"].startswith("before")))
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.5 * len(rows)))
    for i, row in enumerate(rows):
        color = GREY if row["label"].startswith("before") else [BLUE, ORANGE][(i // (2 if len(rows) > 2 else 1)) % 2]
        ax.barh(i, row["median s"], 0.5, color=color, alpha=0.7)
        ax.scatter(row["raw"], [i] * len(row["raw"]), color="black", s=12, zorder=3)
        ax.text(row["max s"] + 0.3, i, f"median {row['median s']:.1f} s", va="center", fontsize=8)
    ax.axvline(data["goal_seconds"], color="black", ls="--", lw=1, label=f"goal {data['goal_seconds']:g} s")
    ax.set_yticks(range(len(rows)), [_wrap(r["label"], 34) for r in rows], fontsize=7)
    ax.set_xlabel("seconds (dots: each run)")
    ax.set_xlim(0, max(max(r["max s"] for r in rows) + 6, data["goal_seconds"] + 2))
    ax.legend(fontsize=7, frameon=False, loc="center right")
    flags = " ".join(data["flags"][:4]) if "--stop-grace" in data["flags"] else "default flags"
    return _finish(plt, fig, data, f"Elastic launch on two test hosts ({flags})", path)


# -- ray (written by bench_ray.py) --------------------------------------------------------------
def plot_ray(data: dict, path: Path) -> Path:
    """Wall of the call cold and warm, and steady-state steps/s, per engine: mean bars, min-max whiskers."""
    plt = _pyplot()
    rows = [r for r in data["rows"] if r.get("cold wall s mean") is not None]
    fig, (walls, rates) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [3, 2]})
    labels = [_wrap(r["engine"], 24) for r in rows]
    for offset, key, color in ((-0.2, "cold", BLUE), (0.2, "warm", ORANGE)):
        means = [r[f"{key} wall s mean"] or 0 for r in rows]
        errors = [[m - (r[f"{key} wall s min"] or m) for m, r in zip(means, rows)],
                  [(r[f"{key} wall s max"] or m) - m for m, r in zip(means, rows)]]
        walls.bar([i + offset for i in range(len(rows))], means, 0.4, yerr=errors, color=color, alpha=0.8,
                  capsize=3, label=key)
    walls.set_xticks(range(len(rows)), labels, fontsize=7)
    walls.set_ylabel("seconds, call to return")
    walls.legend(fontsize=7, frameon=False)
    means = [r["steps/s mean"] or 0 for r in rows]
    errors = [[m - (r["steps/s min"] or m) for m, r in zip(means, rows)],
              [(r["steps/s max"] or m) - m for m, r in zip(means, rows)]]
    rates.bar(range(len(rows)), means, 0.5, yerr=errors, color=GREEN, alpha=0.8, capsize=3)
    rates.set_xticks(range(len(rows)), labels, fontsize=7)
    rates.set_ylabel("steady-state steps / second")
    loads = [v for e in data.get("load_average", []) for v in (e["load_before"][0], e["load_after"][0])]
    load = f", load {min(loads):.1f}-{max(loads):.1f}" if loads else ""
    return _finish(plt, fig, data, f"Same 2-worker job on Ray Train, RayRunner, SparkRunner "
                   f"({data['job']['rounds']} rounds, mean, min-max{load})", path)


# -- step backups (written by bench_backups.py) -------------------------------------------------
def plot_backups(data: dict, path: Path) -> Path:
    plt = _pyplot()
    rows = data["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    labels = [f"{_wrap(r['model'].split(' (')[0], 12)}\n{r['variant']}" for r in rows]
    x = range(len(rows))
    means = [r["step ms"] for r in rows]
    low = [m - r["step min ms"] for m, r in zip(means, rows)]
    high = [r["step max ms"] - m for m, r in zip(means, rows)]
    left.bar(list(x), means, 0.6, yerr=[low, high], capsize=3,
             color=[GREY if r["variant"] == "none" else BLUE for r in rows])
    left.set_xticks(list(x), labels, fontsize=7)
    left.set_ylabel("ms per step (mean, min-max)")
    left.set_title("Time per step")
    written = [r for r in rows if r["write ms"] is not None]
    right.bar(range(len(written)), [r["write ms"] for r in written], 0.6, color=BLUE,
              yerr=[[r["write ms"] - r["write min ms"] for r in written],
                    [r["write max ms"] - r["write ms"] for r in written]], capsize=3)
    right.set_xticks(range(len(written)), [labels[rows.index(r)] for r in written], fontsize=7)
    right.set_ylabel("ms per backup write (mean, min-max)")
    right.set_title("Write time")
    return _finish(plt, fig, data, f"Step backups: cost per step and per write ({data['rounds']} alternating rounds)",
                   path)


# -- batch inference (written by bench_inference.py) ----------------------------------------------
def plot_inference(data: dict, path: Path) -> Path:
    """Rows per second per way: mean bars, min-max whiskers, each run a dot."""
    plt = _pyplot()
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    means = [r["rows/s"] for r in rows]
    colors = [BLUE if r["way"].startswith("stratkit") else GREY if "zeros" in r["way"] else ORANGE for r in rows]
    ax.bar(range(len(rows)), means, 0.55, capsize=3, color=colors,
           yerr=[[m - r["min rows/s"] for m, r in zip(means, rows)], [r["max rows/s"] - m for m, r in zip(means, rows)]])
    for i, row in enumerate(rows):
        runs = [run["rows_per_second"] for run in data["runs"] if run["way"] == row["way"]]
        ax.plot([i] * len(runs), runs, "k.", markersize=4)
        ax.text(i, row["max rows/s"], f"{row['vs pandas UDF']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), [_wrap(r["way"], 22) for r in rows], fontsize=7)
    ax.set_ylabel("rows / second (mean, min-max)")
    loads = [v for run in data["runs"] for v in (run["load_before"][0], run["load_after"][0])]
    job = data["job"]
    return _finish(plt, fig, data, f"Scoring {job['rows']:,} rows on {job['master']} ({job['rounds']} rounds, "
                   f"load {min(loads):.1f}-{max(loads):.1f})", path)


PLOTS = {"scaling": plot_scaling, "overhead": plot_overhead, "allreduce": plot_allreduce, "spark": plot_spark,
         "input": plot_input, "ps": plot_ps, "elastic": plot_elastic, "ray": plot_ray, "backups": plot_backups,
         "inference": plot_inference}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="plot the -quick JSONs (smoke-test sizes)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="directory of the JSONs (and the PNGs)")
    parser.add_argument("names", nargs="*", help=f"only these ({', '.join(PLOTS)})")
    args = parser.parse_args(argv)
    suffix = "-quick" if args.quick else ""
    results = args.results
    failed = 0
    for name, plot in PLOTS.items():
        if args.names and name not in args.names:
            continue
        source = results / f"{name}{suffix}.json"
        if not source.exists():
            print(f"plot: skip {name}: no {source.name}")
            continue
        try:
            data = json.loads(source.read_text())
            print(f"plot: wrote {plot(data, results / f'{name}{suffix}.png')}")
        except Exception:  # noqa: BLE001 - one unreadable result must not stop the other plots
            failed += 1
            print(f"plot: could not plot {source.name}:\n{traceback.format_exc(limit=3)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
