"""Spark: the same 2-worker training through stratkit's SparkRunner, the peer's runner, and `stratkit launch`.

Job (benchmarks/tasks/spark_train.py): a 2-layer MLP on synthetic 64-feature
data, 2 workers, global batch 64, 3 epochs x 50 steps (the notes' baseline
job). Three ways, one run of this script:

  * stratkit.spark.SparkRunner(num_workers=2).run(train_fn) -- Keras 3 via
    stratkit.Trainer, train_fn in a fresh process per barrier task;
  * spark-tensorflow-distributor's MirroredStrategyRunner(num_slots=2,
    use_gpu=False).run(train_fn) -- it only trains multi-worker with legacy
    Keras, so its driver process and executors get TF_USE_LEGACY_KERAS=1 (the
    tf-keras package); a separate driver process keeps it away from Keras 3;
  * stratkit.launch.launch(["python", "spark_train.py"], workers=2) -- no Spark.

Each Spark runner has its own driver process and SparkSession (master
local-cluster[2,1,2048]: 2 executors of 1 core, as a real cluster's executors
are separate JVMs; local[2] only if that cannot start, and with --quick -- the
JSON says which).
Every training process gets the same thread settings (1 intra-op thread, as
`stratkit launch` gives 2 tasks on 2 cores), so differences are orchestration.

Measured per run, all wall-clock on one host: run() (or launch()) call to
return ("wall"); call to the first training step done ("to first step":
batch 1 begins, so tracing and the first collective are in it); training
time (first step begun to training end). The session start is reported
separately (it is paid once per application, not per run). `repeats` runs per
way, in the same session: the first is "cold" (executors' Python workers
start), the rest are "warm".

The two Spark runners are measured in `rounds` alternating rounds (stratkit
then the peer, then the peer then stratkit, ...), each round a new driver and
SparkSession, so a burst of load on the shared machine hits both; the table
gives the mean and the spread (sample standard deviation) over all cold and
all warm runs, and the load average before and after each round is recorded.
SparkRunner's per-phase timeline (`RunReport.timeline`) of every run is kept
in the JSON; the row's "timeline" holds one cold and one warm run's phases.

`--compare NAME=SRC` also measures SparkRunner from another source tree (SRC:
a checkout's root, put first on the driver's and executors' PYTHONPATH) in
the same alternating rounds, so a change is compared with what it replaces
under the same load.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_result  # noqa: E402
from jobs import TASKS, clean_env, python, tail, thread_vars  # noqa: E402

LOCAL_CLUSTER = "local-cluster[2,1,2048]"
FALLBACK = "local[2]"
FULL = {"epochs": 3, "steps": 50, "repeats": 3, "rounds": 3}
QUICK = {"epochs": 1, "steps": 5, "repeats": 2, "rounds": 1}
WORKERS = 2


def _training_env(legacy: bool) -> dict[str, str]:
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": "", **thread_vars(1, None)}
    if legacy:
        env["TF_USE_LEGACY_KERAS"] = "1"
    return env


def availability() -> dict[str, str | None]:
    """None when the way can run, else why not."""
    missing = {}
    spark = importlib.util.find_spec("pyspark") is None
    try:
        from stratkit.spark import SparkRunner  # noqa: F401
        stratkit_spark = None
    except Exception as exc:  # noqa: BLE001 - being written; any import failure means "not available"
        stratkit_spark = f"stratkit.spark not importable ({type(exc).__name__}: {exc})"
    missing["stratkit SparkRunner"] = "pyspark not installed" if spark else stratkit_spark
    peer = None
    if spark:
        peer = "pyspark not installed"
    elif importlib.util.find_spec("spark_tensorflow_distributor") is None:
        peer = "spark-tensorflow-distributor not installed (pip install spark-tensorflow-distributor)"
    elif importlib.util.find_spec("tf_keras") is None:
        peer = "tf-keras not installed: the peer needs legacy Keras (pip install tf-keras)"
    missing["spark-tensorflow-distributor"] = peer
    missing["stratkit launch (no Spark)"] = None
    return missing


def run_driver(runner: str, master: str, job: dict, timeout: float, work: Path, source: str | None = None) -> dict:
    """One driver process and SparkSession running `runner` ("stratkit" or "peer") `repeats` times.

    `source`: a source tree whose stratkit the driver and its executors import instead of this one.
    """
    result = work / f"{runner}.json"
    log = work / f"{runner}.log"
    legacy = runner == "peer"
    config = {**job, "master": master, "workers": WORKERS, "timeout": 300.0, "executor_env": _training_env(legacy)}
    extra = {}
    if source is not None:  # Spark's Python workers keep the PYTHONPATH they inherit, after pyspark's own
        extra["PYTHONPATH"] = source
    env = clean_env(**_training_env(legacy), PYSPARK_PYTHON=python(), **extra)
    started = time.monotonic()
    with open(log, "w") as handle:
        proc = subprocess.Popen([python(), str(TASKS / "spark_driver.py"), "peer" if legacy else "stratkit",
                                 json.dumps(config), str(result)],
                                env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            from jobs import kill_all

            kill_all([proc])
    data = json.loads(result.read_text()) if result.exists() else {}
    data["driver_exit"] = proc.returncode
    data["driver_seconds"] = time.monotonic() - started
    if "session_seconds" not in data or proc.returncode not in (0,) and not data.get("runs"):
        data["error"] = f"driver exit {proc.returncode}; last output:\n{tail(log, 3000)}"
    return data


def run_launch(job: dict, timeout: float, work: Path) -> dict:
    from stratkit.launch import launch

    runs = []
    for i in range(job["repeats"]):
        result = work / f"launch{i}.json"
        env = clean_env(STRATKIT_BENCH_SPARK=json.dumps(job), STRATKIT_BENCH_SPARK_RESULT=str(result),
                        **_training_env(False))
        out = io.StringIO()
        called = time.time()
        outcome = launch([python(), str(TASKS / "spark_train.py")], workers=WORKERS, env=env, timeout=timeout,
                         stdout=out, stderr=out, handle_signals=False)
        returned = time.time()
        if outcome.ok and result.exists():
            runs.append({"called": called, "returned": returned, "result": json.loads(result.read_text())})
        else:
            runs.append({"called": called, "returned": returned,
                         "error": f"exit {outcome.returncode}: {outcome.report}\n{out.getvalue()[-3000:]}"})
    return {"runner": "launch", "master": None, "session_seconds": None, "runs": runs}


def _mean_spread(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _phases(run: dict) -> list[dict]:
    """A run's timeline, in seconds from the run() call: the driver's and the chief's phases, and worker 1's."""
    return [{"who": e["who"], "event": e["event"], "s": round(e["t"] - run["called"], 3)}
            for e in run.get("timeline", [])]


def summarize(name: str, drivers: list[dict]) -> dict:
    """One table row for a way measured by one or more drivers (rounds); the first run of each is cold."""
    drivers = drivers if isinstance(drivers, list) else [drivers]
    runs = [r for d in drivers for r in d.get("runs", [])]
    good = [r for r in runs if "result" in r]
    cold = [d["runs"][0] for d in drivers if d.get("runs") and "result" in d["runs"][0]]
    warm = [r for d in drivers for r in d.get("runs", [])[1:] if "result" in r]
    sessions = [d["session_seconds"] for d in drivers if d.get("session_seconds") is not None]
    row = {"way": name, "master": drivers[0].get("master") or "-",
           "session s": statistics.mean(sessions) if sessions else None,
           "cold wall s": None, "warm wall s": None, "to first step s": None, "training s": None,
           "rounds": len(drivers), "runs ok": f"{len(good)}/{len(runs)}", "status": "ok"}
    first_error = next((d.get("error") for d in drivers if d.get("error")), None)
    if first_error or not good:
        first_error = first_error or next((r.get("error") for r in runs if "error" in r), "no run")
        row["status"] = "failed: " + first_error.strip().splitlines()[0][:160] if first_error.strip() else "failed"
        row["error"] = first_error
        return row
    wall = lambda r: r["returned"] - r["called"]  # noqa: E731
    row["cold wall s"], row["cold spread s"] = _mean_spread([wall(r) for r in cold])
    row["warm wall s"], row["warm spread s"] = _mean_spread([wall(r) for r in warm])
    row["to first step s"] = statistics.median(r["result"]["first_step_done"] - r["called"] for r in good)
    row["training s"] = statistics.median(r["result"]["train_end"] - r["result"]["first_step_begin"] for r in good)
    # Runs in additive segments (what the plot draws): call -> first step begins -> training end -> return;
    # the cold and the warm run closest to their means stand for the rest.
    def segments(label: str, r: dict) -> dict:
        return {"run": label, "wall": wall(r), "to_first_step_begin": r["result"]["first_step_begin"] - r["called"],
                "training": r["result"]["train_end"] - r["result"]["first_step_begin"],
                "after_training": r["returned"] - r["result"]["train_end"]}

    typical = []
    if cold:
        typical.append(("cold", min(cold, key=lambda r: abs(wall(r) - row["cold wall s"]))))
    if warm:
        typical.append(("warm", min(warm, key=lambda r: abs(wall(r) - row["warm wall s"]))))
    row["breakdown"] = [segments(label, r) for label, r in typical]
    if any("timeline" in r for _, r in typical):
        row["timeline"] = {label: _phases(r) for label, r in typical}
    row["final loss"] = good[-1]["result"]["loss"][-1]
    row["keras"] = good[-1]["result"].get("keras")
    if len(good) < len(runs):
        row["status"] = "some runs failed: " + next(r["error"] for r in runs if "error" in r).splitlines()[0][:160]
    return row


def _versus(rows: list[dict]) -> None:
    """Each SparkRunner row's mean walls over the peer's (< 1: SparkRunner is faster)."""
    peer = next((r for r in rows if r["way"] == "spark-tensorflow-distributor"), None)
    for ours in (r for r in rows if r["way"].startswith("stratkit SparkRunner")):
        for key in ("cold", "warm"):
            value = None
            if peer and ours.get(f"{key} wall s") and peer.get(f"{key} wall s"):
                value = ours[f"{key} wall s"] / peer[f"{key} wall s"]
            ours[f"{key} vs peer"] = value


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    parser.add_argument("--master", default=None, help=f"Spark master (default {LOCAL_CLUSTER}, else {FALLBACK})")
    parser.add_argument("--compare", action="append", default=[], metavar="NAME=SRC",
                        help="also measure SparkRunner from the source tree SRC, as 'stratkit SparkRunner (NAME)'")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default: 3, 1 with --quick)")
    parser.add_argument("--no-launch", action="store_true", help="skip the `stratkit launch` baseline")
    args = parser.parse_args(argv)
    job = dict(QUICK if args.quick else FULL)
    if args.rounds:
        job["rounds"] = args.rounds
    sources = {}
    for item in args.compare:
        name, _, source = item.partition("=")
        if not name or not Path(source, "stratkit").is_dir():
            parser.error(f"--compare {item!r}: expected NAME=SRC, SRC a source tree with stratkit/ in it")
        sources[f"stratkit@{name}"] = str(Path(source).resolve())
    driver_timeout = 240.0 if args.quick else 600.0
    started = time.monotonic()
    available = availability()
    rows, raw = [], {}
    # --quick only checks the machinery: local[2] starts in a fraction of local-cluster's time.
    master_used = args.master or (FALLBACK if args.quick else LOCAL_CLUSTER)
    fallback_reason = None
    ways = {"stratkit": "stratkit SparkRunner", "peer": "spark-tensorflow-distributor",
            **{key: f"stratkit SparkRunner ({key.partition('@')[2]})" for key in sources}}
    for key in sources:
        available[ways[key]] = available["stratkit SparkRunner"]
    loads = []
    with tempfile.TemporaryDirectory(prefix="stratkit-bench-spark-") as tmp:
        work = Path(tmp)
        if not args.no_launch:
            raw["launch"] = run_launch(job, driver_timeout, work)
            rows.append(summarize("stratkit launch (no Spark)", raw["launch"]))
        drivers: dict[str, list[dict]] = {runner: [] for runner in ways if not available[ways[runner]]}
        for round_index in range(job["rounds"]):
            order = list(drivers) if round_index % 2 == 0 else list(drivers)[::-1]
            for runner in order:
                load_before = os.getloadavg()
                data = run_driver(runner, master_used, job, driver_timeout, work, sources.get(runner))
                if "session_seconds" not in data and args.master is None and master_used == LOCAL_CLUSTER:
                    fallback_reason = f"{LOCAL_CLUSTER} did not start: {data.get('error', '')[:500]}"
                    master_used = FALLBACK
                    data = run_driver(runner, master_used, job, driver_timeout, work, sources.get(runner))
                data["round"] = round_index
                drivers[runner].append(data)
                loads.append({"round": round_index, "runner": runner, "load_before": load_before,
                              "load_after": os.getloadavg()})
        for runner, key in ways.items():
            if available[key]:
                rows.append({"way": key, "master": "-", "session s": None, "cold wall s": None, "warm wall s": None,
                             "to first step s": None, "training s": None, "runs ok": "0/0",
                             "status": f"not available: {available[key]}"})
                continue
            raw[runner] = drivers[runner]
            rows.append(summarize(key, drivers[runner]))
    _versus(rows)
    hidden = ("error", "keras", "breakdown", "timeline")
    columns = list(dict.fromkeys(k for row in rows for k in row if k not in hidden))
    table = [{k: ("-" if row.get(k) is None else row[k]) for k in columns} for row in rows]
    print_table(f"Same 2-worker job ({job['epochs']} x {job['steps']} steps, MLP): wall of run()/launch(), "
                f"call -> first step done, training inside", table)
    payload = {"quick": args.quick, "job": {**job, "workers": WORKERS, "model": "MLP 64-128-128-10",
                                            "global_batch": 32 * WORKERS},
               "load_average": loads,
               "master": master_used, "master_fallback_reason": fallback_reason, "rows": rows, "raw": raw,
               "wall_seconds": time.monotonic() - started}
    print(f"wrote {write_result('spark' + ('-quick' if args.quick else ''), payload)}")
    if not args.no_launch and rows[0]["status"] != "ok":
        raise SystemExit("the stratkit launch baseline failed")
    return payload


if __name__ == "__main__":
    main()
