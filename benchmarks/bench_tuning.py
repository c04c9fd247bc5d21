"""What a distributed search costs per trial (issue 51's acceptance: at most 1 s beyond the trial's own training).

`--library optuna`: the same for the Optuna example's study (examples/tune_optuna.py's objective and seeded TPE,
8 trials of 3 epochs, no pruning so that every way trains every trial fully; tasks/tune_optuna_task.py times
the objective), written to `tuning-optuna.json`.

The example's seeded digits RandomSearch (examples/tune_keras_tuner.py: 8 trials of 3 epochs) runs three ways
in each round, in an order that rotates: plain KerasTuner in one process (the baseline), `stratkit.tune` in one
process, and `stratkit launch --tune --workers 2`; `--ways plain,stratkit,launch,spark,ray` adds 2 tuners on a
local Spark (`SparkRunner(tune=True)`, local[2]) and on a local Ray (`RayRunner(tune=True)`, 2 CPUs)
(benchmarks/tasks/tune_engines.py; each tuner's wall time is its own search's, so an engine's start-up, the
JVM's or Ray's, is not counted as a trial's cost). Every tuner times its search (wall) and the seconds KerasTuner
spends building and fitting its trials (`Tuner._build_and_fit_model`, timed around the call: the trial's own
training; under stratkit it includes the trial's per-epoch backups, which are stratkit's cost, so the rows below
compare against the plain run's own training instead). Reported, mean (min-max) over the rounds:

* `wall`: the search's wall time;
* `outside fit per trial`: (the tuners' wall seconds - their seconds in `_build_and_fit_model`) / trials: the
  lease, the service's stored state, the seed, the files' upload at the trial's end (plain: KerasTuner's own
  bookkeeping; 2 tuners: also a tuner's waits, for the other to register, and for its last trial at the end);
* `inside fit per trial`: stratkit's own work inside a fit (the trial's `Backup` hooks: a backup every epoch;
  each best-epoch checkpoint's upload), timed around each call, / trials;
* `beyond training per trial`: the two together, what a trial costs beyond its own training (issue 51: <= 1 s;
  for plain KerasTuner, its bookkeeping). Measured inside each run, so it does not depend on the noise between
  runs the way a difference of two wall times does;
* the scores of every trial, which must be the same through `stratkit.tune` in one process and on 2 tuners
  (compared: a difference fails the run). Plain KerasTuner tries the same hyperparameters but seeds no trial, so
  its scores differ: it times the training, it is not the reference for the scores.

The 1-minute load average is recorded before and after each row.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_result  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TASKS = {"keras_tuner": str(Path(__file__).resolve().parent / "tasks" / "tune_task.py"),
         "optuna": str(Path(__file__).resolve().parent / "tasks" / "tune_optuna_task.py")}
ENGINES = str(Path(__file__).resolve().parent / "tasks" / "tune_engines.py")
WAYS = ("plain", "stratkit", "launch")
ALL_WAYS = WAYS + ("spark", "ray")


def _run(way: str, trials: int, epochs: int, library: str = "keras_tuner", search: str = "random") -> list[dict]:
    """One search one way in a fresh directory: each tuner's TUNE report."""
    workdir = tempfile.mkdtemp(prefix=f"bench-tune-{way}-")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    task = [sys.executable, TASKS[library], "--trials", str(trials), "--epochs", str(epochs)]
    engine = [sys.executable, ENGINES, way, "--trials", str(trials), "--epochs", str(epochs), "--search", search]
    if library == "keras_tuner":
        task += ["--search", search]
    argv = {"plain": task + ["--plain"], "stratkit": task,
            "launch": [sys.executable, "-m", "stratkit.cli", "launch", "--tune", "--workers", "2", "--", *task],
            "spark": engine, "ray": engine}[way]
    try:
        proc = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=1800)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if proc.returncode:
        raise RuntimeError(f"{way} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    reports = [json.loads(line.split("TUNE ", 1)[1]) for line in proc.stdout.splitlines() if "TUNE " in line]
    if len(reports) != (1 if way in ("plain", "stratkit") else 2):
        raise RuntimeError(f"{way}: {len(reports)} tuner report(s):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return reports


def _spread(values: list[float]) -> str:
    return f"{sum(values) / len(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="2 trials of 1 epoch, 1 round: the machinery only")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--library", choices=sorted(TASKS), default="keras_tuner")
    parser.add_argument("--search", choices=("random", "hyperband"), default="random",
                        help="KerasTuner: a RandomSearch of --trials, or a Hyperband search (max_epochs=--epochs, "
                        "factor 3: its brackets decide the trials)")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"which, of {','.join(ALL_WAYS)} (plain first: the "
                        "baseline)")
    args = parser.parse_args(argv)
    ways = tuple(args.ways.split(","))
    if ways[0] != "plain" or not set(ways) <= set(ALL_WAYS):
        parser.error(f"--ways: plain first, then any of {', '.join(ALL_WAYS[1:])}")
    if args.library != "keras_tuner" and set(ways) - set(WAYS):
        parser.error("--ways spark,ray: the engines' task (tasks/tune_engines.py) runs the KerasTuner search only")
    if args.quick:
        args.rounds, args.trials, args.epochs = 1, 2, 1
    runs: dict[str, list[dict]] = {way: [] for way in ways}
    for round_ in range(args.rounds):
        order = ways[round_ % len(ways):] + ways[:round_ % len(ways)]
        for way in order:
            load = os.getloadavg()[0]
            reports = _run(way, args.trials, args.epochs, args.library, args.search)
            runs[way].append({"reports": reports, "load_before": load, "load_after": os.getloadavg()[0]})
            print(f"round {round_ + 1} {way}: wall {max(r['wall'] for r in reports):.1f} s "
                  f"(load {load:.1f})", flush=True)
    scores = [r["scores"] for way in ways[1:] for run in runs[way] for r in run["reports"]]
    if any(s != scores[0] for s in scores):
        raise SystemExit(f"the trials scored differently: {scores}")
    plain_own = [run["reports"][0]["own"] for run in runs["plain"]]
    own = sum(plain_own) / len(plain_own)
    trials = runs["plain"][0]["reports"][0]["trials"]  # a Hyperband search's brackets decide them
    rows = []
    for way in ways:
        walls = [max(r["wall"] for r in run["reports"]) for run in runs[way]]
        outside = [sum(r["wall"] - r["own"] for r in run["reports"]) / trials for run in runs[way]]
        inside = [sum(r.get("inside", 0.0) for r in run["reports"]) / trials for run in runs[way]]
        loads = [run["load_before"] for run in runs[way]] + [run["load_after"] for run in runs[way]]
        rows.append({"way": way, "tuners": max(len(run["reports"]) for run in runs[way]), "wall_s": _spread(walls),
                     "outside_fit_per_trial_s": _spread(outside), "inside_fit_per_trial_s": _spread(inside),
                     "beyond_training_per_trial_s": _spread([a + b for a, b in zip(outside, inside)]),
                     "load": f"{min(loads):.1f}-{max(loads):.1f}"})
    print_table(f"{args.search}: {trials} trials, {args.epochs} epochs at most, {args.rounds} rounds (own training "
                f"per trial in the plain run: {own / trials:.2f} s)", rows)
    name = (("tuning" if args.library == "keras_tuner" else "tuning-optuna") + ("-quick" if args.quick else "")
            + ("-hyperband" if args.search == "hyperband" else "") + ("" if ways == WAYS else "-engines"))
    write_result(name, {"library": args.library, "search": args.search, "quick": args.quick, "trials": trials,
                        "epochs": args.epochs,
                        "rounds": args.rounds,
                        "own_training_per_trial_s": own / trials, "rows": rows, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
