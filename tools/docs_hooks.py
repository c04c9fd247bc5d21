"""MkDocs hooks: the pages' generated parts, rendered from the code and the results at build time.

    <!-- generated: cli -->          every `stratkit ... --help`, from the argparse parsers themselves
    <!-- generated: performance -->  the headline numbers of benchmarks/results/*.json
    <!-- generated: replica-check --> the replica check's cost, from benchmarks/results/replica_check.json

and the benchmark plots (benchmarks/results/*.png) served as assets/results/*.png,
so the docs show the files `make bench` wrote, not copies of them.

`python tools/docs_hooks.py cli` prints the CLI reference (tests compare it with `--help`).
Imports no TensorFlow: `stratkit.cli` builds its parsers without it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
#: argparse wraps help to the terminal; a fixed width makes the page the same on every machine.
HELP_COLUMNS = "100"
CLI_COMMANDS = ((), ("info",), ("tf-config",), ("launch",))


@contextlib.contextmanager
def _columns(width: str) -> Iterator[None]:
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = width
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = before


def cli_help(command: tuple[str, ...]) -> str:
    """What `stratkit <command> --help` prints with COLUMNS=HELP_COLUMNS."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from stratkit.cli import build_parser

    with _columns(HELP_COLUMNS):
        parser = build_parser()
        for name in command:
            sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
            parser = sub.choices[name]
        return parser.format_help()


def cli_reference() -> str:
    parts = []
    for command in CLI_COMMANDS:
        title = " ".join(("stratkit", *command))
        parts.append(f"## `{title}`\n\n```text\n{cli_help(command).rstrip()}\n```\n")
    return "\n".join(parts)


# ----------------------------------------------------------------------------------------------
# Performance: one line per benchmark, from its JSON
# ----------------------------------------------------------------------------------------------


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _date(data: dict[str, Any]) -> str:
    return str(data.get("machine", {}).get("date", "?"))[:16]


def _setting(row: dict[str, Any]) -> str:
    name = row["setting"].split(" (")[0]
    return name if row["link"] in name else f"{name} on {row['link']}"


def _rows() -> list[tuple[str, str, str, str, str]]:
    rows = []
    if data := _load("overhead"):
        cells = ", ".join(f"{r['strategy']} **{r['ratio']:.2f}x**" for r in data["rows"])
        rows.append(("Overhead: `trainer.fit` vs hand-written `strategy.scope()` + `model.fit`, steps/s",
                     cells, f">= {data['goal_ratio']}", _date(data), "`overhead.json`"))
    if data := _load("scaling"):
        cells = "; ".join(f"{_setting(r)}: **{r['efficiency']:.2f}** ({r['eff min']:.2f}-{r['eff max']:.2f})"
                          for r in data["rows"])
        rows.append((f"Scaling efficiency, {data.get('workers', 2)}-worker MWMS vs two single-worker jobs at "
                     f"the same time, mean of {data['rounds']} rounds (min-max)", cells,
                     f">= {data['goal_efficiency']}", _date(data), "`scaling.json`"))
    if data := _load("allreduce"):
        rows.append(("All-reduce bus bandwidth (2 workers, gRPC collectives), best size, vs loopback TCP",
                     f"**{data['peak_busbw_MBps']:.0f} MB/s** = **{data['peak_busbw_over_tcp']:.2f}x** of "
                     f"{data['tcp_bandwidth_Bps'] / 1e9:.1f} GB/s", "bound: t >= (S/B) * 2(n-1)/n",
                     _date(data), "`allreduce.json`"))
        by = data.get("bf16_over_float32_by", {})
        rows.append(("`gradient_compression='bf16'`: one step's gradient exchange, bf16 time / float32 time",
                     "; ".join(f"{k}: **{v:.2f}x**" for k, v in by.items()), f"<= {data['gradient_goal']}",
                     _date(data), "`allreduce.json`"))
    if data := _load("ps"):
        rows.append(("Parameter server: 2 workers vs 1 worker, examples/s", f"**{data['ratio_2_vs_1']:.2f}x**",
                     f">= {data['goal_ratio']}x", _date(data), "`ps.json`"))
    if data := _load("spark"):
        ours = next((r for r in data["rows"] if "cold vs peer" in r), None)
        if ours:
            peer = next(r for r in data["rows"] if r["way"] == "spark-tensorflow-distributor")
            rows.append((f"Spark, same 2-worker job, `{data['master']}`: `run()` wall vs spark-tensorflow-"
                         f"distributor, cold / warm, {ours['rounds']} rounds",
                         f"**{ours['cold vs peer']:.2f}x** / **{ours['warm vs peer']:.2f}x** "
                         f"({ours['cold wall s']:.1f} / {ours['warm wall s']:.1f} s vs "
                         f"{peer['cold wall s']:.1f} / {peer['warm wall s']:.1f} s); call to first step "
                         f"{ours['to first step s']:.1f} s vs {peer['to first step s']:.1f} s",
                         "<= 1.0 (aim 0.8)", _date(data), "`spark.json`"))
    if data := _load("ray"):
        measured = [r for r in data["rows"] if r.get("cold wall s mean") is not None]
        loads = [v for e in data.get("load_average", []) for v in (e["load_before"][0], e["load_after"][0])]
        if measured and loads:
            cells = "; ".join(f"{r['engine']} **{r['cold wall s mean']:.1f} / {r['warm wall s mean']:.1f} s**, "
                              f"{r['steps/s mean']:.0f} steps/s" for r in measured)
            rows.append((f"Ray, same 2-worker job: wall of the call cold / warm, steady-state steps/s, mean of "
                         f"{data['job']['rounds']} rounds (load {min(loads):.1f}-{max(loads):.1f})", cells, "",
                         _date(data), "`ray.json`"))
    if data := _load("input"):
        cells = ", ".join(f"{r['model']} **{r['ratio']:.1f}x**" for r in data["rows"]
                          if r["reader"].startswith("ParquetShard"))
        rows.append(("Parquet -> tf.data reader (`stratkit.spark`'s shard reader) vs model consumption",
                     cells, f">= {data['goal_ratio']}x", _date(data), "`input.json`"))
    return rows


def performance_table() -> str:
    lines = ["| benchmark | measured | goal | run | file |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in _rows()]
    return "\n".join(lines)


def replica_check_table() -> str:
    """bench_replica_check's rows: the epoch with the check / without, and one check's own time."""
    data = _load("replica_check")
    if not data:
        return "*(no `benchmarks/results/replica_check.json` yet: run `benchmarks/bench_replica_check.py`)*"
    lines = [f"Run {_date(data)}, {data['steps_per_epoch']} steps per epoch, global batch 32.", "",
             "| strategy | model | variables | epoch without the check | one check | its share of the epoch | "
             "epoch with / without (mean, min-max) | rounds | load before-after |", "|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        share = r.get("check_share", r["check_ms"] / 1000 / r["epoch_s_off"])
        lines.append(f"| {r['strategy'].replace('_', ' ')} | {r['model']} | {r['variables']} | "
                     f"{r['epoch_s_off']:.2f} s | {r['check_ms']:.1f} ms | **{100 * share:.2f}%** | "
                     f"{r['ratio_mean']:.3f} "
                     f"({r['ratio_min']:.3f}-{r['ratio_max']:.3f}) | {r['rounds']} | "
                     f"{r['load_before']}-{r['load_after']} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# MkDocs hooks
# ----------------------------------------------------------------------------------------------

GENERATORS = {"<!-- generated: cli -->": cli_reference, "<!-- generated: performance -->": performance_table,
              "<!-- generated: replica-check -->": replica_check_table}


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"assets/results/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    for marker, generate in GENERATORS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, generate())
    return markdown


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "cli"
    print(cli_reference() if what == "cli" else performance_table())
