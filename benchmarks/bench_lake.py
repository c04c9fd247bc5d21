"""Training from a table (issue 50): the reader's rate against pyarrow's and the usual recipe's, a CNN's step rate
fed by it, and a worker's memory against its read-ahead budget.

From local disk and from moto's S3 (pyarrow's S3 client, as the reader uses), the same Parquet table
(1,000,000 rows of 16 float32s and a label, 16 files, row groups of 65,536 rows), rows/s in 3 alternating
rounds (the order rotates), each consumed in-graph by `Dataset.reduce` as `fit` consumes a dataset:

* reader: `TableInput(...).dataset_fn(B)` for one pipeline, one pass (shuffled: lanes, windows); and 3 passes in
  one pipeline, as `fit` reads its epochs (its threads started and its first block read once, not each pass);
* limit: pyarrow's raw `ParquetFile.iter_batches` decode of the same columns, file after file, with its defaults;
  and again with `use_threads=False` (its column threads off: 1.4-1.6x faster on this 2-core machine, so the
  stricter limit; the reader's ratio is reported against both);
* recipe: the usual hand-written `tf.data.Dataset.from_generator` yielding rows from pyarrow batches, `.batch(B)`;
* from moto also the reader through s3fs (`STRATKIT_LAKE_FILESYSTEM=fsspec`), against pyarrow's S3 client.

Targets: reader >= 0.8x the limit and >= 2x the recipe. Then a small CNN (16x16x3 images, 30,000 rows) through
`Trainer.fit` fed by the reader against the same CNN on in-memory arrays: steps/s of the warm second epoch,
>= 0.95x; and, as the ceiling of any reader decoding the table with pyarrow, the same CNN fed pyarrow's raw
decode (`iter_batches`, no order) through the reader's own tf.data pipeline (3 ways, their order rotating). Then memory: 2 workers under `stratkit launch` train on a table 10x `read_ahead_bytes` (local disk),
after the same fit on a tiny table in the same process; the control launches the same workers for as many steps
of the same model fed from memory (no reader). Each worker's peak RSS is recorded: the table's growth less the
control's (the model's own) must stay within the budget. 3 rounds, the order alternating. Load averages before
and after are recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_backups import MotoS3  # noqa: E402
from common import print_table, write_result  # noqa: E402
from jobs import REPO, TASKS, clean_env  # noqa: E402

TASK = TASKS / "lake_task.py"
FULL = {"rows": 1_000_000, "files": 16, "group": 65_536, "rounds": 3, "batch": 1024,
        "cnn_rows": 30_000, "cnn_batch": 128, "cnn_rounds": 3, "budget": 24 << 20, "memory_factor": 10,
        "memory_rounds": 3}
QUICK = {"rows": 20_000, "files": 4, "group": 2_048, "rounds": 2, "batch": 256,
         "cnn_rows": 1_024, "cnn_batch": 64, "cnn_rounds": 1, "budget": 16 << 20, "memory_factor": 10,
         "memory_rounds": 1}
GOALS = {"reader/limit": 0.8, "reader/recipe": 2.0, "cnn table/arrays": 0.95}


def write_table(url: str, rows: int, files: int, group: int, kind: str, env: dict) -> None:
    code = f"""
import numpy as np, pyarrow as pa, pyarrow.parquet as pq
from stratkit.storage.arrow import arrow_filesystem
fs, base = arrow_filesystem({url!r})
fs.create_dir(base, recursive=True)
rng = np.random.default_rng(0)
rows, files, kind = {rows}, {files}, {kind!r}
at = 0
for i in range(files):
    n = rows // files + (1 if i < rows % files else 0)
    if kind == "image":
        cols = {{"image": pa.FixedSizeListArray.from_arrays(pa.array(rng.random(n * 768, dtype="float32")), 768),
                "label": pa.array(rng.integers(0, 10, n))}}
    else:
        width = 64 if kind == "wide" else 16
        cols = {{"x": pa.FixedSizeListArray.from_arrays(pa.array(rng.normal(size=n * width).astype("float32")), width),
                "y": pa.array(rng.normal(size=n).astype("float32"))}}
    with fs.open_output_stream(f"{{base}}/part-{{i:05d}}.parquet") as out:
        pq.write_table(pa.table(cols), out, row_group_size={group})
    at += n
"""
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=1800)


def task(argv: list[str], env: dict, timeout: float = 3600) -> dict:
    out = subprocess.run([sys.executable, str(TASK), *argv], env=env, capture_output=True, text=True,
                         timeout=timeout)
    lines = [line.split("RESULT ", 1)[1] for line in out.stdout.splitlines() if "RESULT " in line]
    if out.returncode or not lines:
        raise RuntimeError(out.stderr[-4000:])
    return json.loads(lines[-1])


def memory(small: str, big: str, budget: int, env: dict, rounds: int) -> list[dict]:
    """`rounds` rounds of the two launches (the order alternating): 2 workers on the big table, and the control."""
    out = []
    for r in range(rounds):
        for feed in (("table", "control") if r % 2 == 0 else ("control", "table")):
            run = subprocess.run([sys.executable, "-m", "stratkit.cli", "launch", "--workers", "2", "--",
                                  sys.executable, str(TASK), "memory", small, big, str(budget), feed], env=env,
                                 capture_output=True, text=True, timeout=3600)
            lines = [line.split("RESULT ", 1)[1] for line in run.stdout.splitlines() if "RESULT " in line]
            if run.returncode or len(lines) != 2:
                raise RuntimeError(run.stderr[-4000:])
            out += [{**json.loads(line), "round": r} for line in lines]
    return out


def memory_rows(workers: list[dict]) -> list[dict]:
    """Per worker: its growth on the table and on the control (mean, min-max over the rounds), and the reader's:
    each round's table growth less the same round's control growth."""
    growth = lambda w: (w["big_peak_kb"] - w["small_peak_kb"]) / 1024  # noqa: E731
    rows = []
    for rank in sorted({w["rank"] for w in workers}):
        mine = {(w["round"], w["feed"]): w for w in workers if w["rank"] == rank}
        rounds = sorted({r for r, _ in mine})
        table = [growth(mine[r, "table"]) for r in rounds]
        control = [growth(mine[r, "control"]) for r in rounds]
        reader = [t - c for t, c in zip(table, control)]
        budget = workers[0]["budget"] / 2**20
        rows.append({"worker": rank, "Arrow pool": workers[0].get("arrow_pool", "?"),
                     "peak RSS MiB": round(max(w["big_peak_kb"] for w in mine.values()) / 1024, 1),
                     "growth, table MiB": f"{statistics.mean(table):.1f} ({min(table):.1f}-{max(table):.1f})",
                     "growth, control MiB": f"{statistics.mean(control):.1f} ({min(control):.1f}-{max(control):.1f})",
                     "reader MiB": round(statistics.mean(reader), 1),
                     "reader/budget": f"{statistics.mean(reader) / budget:.2f} ({min(reader) / budget:.2f}-"
                                      f"{max(reader) / budget:.2f})",
                     "budget MiB": round(budget, 1),
                     "table decoded MiB": round(workers[0]["big_decoded_bytes"] / 2**20, 1)})
    return rows


def _summary(values: list[float]) -> dict:
    return {"mean": statistics.mean(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    size = QUICK if args.quick else FULL
    load_before = os.getloadavg()
    env = clean_env(PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rows_out, raw = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-lake-") as scratch, MotoS3() as s3:
        s3env = {**env, **s3.env}
        places = {"local disk": f"{scratch}/table", "moto S3": "s3://bench/table"}
        for where, url in places.items():
            write_table(url, size["rows"], size["files"], size["group"], "narrow", s3env)
            result = task(["throughput", url, str(size["rounds"]), str(size["batch"])], s3env)
            raw[where] = result
            rates = {way: [r[way] for r in result["rounds"]] for way in ("reader", "limit", "recipe")}
            reader_limit = [r["reader"] / r["limit"] for r in result["rounds"]]
            passes = next(k for k in result["rounds"][0] if k.startswith("reader, "))
            steady_limit = [r[passes] / r["limit"] for r in result["rounds"]]
            steady_fast = [r[passes] / r["limit, use_threads=False"] for r in result["rounds"]]
            reader_recipe = [r["reader"] / r["recipe"] for r in result["rounds"]]
            rows_out.append({"source": where, "reader rows/s": round(statistics.mean(rates["reader"])),
                             "limit rows/s": round(statistics.mean(rates["limit"])),
                             "recipe rows/s": round(statistics.mean(rates["recipe"])),
                             "reader/limit": round(statistics.mean(reader_limit), 3),
                             "reader/limit min-max": f"{min(reader_limit):.2f}-{max(reader_limit):.2f}",
                             f"{passes} rows/s": round(statistics.mean(r[passes] for r in result["rounds"])),
                             "passes/limit": round(statistics.mean(steady_limit), 3),
                             "passes/limit min-max": f"{min(steady_limit):.2f}-{max(steady_limit):.2f}",
                             "limit 1 thread rows/s": round(statistics.mean(r["limit, use_threads=False"]
                                                                            for r in result["rounds"])),
                             "passes/limit 1 thread": f"{statistics.mean(steady_fast):.3f} ({min(steady_fast):.2f}-"
                                                      f"{max(steady_fast):.2f})",
                             "reader/recipe": round(statistics.mean(reader_recipe), 2),
                             "plan s": round(result["plan_seconds"], 2),
                             "reader via s3fs rows/s": round(statistics.mean(r["reader via s3fs"] for r in
                                                                             result["rounds"]))
                             if "reader via s3fs" in result["rounds"][0] else "-"})
        cnn_url = f"{scratch}/images"
        write_table(cnn_url, size["cnn_rows"], 4, max(size["cnn_rows"] // 12, 64), "image", env)
        cnn = task(["cnn", cnn_url, str(size["cnn_rounds"]), str(size["cnn_batch"])], env)
        raw["cnn"] = cnn
        ratios = [r["table"] / r["arrays"] for r in cnn["rounds"]]
        small, big = f"{scratch}/small", f"{scratch}/big"
        write_table(small, 2_000, 2, 500, "wide", env)
        big_rows = size["memory_factor"] * size["budget"] // 260 + 1
        write_table(big, big_rows, 16, 1024, "wide", env)
        workers = memory(small, big, size["budget"], env, size["memory_rounds"])
        raw["memory"] = workers
    load_after = os.getloadavg()
    ceiling = [r["decoded"] / r["arrays"] for r in cnn["rounds"]]
    to_ceiling = [r["table"] / r["decoded"] for r in cnn["rounds"]]
    cnn_row = {"table steps/s": round(statistics.mean(r["table"] for r in cnn["rounds"]), 2),
               "arrays steps/s": round(statistics.mean(r["arrays"] for r in cnn["rounds"]), 2),
               "decoded steps/s": round(statistics.mean(r["decoded"] for r in cnn["rounds"]), 2),
               "table/arrays": round(statistics.mean(ratios), 3),
               "min-max": f"{min(ratios):.3f}-{max(ratios):.3f}",
               "decoded/arrays": f"{statistics.mean(ceiling):.3f} ({min(ceiling):.2f}-{max(ceiling):.2f})",
               "table/decoded": f"{statistics.mean(to_ceiling):.3f} ({min(to_ceiling):.2f}-{max(to_ceiling):.2f})"}
    print_table("rows/s into fit (mean of the rounds)", rows_out)
    print_table("a small CNN's steps/s: fed by the reader, by in-memory arrays, by pyarrow's raw decode", [cnn_row])
    memory_table = memory_rows(workers)
    print_table("memory: 2 workers, a table 10x read_ahead_bytes, against the same steps fed from memory",
                memory_table)
    print(f"load average before {load_before}, after {load_after}")
    name = "lake-quick" if args.quick else "lake"
    write_result(name, {"quick": args.quick, "size": size, "goals": GOALS, "rows": rows_out, "cnn": cnn_row,
                        "memory": memory_table, "raw": raw, "loadavg_before": load_before,
                        "loadavg_after": load_after})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
