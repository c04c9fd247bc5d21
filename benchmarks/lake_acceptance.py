"""Issue 50's acceptance at full size: a Parquet table of 1,000,000 rows in 64 files of unequal sizes (row groups
of 97 to 1,500 rows) on moto's S3, trained by `tests/data/lake_train.py` (`Trainer.fit(TableInput(...))`):

1. one process: the reference (every row id trained once per epoch, counted);
2. 2 workers under `stratkit launch`: equal to 1 (weights and history within 1e-5), each row once per epoch;
3. 3 workers under `LocalRunner`: equal to 1;
4. 2 workers under launch, worker 1 SIGKILLed mid-epoch 2 (backups on S3 every 200 steps), restarted by the
   launcher at the same world size: resumes at a step backup and equals 1;
5. 2 workers killed mid-epoch 2 with no restart, then 3 workers under `LocalRunner` from a fresh staging
   directory (only the store): resumes at a step backup and equals 1;
6. 2 Spark executors (a real `local-cluster[2,1,3072]`, `SparkRunner.run(train, url)`, the store's settings in the
   executors' environment): equal to 1, each row once per epoch over the two.

    python benchmarks/lake_acceptance.py [--rows 1000000] [--quick] [--runs 1,6]

Writes benchmarks/results/lake_acceptance.json (each run's wall time, the largest weight, history and evaluate gaps, the
row-id counts, where each resume started, the load averages). Takes ~30-60 min on 2 busy cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO / "tests"), str(REPO / "tests" / "data"), str(REPO)]
from bench_backups import MotoS3  # noqa: E402
from common import print_table, write_result  # noqa: E402

SCRIPT = REPO / "tests" / "data" / "lake_train.py"


def _env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env.update({"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), str(REPO / "tests" / "data")]),
                "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": "", **extra})
    return env


def _results(stdout: str) -> list[dict]:
    """The RESULT lines, each read from the file it names (LAKE_RESULT_DIR: a worker's million ids are a line
    longer than `stratkit launch` forwards whole)."""
    out = []
    for line in stdout.splitlines():
        if "RESULT " in line:
            result = json.loads(line.split("RESULT ", 1)[1])
            out.append(json.loads(Path(result["file"]).read_text()) if set(result) == {"file"} else result)
    return out


def _run(argv: list[str], env: dict, timeout: float = 7200) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    return done, time.monotonic() - started


def _launch(workers: int, args: list[str], env: dict, restarts: int = 0) -> tuple[subprocess.CompletedProcess, float]:
    return _run([sys.executable, "-m", "stratkit.cli", "launch", "--workers", str(workers), "--max-restarts",
                 str(restarts), "--no-private-network", "--", sys.executable, str(SCRIPT), *args], env)


def _local_runner(workers: int, args: list[str], env: dict) -> tuple[dict, float]:
    code = ("import json, sys, lake_train\nfrom stratkit import LocalRunner\n"
            f"r = LocalRunner(num_workers={workers}, private_network=False).run(lake_train.train, *sys.argv[1:])\n"
            "print('RESULT ' + json.dumps(r), flush=True)\n")
    done, seconds = _run([sys.executable, "-c", code, *args], env)
    if done.returncode:
        raise RuntimeError(done.stderr[-4000:])
    return _results(done.stdout)[-1], seconds


#: The Spark driver of run 6: a real local-cluster of 2 one-core executors; each training process writes its
#: result to LAKE_RESULT_DIR (a million ids are more than a task result should carry), the chief's path returns.
SPARK_DRIVER = """
import json, os, sys
import cloudpickle, lake_train
from pyspark.sql import SparkSession
from stratkit.spark import SparkRunner
cloudpickle.register_pickle_by_value(lake_train)
builder = SparkSession.builder.master("local-cluster[2,1,3072]").appName("lake-acceptance")
for key in ("PYTHONPATH", *json.loads(sys.argv[2])):
    builder = builder.config("spark.executorEnv." + key, os.environ[key])
spark = builder.getOrCreate()
into = os.environ["LAKE_RESULT_DIR"]

def train_and_keep(url):
    result = lake_train.train(url)
    path = os.path.join(into, "spark-rank%d.json" % result["rank"])
    with open(path, "w") as out:
        json.dump(result, out)
    return path

chief = SparkRunner(num_workers=2, spark=spark, timeout=7200).run(train_and_keep, sys.argv[1])
print("RESULT " + json.dumps({"file": chief}), flush=True)
spark.stop()
"""


def _spark(url: str, env: dict, scratch: str) -> tuple[list[dict], float]:
    names = [k for k in env if k.startswith(("AWS_", "LAKE_"))]
    done, seconds = _run([sys.executable, "-c", SPARK_DRIVER, url, json.dumps(names)],
                         {**env, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable})
    if done.returncode:
        raise RuntimeError(done.stderr[-4000:])
    return [json.loads(p.read_text()) for p in sorted(Path(scratch).glob("spark-rank*.json"))], seconds


def _gaps(reference: dict, other: dict) -> dict:
    import numpy as np

    weights = max(float(np.max(np.abs(np.subtract(a, b)))) for a, b in zip(reference["w"], other["w"]))
    history = max(float(np.max(np.abs(np.subtract(reference["h"][k], other["h"][k])))) for k in reference["h"])
    scores = max(abs(reference["e"][k] - other["e"][k]) for k in reference["e"])   # Trainer.evaluate after fit
    return {"weight gap": f"{weights:.1e}", "history gap": f"{history:.1e}", "evaluate gap": f"{scores:.1e}"}


def _ids_once(results: list[dict], rows: int, epochs: int) -> bool:
    for epoch in range(epochs):
        ids = sorted(i for r in results for i in r["ids"].get(str(epoch), []))
        if ids != list(range(rows)):
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--quick", action="store_true", help="20,000 rows (the machinery only)")
    parser.add_argument("--runs", default="1,2,3,4,5,6", help="which runs (1, the reference, always runs)")
    args = parser.parse_args(argv)
    runs = {int(r) for r in args.runs.split(",")} | {1}
    rows = 20_000 if args.quick else args.rows
    batch, every, epochs = 512, 200 if not args.quick else 5, 2
    steps = -(-rows // batch)
    kill = steps + steps // 3                # in the second epoch
    load_before = os.getloadavg()
    table, out = [], {}
    with MotoS3() as s3, tempfile.TemporaryDirectory(prefix="lake-acceptance-") as scratch:
        import lake_tables

        from stratkit.storage.arrow import arrow_filesystem

        os.environ.update(s3.env)
        fs, base = arrow_filesystem("s3://bench/t64")
        lake_tables.write_parquet(fs, base, 64, rows)
        url = "s3://bench/t64"
        env = _env({**s3.env, "LAKE_BATCH": str(batch), "LAKE_EVERY": str(every), "LAKE_EPOCHS": str(epochs),
                    "LAKE_LANES": "240" if not args.quick else "12", "LAKE_RESULT_DIR": scratch})
        one, seconds = _run([sys.executable, str(SCRIPT), url], env)
        if one.returncode:
            raise RuntimeError(one.stderr[-4000:])
        reference = _results(one.stdout)[-1]
        table.append({"run": "1 one process", "seconds": round(seconds), "ids once per epoch":
                      _ids_once([reference], rows, epochs), "resumed at step": "-", "weight gap": "-",
                      "history gap": "-", "evaluate gap": "-"})
        if 2 in runs:
            two, seconds = _launch(2, [url], env)
            results = _results(two.stdout)
            if two.returncode or len(results) != 2:
                raise RuntimeError(two.stderr[-4000:])
            table.append({"run": "2 launch --workers 2", "seconds": round(seconds),
                          "ids once per epoch": _ids_once(results, rows, epochs), "resumed at step": "-",
                          **_gaps(reference, results[0])})
        if 3 in runs:
            three, seconds = _local_runner(3, [url], env)
            table.append({"run": "3 LocalRunner(3)", "seconds": round(seconds), "ids once per epoch": "(chief only)",
                          "resumed at step": "-", **_gaps(reference, three)})
        if 4 in runs:
            backup = f"s3://bench/runs/{uuid.uuid4().hex}"
            again, seconds = _launch(2, [url, backup], {**env, "LAKE_KILL_AT": f"{kill}:1:0",
                                                        "STRATKIT_BACKUP_STAGING": f"{scratch}/s4"}, restarts=1)
            results = _results(again.stdout)
            if again.returncode or len(results) != 2:
                raise RuntimeError(again.stderr[-4000:])
            table.append({"run": f"4 launch 2, SIGKILL before step {kill}, restart at 2", "seconds": round(seconds),
                          "ids once per epoch": "-", "resumed at step": results[0]["first_step"],
                          **_gaps(reference, results[0])})
        if 5 in runs:
            backup = f"s3://bench/runs/{uuid.uuid4().hex}"
            killed, seconds_killed = _launch(2, [url, backup], {**env, "LAKE_KILL_AT": f"{kill}:1:0",
                                                                "STRATKIT_BACKUP_STAGING": f"{scratch}/s5"})
            if killed.returncode == 0:
                raise RuntimeError("the run to be killed finished")
            resumed, seconds = _local_runner(3, [url, backup], {**env, "STRATKIT_BACKUP_STAGING": f"{scratch}/s6"})
            table.append({"run": f"5 launch 2 SIGKILLed before step {kill}, resumed by LocalRunner(3)",
                          "seconds": round(seconds_killed + seconds), "ids once per epoch": "-",
                          "resumed at step": resumed["first_step"], **_gaps(reference, resumed)})
        if 6 in runs:
            results, seconds = _spark(url, env, scratch)
            if len(results) != 2:
                raise RuntimeError(f"{len(results)} Spark workers' results, not 2")
            table.append({"run": "6 SparkRunner, 2 executors", "seconds": round(seconds),
                          "ids once per epoch": _ids_once(results, rows, epochs), "resumed at step": "-",
                          **_gaps(reference, results[0]),
                          "workers bit-identical": results[0]["w"] == results[1]["w"]})
    out = {"rows": rows, "files": 64, "runs_asked": sorted(runs), "batch": batch, "epochs": epochs, "steps_per_epoch": steps,
           "backup_every": every, "runs": table, "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    for row in table:
        row.setdefault("workers bit-identical", "-")
    print_table(f"issue 50 acceptance: {rows} rows in 64 files on moto's S3", table)
    print(f"load average before {load_before}, after {out['loadavg_after']}")
    name = "lake_acceptance-quick" if args.quick else "lake_acceptance"
    write_result(name if runs == {1, 2, 3, 4, 5, 6} else f"{name}-runs-{'-'.join(map(str, sorted(runs)))}", out)
    ok = all(r["weight gap"] == "-" or max(float(r[k]) for k in ("weight gap", "history gap", "evaluate gap")) <= 1e-5
             for r in table) and \
        all(r["ids once per epoch"] in (True, "-", "(chief only)") for r in table) and \
        all(r["workers bit-identical"] in (True, "-") for r in table)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
