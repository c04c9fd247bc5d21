"""Elastic launch: seconds from a host's loss to the first step at the smaller size, and from a late host's
arrival to the first step at the larger size (`stratkit launch --nnodes 1:2` on two test hosts).

Two test hosts (network namespaces h1, h2 on 198.18.0.0/24, made as the test
suite makes them: tests/hosts.py; needs root) each run

    stratkit launch --nnodes 1:2 --rdzv-endpoint 198.18.0.1:29400 --stop-grace 2 --rdzv-last-call 2 \\
        -- python tests/launch/elastic_train.py ...

(the training script of the elastic tests: a small regression, global batch 8,
backup_dir, a pause after each epoch). The script prints the wall-clock time of
its process's first training step (`FIRST_STEP <unix time> replicas <n>`).

* loss: both hosts train; after epoch 1 every process of h2 is SIGKILLed; the
  row is the time from that kill to h1's first step with 1 replica. It holds:
  the loss seen (at once: the connection closes), SETTLE (1 s), stopping h1's
  task (--stop-grace: MultiWorkerMirrored tasks catch SIGTERM, so the SIGKILL
  after the grace ends them), the rejoin and --rdzv-last-call, the new task's
  start-up (TensorFlow import, strategy, the model), the resume from backup.
* arrival: h1 trains alone; after its epoch 1, h2's launcher starts; the row is
  the time from that start to the first step at 2 replicas (h1's task). It
  holds h2's launcher start-up, SETTLE, stopping h1's task, the last call, two
  tasks' start-up and the resume.

Median of 3 (--quick: 1) with the spread (min, max); load averages before and
after. Each measurement ends once the first step is seen (the rest of the run
is the elastic tests' business).
"""

from __future__ import annotations

import argparse
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
FLAGS = ["--stop-grace", "2", "--rdzv-last-call", "2", "--rdzv-timeout", "60"]
_FIRST = re.compile(r"FIRST_STEP (\d+\.\d+) replicas (\d+)")


class _Launcher:
    """A launcher on a test host, its output collected line by line with the time each line arrived."""

    def __init__(self, host: hosts.Host, workdir: Path, env: dict[str, str]) -> None:
        argv = [sys.executable, "-m", "stratkit.cli", "launch", "--nnodes", "1:2", "--rdzv-endpoint",
                "198.18.0.1:29400", *FLAGS, "--", sys.executable, str(SCRIPT), str(workdir / "result"),
                str(workdir / "backup"), "8", "1.5"]
        self.started = time.time()
        self.proc = host.popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, cwd=str(ROOT))
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            for line in self.lines[seen:]:
                match = re.search(pattern, line)
                if match:
                    return match
            seen = len(self.lines)
            if self.proc.poll() is not None and seen == len(self.lines):
                break
            time.sleep(0.05)
        raise RuntimeError(f"no {pattern!r} within {timeout} s:\n{''.join(self.lines)[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def _env() -> dict[str, str]:
    env = dict(os.environ, STRATKIT_RDZV_TOKEN=TOKEN, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env.pop("TF_CONFIG", None)
    return env


def loss_once() -> float:
    with tempfile.TemporaryDirectory(prefix="stratkit-bench-elastic-") as tmp, hosts.make_hosts(2) as (h1, h2):
        first = _Launcher(h1, Path(tmp), _env())
        time.sleep(1)
        second = _Launcher(h2, Path(tmp), _env())
        try:
            first.wait_for(r"EPOCH 1 replicas 2", 120)
            killed = time.time()
            h2.kill_all()  # every process of h2 at once (tests/hosts.py, as the elastic tests kill a host)
            step = float(first.wait_for(r"FIRST_STEP (\d+\.\d+) replicas 1 ", 120).group(1))
            return step - killed
        finally:
            first.stop()
            second.stop()


def arrival_once() -> float:
    with tempfile.TemporaryDirectory(prefix="stratkit-bench-elastic-") as tmp, hosts.make_hosts(2) as (h1, h2):
        first = _Launcher(h1, Path(tmp), _env())
        second = None
        try:
            first.wait_for(r"EPOCH 1 replicas 1", 120)
            second = _Launcher(h2, Path(tmp), _env())
            step = float(first.wait_for(r"FIRST_STEP (\d+\.\d+) replicas 2 ", 120).group(1))
            return step - second.started
        finally:
            first.stop()
            if second is not None:
                second.stop()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one measurement of each, for the smoke test")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args(argv)
    reason = hosts.unavailable_reason()
    if reason:
        sys.exit(f"bench_elastic needs test hosts: {reason}")
    rounds = args.rounds or (1 if args.quick else 3)
    load_before = os.getloadavg()
    started = time.monotonic()
    samples: dict[str, list[float]] = {"loss": [], "arrival": []}
    for _ in range(rounds):  # alternating, so that a change in the machine's load hits both alike
        samples["loss"].append(loss_once())
        samples["arrival"].append(arrival_once())
    rows = []
    for event, what in (("loss", "host lost -> first step at the smaller size (2 -> 1)"),
                        ("arrival", "late host starts -> first step at the larger size (1 -> 2)")):
        values = samples[event]
        rows.append({"event": what, "median s": statistics.median(values), "min s": min(values),
                     "max s": max(values), "runs": len(values), "raw": values})
    load_after = os.getloadavg()
    print_table(f"Elastic launch on two test hosts ({' '.join(FLAGS)}), load {load_before[0]:.2f} -> "
                f"{load_after[0]:.2f}", [{k: v for k, v in row.items() if k != "raw"} for row in rows])
    payload = {"quick": args.quick, "flags": FLAGS, "rows": rows, "loadavg_before": load_before,
               "loadavg_after": load_after, "goal_seconds": 15.0, "wall_seconds": time.monotonic() - started}
    print(f"wrote {write_result('elastic' + ('-quick' if args.quick else ''), payload)}")
    return payload


if __name__ == "__main__":
    main()
