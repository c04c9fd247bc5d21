"""Elastic launch: seconds from a host's loss to the first step at the smaller size, and from a late host's
start to the first step at the larger size (`stratkit launch --nnodes 1:2` on two test hosts), split by phase.

Two test hosts (network namespaces h1, h2 on 198.18.0.0/24, made as the test
suite makes them: tests/hosts.py; needs root) each run, at the launcher's
default flags (`--stop-grace 10`, `--rdzv-last-call 3`; `--fast` adds the old
`--stop-grace 2 --rdzv-last-call 2`),

    stratkit launch --nnodes 1:2 --rdzv-endpoint 198.18.0.1:29400 -- \\
        python tests/launch/elastic_train.py ... --every 5 --step-pause 0.1

(the elastic tests' training script: a small regression, global batch 8, step
backups every 5 steps, 0.1 s per step so that a change lands mid-epoch).

* loss: both hosts train; at global step 17 (mid-epoch 2) every process of h2
  is SIGKILLed; the time runs from that kill to h1's first step at 1 replica.
* arrival: h1 trains alone; at its global step 17 h2's launcher starts; the
  time runs from that start to h1's first step at 2 replicas.

Phases, from the marks h1's launcher and its tasks write (`stratkit.timeline`,
STRATKIT_TIMELINE), each as seconds since the loss or the start: the change
seen by the rendezvous, the running round ended (the decision reached h1),
h1's old tasks stopped, the new round formed, the new task started,
TensorFlow imported, the strategy up (every worker connected), the backup
loaded, the first step. A stratkit that writes fewer marks (`--baseline`, an
older tree) gets what its output lines show: the line's arrival time here.
From worker 0's step log, version-blind: how long training paused (its last
step at the old size done -> its first at the new size done; for an arrival
that is the running cluster's cost, while the total also holds the new
host's own start-up) and how many steps the new world trained again.

`--baseline DIR` measures another stratkit source tree too (e.g. main's:
`git archive main | tar -x -C DIR`), alternating with this one round by round
(before, after, then after, before, ...), so that the machine's load moves
both alike; each sample records the load average when it started and ended.
Median of `--rounds` (3; --quick: 1, this tree only) with min and max. Each
measurement ends once the first step at the new size is seen.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import print_table, write_result

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

import hosts  # noqa: E402  (tests/hosts.py: the test hosts)

SCRIPT = ROOT / "tests" / "launch" / "elastic_train.py"
TOKEN = "0123456789abcdef0123456789abcdef"
DEFAULT_FLAGS = ["--rdzv-timeout", "60"]
FAST_FLAGS = ["--stop-grace", "2", "--rdzv-last-call", "2", "--rdzv-timeout", "60"]
EPOCHS = 20  # 240 steps of >= 0.1 s: training goes on well past any change measured here
AT_STEP = 17  # mid-epoch 2 (12 steps an epoch), not a multiple of the backup interval
GOAL = 15.0

#: (phase, h1's timeline mark(s), or else a pattern of h1's output lines), in the order they happen.
PHASES = (
    ("change seen", ("rdzv: node lost", "rdzv: node arrived"), None),
    ("round ended", ("rdzv: round ended",), None),
    ("old tasks stopped", ("tasks stopped",), r"membership change \("),
    ("new round formed", ("rdzv: round formed",), r"\] node 0 of \d"),
    ("task started", ("task started",), r"worker:0 started: pid"),
    ("TensorFlow imported", ("tensorflow imported",), None),
    ("strategy up", ("strategy ready",), None),
    ("backup loaded", ("backup loaded",), r"\[worker:0\] \[stratkit\] resumed from"),
    ("first step", (), None),  # the script's own FIRST_STEP time
)


class _Launcher:
    """A launcher on a test host, its output collected line by line with the time each line arrived."""

    def __init__(self, host: hosts.Host, tree: Path, workdir: Path, flags: list[str]) -> None:
        self.timeline = workdir / f"timeline-{host.name}.jsonl"
        env = dict(os.environ, STRATKIT_RDZV_TOKEN=TOKEN, PYTHONUNBUFFERED="1", STRATKIT_TIMELINE=str(self.timeline),
                   PYTHONPATH=os.pathsep.join([str(tree)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        env.pop("TF_CONFIG", None)
        argv = [sys.executable, "-m", "stratkit.cli", "launch", "--nnodes", "1:2", "--rdzv-endpoint",
                "198.18.0.1:29400", *flags, "--", sys.executable, str(SCRIPT), str(workdir / "result"),
                str(workdir / "backup"), str(EPOCHS), "0", "--every", "5", "--step-pause", "0.1", "--steps-log",
                str(workdir / "steps.log")]
        self.started = time.time()
        self.proc = host.popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, cwd=str(tree))
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.time(), line))

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            for _, line in self.lines[seen:]:
                match = re.search(pattern, line)
                if match:
                    return match
            seen = len(self.lines)
            if self.proc.poll() is not None and seen == len(self.lines):
                break
            time.sleep(0.05)
        raise RuntimeError(f"no {pattern!r} within {timeout} s:\n{self.text()[-3000:]}")

    def line_time(self, pattern: str, since: float) -> float | None:
        return next((t for t, line in self.lines if t >= since and re.search(pattern, line)), None)

    def text(self) -> str:
        return "".join(line for _, line in self.lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def _wait_for_step(workdir: Path, replicas: int, launcher: _Launcher, timeout: float) -> None:
    """Until worker 0 logged global step >= AT_STEP at `replicas` replicas."""
    deadline = time.monotonic() + timeout
    path = workdir / "steps.log"
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if any(int(w[1]) >= AT_STEP and int(w[3]) == replicas for w in (line.split() for line in lines)
               if len(w) >= 4 and w[0] == "STEP"):
            return
        if launcher.proc.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"no step {AT_STEP} at {replicas} replica(s) within {timeout} s:\n{launcher.text()[-3000:]}")


def _steps(workdir: Path) -> list[tuple[int, int, float]]:
    """(global step, replicas, time) of each step worker 0 trained (tests/launch/elastic_train.py --steps-log)."""
    path = workdir / "steps.log"
    words = [line.split() for line in (path.read_text().splitlines() if path.exists() else [])]
    return [(int(w[1]), int(w[3]), float(w[7])) for w in words if len(w) >= 8 and w[0] == "STEP"]


def _training(workdir: Path, old: int, new: int, timeout: float = 20.0) -> dict[str, float | int | None]:
    """How long training paused (the last step at `old` replicas done -> the first at `new` done) and how many
    steps the new world trained again, from worker 0's step log (waits for the new size's first step)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not any(n == new for _, n, _ in _steps(workdir)):
        time.sleep(0.05)
    steps = _steps(workdir)
    first_new = next((i for i, (_, n, _) in enumerate(steps) if n == new), None)
    if first_new is None or first_new == 0 or steps[first_new - 1][1] != old:
        return {"paused": None, "trained again": None}
    before = {s for s, _, _ in steps[:first_new]}
    again = sum(1 for s, _, _ in steps[first_new:] if s in before)
    return {"paused": round(steps[first_new][2] - steps[first_new - 1][2], 3), "trained again": again}


def _phases(first: _Launcher, since: float, step: float) -> dict[str, float | None]:
    """Each phase's time, seconds after `since`: h1's timeline mark, else its output line, else None."""
    marks = [m for m in _read_marks(first.timeline) if m["t"] >= since]
    out: dict[str, float | None] = {}
    for name, events, pattern in PHASES:
        when = next((m["t"] for m in marks if m["event"] in events), None)
        if when is None and pattern is not None:
            when = first.line_time(pattern, since)
        if name == "first step":
            when = step
        out[name] = None if when is None else round(when - since, 3)
    return out


def _read_marks(path: Path) -> list[dict]:
    marks = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                marks.append(json.loads(line))
            except ValueError:
                continue
    return marks


def loss_once(tree: Path, flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="stratkit-bench-elastic-") as tmp, hosts.make_hosts(2) as (h1, h2):
        workdir = Path(tmp)
        first = _Launcher(h1, tree, workdir, flags)
        time.sleep(1)
        second = _Launcher(h2, tree, workdir, flags)
        try:
            _wait_for_step(workdir, 2, first, 180)
            killed = time.time()
            h2.kill_all()  # every process of h2 at once (tests/hosts.py, as the elastic tests kill a host)
            step = float(first.wait_for(r"FIRST_STEP (\d+\.\d+) replicas 1 ", 120).group(1))
            return {"total": round(step - killed, 3), "phases": _phases(first, killed, step),
                    **_training(workdir, 2, 1)}
        finally:
            first.stop()
            second.stop()


def arrival_once(tree: Path, flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="stratkit-bench-elastic-") as tmp, hosts.make_hosts(2) as (h1, h2):
        workdir = Path(tmp)
        first = _Launcher(h1, tree, workdir, flags)
        second = None
        try:
            _wait_for_step(workdir, 1, first, 180)
            second = _Launcher(h2, tree, workdir, flags)
            step = float(first.wait_for(r"FIRST_STEP (\d+\.\d+) replicas 2 ", 120).group(1))
            return {"total": round(step - second.started, 3), "phases": _phases(first, second.started, step),
                    **_training(workdir, 1, 2)}
        finally:
            first.stop()
            if second is not None:
                second.stop()


def _measure(version: str, tree: Path, event: str, flags: list[str]) -> dict:
    load = os.getloadavg()[0]
    sample = (loss_once if event == "loss" else arrival_once)(tree, flags)
    sample.update(version=version, event=event, load_before=round(load, 2), load_after=round(os.getloadavg()[0], 2))
    print(f"{version:6} {event:8} {sample['total']:6.2f} s  paused {sample['paused']} s, trained again "
          f"{sample['trained again']}  (load {sample['load_before']:.1f} -> {sample['load_after']:.1f})  "
          + "  ".join(f"{k} {v}" for k, v in sample["phases"].items()), flush=True)
    return sample


EVENTS = {"loss": "host lost -> first step at the smaller size (2 -> 1)",
          "arrival": "late host starts -> first step at the larger size (1 -> 2)"}


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 2) if known else None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one measurement of each, this tree only")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another stratkit source tree, measured alternately with this one ('before')")
    parser.add_argument("--fast", action="store_true", help="--stop-grace 2 --rdzv-last-call 2 (else the defaults)")
    args = parser.parse_args(argv)
    reason = hosts.unavailable_reason()
    if reason:
        sys.exit(f"bench_elastic needs test hosts: {reason}")
    flags = FAST_FLAGS if args.fast else DEFAULT_FLAGS
    rounds = args.rounds or (1 if args.quick else 3)
    versions = [("after", ROOT)] if args.baseline is None or args.quick else [("before", args.baseline), ("after", ROOT)]
    load_before = os.getloadavg()
    started = time.monotonic()
    samples: list[dict] = []
    for number in range(rounds):  # alternating, so that a change in the machine's load hits both alike
        order = versions if number % 2 == 0 else versions[::-1]
        for event in EVENTS:
            for version, tree in order:
                samples.append(_measure(version, tree, event, flags))
    rows, phase_rows = [], []
    for version, _ in versions:
        for event, what in EVENTS.items():
            mine = [s for s in samples if s["version"] == version and s["event"] == event]
            values = [s["total"] for s in mine]
            rows.append({"version": version, "event": what, "median s": statistics.median(values),
                         "min s": min(values), "max s": max(values), "runs": len(values), "raw": values,
                         "paused median s": _median([s["paused"] for s in mine]),
                         "trained again": [s["trained again"] for s in mine],
                         "load": [s["load_before"] for s in mine]})
    for event in EVENTS:
        for name, _, _ in PHASES:
            row = {"event": event, "phase (s since the change)": name}
            for version, _ in versions:
                row[f"{version} median"] = _median([s["phases"][name] for s in samples
                                                    if s["version"] == version and s["event"] == event])
            phase_rows.append(row)
    load_after = os.getloadavg()
    title = f"Elastic launch on two test hosts ({' '.join(flags)}), load {load_before[0]:.2f} -> {load_after[0]:.2f}"
    print_table(title, [{k: v for k, v in row.items() if k != "raw"} for row in rows])
    print_table("Phases: median seconds after the loss / the late launcher's start ('-': no such mark)",
                [{k: ("-" if v is None else v) for k, v in row.items()} for row in phase_rows])
    payload = {"quick": args.quick, "flags": flags, "rows": [r for r in rows if r["version"] == "after"],
               "before_rows": [r for r in rows if r["version"] == "before"], "phases": phase_rows,
               "samples": samples, "baseline": str(args.baseline) if args.baseline else None,
               "loadavg_before": load_before, "loadavg_after": load_after, "goal_seconds": GOAL,
               "wall_seconds": time.monotonic() - started}
    print(f"wrote {write_result('elastic' + ('-quick' if args.quick else ''), payload)}")
    return payload


if __name__ == "__main__":
    main()
