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
start), the median of the rest is "warm".
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
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
FULL = {"epochs": 3, "steps": 50, "repeats": 2}
QUICK = {"epochs": 1, "steps": 5, "repeats": 1}
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


def run_driver(runner: str, master: str, job: dict, timeout: float, work: Path) -> dict:
    result = work / f"{runner}.json"
    log = work / f"{runner}.log"
    legacy = runner == "peer"
    config = {**job, "master": master, "workers": WORKERS, "timeout": 300.0, "executor_env": _training_env(legacy)}
    env = clean_env(**_training_env(legacy), PYSPARK_PYTHON=python())
    started = time.monotonic()
    with open(log, "w") as handle:
        proc = subprocess.Popen([python(), str(TASKS / "spark_driver.py"), runner, json.dumps(config), str(result)],
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


def summarize(name: str, data: dict) -> dict:
    runs = data.get("runs", [])
    good = [r for r in runs if "result" in r]
    row = {"way": name, "master": data.get("master") or "-", "session s": data.get("session_seconds"),
           "cold wall s": None, "warm wall s": None, "to first step s": None, "training s": None,
           "runs ok": f"{len(good)}/{len(runs)}", "status": "ok"}
    if data.get("error") or not good:
        first_error = data.get("error") or next((r.get("error") for r in runs if "error" in r), "no run")
        row["status"] = "failed: " + first_error.strip().splitlines()[0][:160] if first_error.strip() else "failed"
        row["error"] = first_error
        return row
    walls = [r["returned"] - r["called"] for r in good]
    row["cold wall s"] = walls[0]
    row["warm wall s"] = statistics.median(walls[1:]) if len(walls) > 1 else None
    row["to first step s"] = statistics.median(r["result"]["first_step_done"] - r["called"] for r in good)
    row["training s"] = statistics.median(r["result"]["train_end"] - r["result"]["first_step_begin"] for r in good)
    # Each run in additive segments (what the plot draws): call -> first step begins -> training end -> return.
    row["breakdown"] = [{"run": "cold" if i == 0 else f"warm {i}", "wall": r["returned"] - r["called"],
                         "to_first_step_begin": r["result"]["first_step_begin"] - r["called"],
                         "training": r["result"]["train_end"] - r["result"]["first_step_begin"],
                         "after_training": r["returned"] - r["result"]["train_end"]} for i, r in enumerate(good)]
    row["final loss"] = good[-1]["result"]["loss"][-1]
    row["keras"] = good[-1]["result"].get("keras")
    if len(good) < len(runs):
        row["status"] = "some runs failed: " + next(r["error"] for r in runs if "error" in r).splitlines()[0][:160]
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    parser.add_argument("--master", default=None, help=f"Spark master (default {LOCAL_CLUSTER}, else {FALLBACK})")
    args = parser.parse_args(argv)
    job = QUICK if args.quick else FULL
    driver_timeout = 240.0 if args.quick else 600.0
    started = time.monotonic()
    available = availability()
    rows, raw = [], {}
    # --quick only checks the machinery: local[2] starts in a fraction of local-cluster's time.
    master_used = args.master or (FALLBACK if args.quick else LOCAL_CLUSTER)
    fallback_reason = None
    with tempfile.TemporaryDirectory(prefix="stratkit-bench-spark-") as tmp:
        work = Path(tmp)
        raw["launch"] = run_launch(job, driver_timeout, work)
        rows.append(summarize("stratkit launch (no Spark)", raw["launch"]))
        for key, runner in (("stratkit SparkRunner", "stratkit"), ("spark-tensorflow-distributor", "peer")):
            if available[key]:
                rows.append({"way": key, "master": "-", "session s": None, "cold wall s": None, "warm wall s": None,
                             "to first step s": None, "training s": None, "runs ok": "0/0",
                             "status": f"not available: {available[key]}"})
                continue
            data = run_driver(runner, master_used, job, driver_timeout, work)
            if "session_seconds" not in data and args.master is None and master_used == LOCAL_CLUSTER:
                fallback_reason = f"{LOCAL_CLUSTER} did not start: {data.get('error', '')[:500]}"
                master_used = FALLBACK
                data = run_driver(runner, master_used, job, driver_timeout, work)
            raw[runner] = data
            rows.append(summarize(key, data))
    hidden = ("error", "keras", "breakdown")
    table = [{k: ("-" if v is None else v) for k, v in row.items() if k not in hidden} for row in rows]
    print_table(f"Same 2-worker job ({job['epochs']} x {job['steps']} steps, MLP): wall of run()/launch(), "
                f"call -> first step done, training inside", table)
    payload = {"quick": args.quick, "job": {**job, "workers": WORKERS, "model": "MLP 64-128-128-10",
                                            "global_batch": 32 * WORKERS},
               "master": master_used, "master_fallback_reason": fallback_reason, "rows": rows, "raw": raw,
               "wall_seconds": time.monotonic() - started}
    print(f"wrote {write_result('spark' + ('-quick' if args.quick else ''), payload)}")
    if rows[0]["status"] != "ok":
        raise SystemExit("the stratkit launch baseline failed")
    return payload


if __name__ == "__main__":
    main()
