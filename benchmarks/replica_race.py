"""Issue 49's acceptance: an input of unknown length trains on N replicas as one process, run after run, under load.

    python benchmarks/replica_race.py [--runs 50] [--modes mirrored,mwms] [--epochs 3] [--rows 1000]
                                      [--burners 2] [--tree DIR] [--name NAME]

Not a speed benchmark (not run by `make bench`). The job is round 5's script
(``benchmarks/tasks/unknown_length_task.py``: ``filter().batch(64)``, no
``steps_per_epoch``, ``model.fit(epochs=3)`` under ``stratkit.make_strategy()``),
where the step that meets the end of the data raced the replicas' copies of the
optimizer's step counter apart (``ReplicaDivergenceError`` at random; see
``stratkit/strategy/keras_compat/step_gate.py``). Each run is a fresh process
(Mirrored over 2 logical CPUs) or a fresh pair of processes (2
MultiWorkerMirrored workers on 127.0.0.1), with ``--burners`` CPU-bound
processes running beside it the whole time (the load the race needs); the
modes alternate run by run. One one-process run (``make_strategy()`` on one
device) is the reference.

Prints, per mode: the runs, those that stopped with ``ReplicaDivergenceError``,
those that failed otherwise, those whose weights are within 1e-5 of one
process (the largest difference), those whose every copy of ``iterations``
equals the steps trained, and the load average. ``--tree`` runs another
checkout's ``stratkit`` (e.g. an export of the commit before the fix) with
this checkout's task. Writes benchmarks/results/<name>.json (default
``replica-race``); exits 1 when any run fails the acceptance.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_result  # noqa: E402
from jobs import REPO, TASKS, clean_env, kill_all, loopback_ports  # noqa: E402

TASK = TASKS / "unknown_length_task.py"
TOLERANCE = 1e-5
#: a run's processes, generously: a 3-epoch fit takes ~10 s alone and minutes on a loaded machine
TIMEOUT = 900


def _result(stdout: str) -> dict | None:
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return None


def run(mode: str, tree: Path, epochs: int, rows: int) -> list[dict | str]:
    """One run of the task in `mode`: each process's RESULT, or its exit code and the tail of its stderr."""
    argv = [sys.executable, str(TASK), "mwms" if mode == "mwms" else mode, "--epochs", str(epochs),
            "--rows", str(rows)]
    env = clean_env(PYTHONPATH=str(tree))
    if mode == "mwms":
        cluster = {"worker": [f"127.0.0.1:{p}" for p in loopback_ports(2)]}
        envs = [{**env, "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})}
                for i in range(2)]
    else:
        envs = [env]
    procs = [subprocess.Popen(argv, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for e in envs]
    try:
        outputs = [p.communicate(timeout=TIMEOUT) for p in procs]
    except subprocess.TimeoutExpired:
        return [f"timed out after {TIMEOUT} s"] * len(procs)
    finally:
        kill_all(procs)
    return [_result(out) or f"exit {p.returncode}: {err[-600:]}" for p, (out, err) in zip(procs, outputs)]


def verdict(got: list[dict | str], reference: dict) -> dict:
    """What one run shows: its error, whether its weights are one process's, whether its step counters are right."""
    failed = next((g for g in got if isinstance(g, str)), None)
    if failed is not None:
        return {"error": failed.splitlines()[0][:300], "divergence": False, "gap": None, "counted": False}
    errors = [g["error"] for g in got if g["error"]]
    gap = max(abs(a - b) for g in got for a, b in zip(g["w"], reference["w"]))
    return {"error": errors[0].splitlines()[0][:300] if errors else None,
            "divergence": any(e.startswith("ReplicaDivergenceError") for e in errors), "gap": gap,
            "counted": all(c == g["steps"] for g in got for c in g["iterations"]),
            "iterations": [g["iterations"] for g in got], "steps": got[0]["steps"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="runs per mode")
    parser.add_argument("--modes", default="mirrored,mwms")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--burners", type=int, default=2, help="CPU-bound processes beside every run")
    parser.add_argument("--tree", type=Path, default=REPO, help="the checkout whose stratkit the runs import")
    parser.add_argument("--name", default="replica-race")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
               for _ in range(args.burners)]
    try:
        reference = run("one", args.tree, args.epochs, args.rows)[0]
        if isinstance(reference, str) or reference["error"]:
            why = reference if isinstance(reference, str) else reference["error"]
            raise SystemExit(f"the one-process reference failed: {why}")
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for i in range(args.runs):
            for mode in (modes if i % 2 == 0 else modes[::-1]):
                load = os.getloadavg()[0]
                started = time.monotonic()
                outcome = verdict(run(mode, args.tree, args.epochs, args.rows), reference)
                outcome.update(load=round(load, 1), seconds=round(time.monotonic() - started, 1))
                runs[mode].append(outcome)
                print(f"{mode} run {i + 1}: {outcome}", flush=True)
    finally:
        kill_all(burners)
    rows = []
    for mode, outcomes in runs.items():
        gaps = [o["gap"] for o in outcomes if o["gap"] is not None]
        rows.append({"mode": mode, "runs": len(outcomes), "divergence_errors": sum(o["divergence"] for o in outcomes),
                     "other_failures": sum(bool(o["error"]) and not o["divergence"] for o in outcomes),
                     "within_1e-5": sum(o["gap"] is not None and o["gap"] <= TOLERANCE and not o["error"]
                                        for o in outcomes),
                     "largest_gap": f"{max(gaps):.1e}" if gaps else None,
                     "counted_right": sum(o["counted"] for o in outcomes),
                     "load_min": min(o["load"] for o in outcomes), "load_max": max(o["load"] for o in outcomes)})
    print_table(f"unknown-length input, {args.epochs} epochs, {args.burners} CPU-bound processes beside each run "
                f"(reference: one process, iterations {reference['iterations']}, steps {reference['steps']})", rows)
    write_result(args.name, {"args": {k: str(v) for k, v in vars(args).items()}, "reference": reference,
                             "rows": rows, "runs": runs})
    return 0 if all(r["within_1e-5"] == r["runs"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
