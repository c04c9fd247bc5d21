"""Ray: the same 2-worker job through Ray Train + stratkit, stratkit's RayRunner, and SparkRunner, in one run.

Job: bench_spark's (benchmarks/tasks/spark_train.py `train_stratkit`): a
2-layer MLP on synthetic 64-feature data, `stratkit.Trainer`, 2 workers,
global batch 64, 3 epochs x 50 steps. Three engines:

  * Ray Train: `TensorflowTrainer(loop, scaling_config=ScalingConfig(num_workers=2))`,
    the job in `train_loop_per_worker`;
  * `stratkit.ray.RayRunner(num_workers=2).run(train_fn, ...)`;
  * `stratkit.spark.SparkRunner(num_workers=2).run(train_fn, ...)` on
    bench_spark's master (local-cluster[2,1,2048]; local[2] with --quick).

Each engine runs in its own driver process with a fresh session
(`ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1")`
or a SparkSession), `repeats` runs in it: the first is "cold" (first run in a
fresh session), the rest "warm". The session start is reported apart (paid
once per application). Per run: wall of the call (fit()/run()), call -> first
step done, and steady-state steps/s inside the training function (the epochs
after the first, from epoch-end timestamps: no per-batch hook). `rounds`
rounds; the engines' order rotates every round (each engine first once in 3
rounds), so a burst of load on the shared machine hits all of them. The table
gives mean, min and max; the load average before and after every driver is
in the JSON and, as a range, in each row.

Everything stays on 127.0.0.1: Ray with token authentication
(`RAY_AUTH_MODE=token`, a random `RAY_AUTH_TOKEN`), usage stats off, and
HTTP(S)_PROXY at a closed loopback port (Ray's dashboard-agent probes cloud
metadata otherwise); Spark with `SPARK_LOCAL_IP=127.0.0.1`. Nothing is left
running: each driver stops its session and checks its children are gone.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_spark  # noqa: E402
from common import print_table, write_result  # noqa: E402
from jobs import REPO, TASKS, clean_env, kill_all, python, tail  # noqa: E402

FULL = {"epochs": 3, "steps": 50, "repeats": 2, "rounds": 3}
QUICK = {"epochs": 2, "steps": 5, "repeats": 2, "rounds": 1}
WORKERS = 2
ENGINES = {"raytrain": "Ray Train TensorflowTrainer + stratkit.Trainer",
           "rayrunner": "stratkit RayRunner", "spark": "stratkit SparkRunner"}


def ray_env() -> dict[str, str]:
    """The Ray driver's environment (its raylet and workers inherit it): loopback only, token auth, no reporting."""
    paths = [str(REPO), str(TASKS)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return clean_env(**bench_spark._training_env(False), RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token",
                     RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
                     HTTP_PROXY="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9",
                     http_proxy="http://127.0.0.1:9", https_proxy="http://127.0.0.1:9",
                     NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",
                     PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)))


def run_ray_driver(engine: str, job: dict, timeout: float, work: Path) -> dict:
    result, log = work / f"{engine}.json", work / f"{engine}.log"
    result.unlink(missing_ok=True)
    config = {**job, "workers": WORKERS, "timeout": 300.0}
    started = time.monotonic()
    with open(log, "w") as handle:
        proc = subprocess.Popen([python(), str(TASKS / "ray_driver.py"), engine, json.dumps(config), str(result)],
                                env=ray_env(), stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            kill_all([proc])
    data = json.loads(result.read_text()) if result.exists() else {}
    data["driver_exit"] = proc.returncode
    data["driver_seconds"] = time.monotonic() - started
    if "session_seconds" not in data or (proc.returncode != 0 and not data.get("runs")):
        data["error"] = f"driver exit {proc.returncode}; last output:\n{tail(log, 3000)}"
    elif any("error" in r for r in data.get("runs", [])):
        data["log_tail"] = tail(log, 3000)
    return data


def steps_per_second(result: dict, steps: int) -> float | None:
    """Steady state: the steps of every epoch after the first over their time (epoch-end timestamps)."""
    ends = result.get("epoch_ends") or []
    if len(ends) < 2 or ends[-1] <= ends[0]:
        return None
    return steps * (len(ends) - 1) / (ends[-1] - ends[0])


def _stats(values: list[float], prefix: str) -> dict:
    if not values:
        return {f"{prefix} mean": None, f"{prefix} min": None, f"{prefix} max": None}
    return {f"{prefix} mean": statistics.mean(values), f"{prefix} min": min(values), f"{prefix} max": max(values)}


def summarize(name: str, drivers: list[dict], loads: list[dict], steps: int) -> dict:
    runs = [r for d in drivers for r in d.get("runs", [])]
    good = [r for r in runs if "result" in r]
    cold = [d["runs"][0] for d in drivers if d.get("runs") and "result" in d["runs"][0]]
    warm = [r for d in drivers for r in d.get("runs", [])[1:] if "result" in r]
    wall = lambda r: r["returned"] - r["called"]  # noqa: E731
    load = [v for entry in loads for v in (entry["load_before"][0], entry["load_after"][0])]
    row = {"engine": name, "rounds": len(drivers), "runs ok": f"{len(good)}/{len(runs)}",
           **_stats([d["session_seconds"] for d in drivers if d.get("session_seconds") is not None], "session s"),
           **_stats([wall(r) for r in cold], "cold wall s"), **_stats([wall(r) for r in warm], "warm wall s"),
           **_stats([s for r in good if (s := steps_per_second(r["result"], steps))], "steps/s"),
           # The engine's own share: the call to the training function's first line (in Ray Train's worker
           # actor, RayRunner's child process, SparkRunner's forked process); the rest is TensorFlow and training.
           "to train_fn s": (statistics.median(r["result"]["process_start"] - r["called"] for r in good)
                             if good else None),
           "to first step s": (statistics.median(r["result"]["first_step_done"] - r["called"] for r in good)
                               if good else None),
           "load 1-min": f"{min(load):.1f}-{max(load):.1f}" if load else None, "status": "ok"}
    error = next((d.get("error") for d in drivers if d.get("error")), None) \
        or next((r.get("error") for r in runs if "error" in r), None)
    if not good:
        row["status"] = "failed: " + ((error or "no run").strip().splitlines() or ["?"])[0][:160]
    elif len(good) < len(runs) or error:
        row["status"] = "some runs failed: " + (error or "?").strip().splitlines()[0][:160]
    if error:
        row["error"] = error
    if good:
        row["final loss"] = good[-1]["result"]["loss"][-1]
        row["replicas"] = good[-1]["result"]["replicas"]
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3, 1 with --quick)")
    parser.add_argument("--output", default=None, help="results/<NAME>.json (default ray, ray-quick with --quick)")
    args = parser.parse_args(argv)
    job = dict(QUICK if args.quick else FULL)
    if args.rounds:
        job["rounds"] = args.rounds
    master = bench_spark.FALLBACK if args.quick else bench_spark.LOCAL_CLUSTER
    timeout = 300.0 if args.quick else 900.0
    started = time.monotonic()
    # Without Ray (pip install "stratkit[ray]") only SparkRunner runs; the Ray rows say why.
    missing = {e: "ray not installed (pip install \"stratkit[ray]\")" for e in ("raytrain", "rayrunner")
               if importlib.util.find_spec("ray") is None}
    if importlib.util.find_spec("pyspark") is None:
        missing["spark"] = "pyspark not installed (pip install \"stratkit[spark]\")"
    order0 = [e for e in ENGINES if e not in missing]
    drivers: dict[str, list[dict]] = {e: [] for e in ENGINES}
    loads: list[dict] = []
    machine_load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="stratkit-bench-ray-") as tmp:
        work = Path(tmp)
        for round_index in range(job["rounds"]):
            shift = round_index % len(order0)
            order = order0[shift:] + order0[:shift]
            for engine in order:
                before = os.getloadavg()
                print(f"round {round_index}: {engine} (load {before[0]:.1f})", flush=True)
                if engine == "spark":
                    data = bench_spark.run_driver("stratkit", master, job, timeout, work)
                else:
                    data = run_ray_driver(engine, job, timeout, work)
                data["round"] = round_index
                drivers[engine].append(data)
                loads.append({"round": round_index, "engine": engine, "position": order.index(engine),
                              "load_before": before, "load_after": os.getloadavg()})
    rows = [summarize(ENGINES[e], drivers[e], [x for x in loads if x["engine"] == e], job["steps"])
            if e not in missing else {"engine": ENGINES[e], "rounds": 0, "runs ok": "0/0",
                                      "status": f"not available: {missing[e]}"}
            for e in ENGINES]
    hidden = ("error",)
    columns = list(dict.fromkeys(k for row in rows for k in row if k not in hidden))
    table = [{k: ("-" if row.get(k) is None else row[k]) for k in columns} for row in rows]
    print_table(f"Same 2-worker job ({job['epochs']} x {job['steps']} steps, MLP, {job['rounds']} rounds, "
                f"{job['repeats']} runs per session): wall of fit()/run(), steady-state steps/s", table)
    payload = {"quick": args.quick,
               "job": {**job, "workers": WORKERS, "model": "MLP 64-128-128-10", "global_batch": 32 * WORKERS},
               "spark_master": master, "ray_init": {"num_cpus": 4, "include_dashboard": False,
                                                     "_node_ip_address": "127.0.0.1"},
               "ray": next((d.get("ray") for e in ("raytrain", "rayrunner") for d in drivers[e] if d.get("ray")), None),
               "spark": next((d.get("spark") for d in drivers["spark"] if d.get("spark")), None),
               "loadavg_before": machine_load_before, "loadavg_after": os.getloadavg(), "load_average": loads,
               "rows": rows, "raw": drivers, "wall_seconds": time.monotonic() - started}
    name = args.output or ("ray-quick" if args.quick else "ray")
    print(f"wrote {write_result(name, payload)}")
    if any(not row["status"].startswith(("ok", "not available")) for row in rows):
        raise SystemExit("an engine failed: " + "; ".join(f"{r['engine']}: {r['status']}" for r in rows
                                                           if r["status"] != "ok"))
    return payload


if __name__ == "__main__":
    main()
