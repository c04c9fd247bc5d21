"""Where a test run's time went: the tables of a `pytest --times PATH` file (tests/cpu_times.py).

    python tools/test_times.py out/test-times.json [--top 25]
    python tools/test_times.py out/before.json out/after.json     # module by module, side by side

Prints the run (wall, load averages, CPU summed over tests, TensorFlow imports paid and children forked),
the modules and tests with the most CPU, and the processes that paid a TensorFlow import by the command they
ran. CPU is ``cpu_cgroup`` when the run could make cgroups (every process a test started, orphans too), else
``cpu_tree`` (tests/cpu_times.py says what each counts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections import Counter, defaultdict


def _cpu(row: dict) -> float:
    value = row.get("cpu_cgroup")
    return value if value else row.get("cpu_tree", 0.0)


def _command(line: dict) -> str:
    argv = line.get("argv") or ["?"]
    if argv[0] in ("-c", "-m") and len(argv) > 1:
        return " ".join(argv[:2])[:60]
    name = os.path.basename(argv[0])
    return "tests/procs.py code" if name == "child_script.py" else name


def summary(data: dict, top: int) -> str:
    run, lines = data["run"], []
    loads = [sample["load1"] for sample in run.get("load", [])]
    busy = [sample["machine_busy"] for sample in run.get("load", []) if sample.get("machine_busy") is not None]
    lines.append(f"run: {run['wall'] / 60:.1f} min wall, {run['tests']} tests; load1 mean "
                 f"{statistics.mean(loads) if loads else float('nan'):.1f} (min {min(loads, default=0):.1f}, max "
                 f"{max(loads, default=0):.1f}); machine busy {statistics.mean(busy) if busy else float('nan'):.0%}")
    cpu = sum(_cpu(t) for t in data["tests"])
    lines.append(f"CPU summed over tests: {cpu / 60:.1f} min (pytest processes {run['sum_cpu_self'] / 60:.1f} min); "
                 f"TensorFlow imports paid: {run['tf_imports']} ({run['tf_import_cpu'] / 60:.1f} min CPU), "
                 f"children forked: {run.get('forked', 0)}")
    modules = sorted(data["modules"].items(), key=lambda kv: -_cpu(kv[1]))
    lines.append(f"\ntop {top} modules by CPU:   cpu_s  wall_s  tests  tf_imports  import_cpu_s  forked")
    for name, row in modules[:top]:
        lines.append(f"  {name:58s} {_cpu(row):7.0f} {row['wall']:7.0f} {row['tests']:6d} {row['tf_imports']:10d} "
                     f"{row['tf_import_cpu']:13.0f} {row.get('forked', 0):7d}")
    lines.append(f"\ntop {top} tests by CPU:   cpu_s  wall_s  outcome")
    for row in sorted(data["tests"], key=lambda t: -_cpu(t))[:top]:
        lines.append(f"  {row['nodeid'][:100]:100s} {_cpu(row):6.0f} {row['wall']:6.0f}  {row.get('outcome', '')}")
    count, seconds = Counter(), defaultdict(float)
    for line in data.get("imports", []):
        if "module" in line:
            count[_command(line)] += 1
            seconds[_command(line)] += line["cpu"]
    lines.append("\nTensorFlow imports by command:   n  cpu_s")
    for command, n in count.most_common(top):
        lines.append(f"  {command:60s} {n:4d} {seconds[command]:6.0f}")
    started = Counter(", ".join(line["started"]) for line in data.get("imports", []) if line.get("started"))
    if started:
        lines.append("\nchildren tests/procs.py started (not forked) because of an import-time variable:   n")
        for variables, n in started.most_common(top):
            lines.append(f"  {variables[:90]:90s} {n:4d}")
    return "\n".join(lines)


def compare(before: dict, after: dict) -> str:
    lines = [f"{'module':60s} {'cpu before':>10s} {'after':>7s} {'wall before':>11s} {'after':>7s}"]
    names = sorted(set(before["modules"]) | set(after["modules"]),
                   key=lambda n: -_cpu(before["modules"].get(n, {"cpu_tree": 0})))
    for name in names:
        b, a = before["modules"].get(name, {}), after["modules"].get(name, {})
        lines.append(f"{name[:60]:60s} {_cpu(b) if b else 0:10.0f} {_cpu(a) if a else 0:7.0f} "
                     f"{b.get('wall', 0):11.0f} {a.get('wall', 0):7.0f}")
    totals = [(sum(_cpu(t) for t in d["tests"]), d["run"]["wall"]) for d in (before, after)]
    lines.append(f"{'total':60s} {totals[0][0]:10.0f} {totals[1][0]:7.0f} {totals[0][1]:11.0f} {totals[1][1]:7.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="one --times file, or two to compare")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    data = [json.load(open(path)) for path in args.paths]
    print(summary(data[0], args.top) if len(data) == 1 else compare(data[0], data[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
