"""Input pipeline: Parquet -> tf.data reader throughput vs the model's consumption rate (goal: >= 5x).

Data: written here with pyarrow the way stratkit.spark stages a DataFrame
(`DataFrameInput(df)` -> Parquet of a "features" array column, as
VectorAssembler/vector_to_array give -- float64 -- and a "label" column), in
4 files (Spark partitions) with several row groups each:
  * mlp:  64 features per row (digits-like), the 64-128-128-10 MLP of bench_spark;
  * conv: 32x32x3 = 3072 features per row, the ResNet-style model of bench_scaling.

Per model, one process (benchmarks/tasks/input_task.py) with a training
worker's thread settings (1 intra-op thread: 2 workers on 2 cores) measures,
in alternating rounds after a warm-up, the median rows/s of:
  * stratkit.spark's reader (`ParquetShard.dataset_fn`, worker 0 of 2, one
    epoch of per-replica batches, consumed in-graph by Dataset.reduce);
  * a plain pyarrow read_table -> from_tensor_slices reader (load included);
  * the model training from in-memory batches of the same size (examples/s).

ratio = reader rows/s / model examples/s. >= 5 means the reader keeps the
model fed with 4/5 of a core's time to spare; it is a lower bound for a worker
of a 2-worker job, which consumes more slowly than one alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_result  # noqa: E402
from jobs import TASKS, clean_env, python, thread_vars  # noqa: E402

GOAL = 5.0
FILES = 4
FULL = {"mlp": {"rows": 200_000, "row_group": 16_384, "model_steps": 200},
        "conv": {"rows": 4_096, "row_group": 512, "model_steps": 16, "image": 32, "width": 16,
                 "blocks": [1, 1, 1, 1]},
        "rounds": 5, "per_replica_batch": 32}
QUICK = {"mlp": {"rows": 8_192, "row_group": 1_024, "model_steps": 20},
         "conv": {"rows": 256, "row_group": 64, "model_steps": 3, "image": 16, "width": 4, "blocks": [1, 1]},
         "rounds": 2, "per_replica_batch": 8}


def write_parquet(directory: Path, rows: int, width: int, row_group: int) -> list[str]:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    paths = []
    per_file = rows // FILES
    for i in range(FILES):
        features = rng.normal(size=(per_file, width))  # float64, as Spark ML vectors are
        column = pa.FixedSizeListArray.from_arrays(pa.array(features.ravel()), width)
        labels = pa.array(rng.integers(0, 10, size=per_file), pa.int32())
        path = directory / f"part-{i:05d}.parquet"
        pq.write_table(pa.table({"features": column.cast(pa.list_(pa.float64())), "label": labels}), path,
                       row_group_size=row_group)
        paths.append(str(path))
    return paths


def measure(kind: str, sizes: dict, common: dict, directory: Path, timeout: float) -> dict:
    width = 64 if kind == "mlp" else sizes["image"] * sizes["image"] * 3
    files = write_parquet(directory, sizes["rows"], width, sizes["row_group"])
    config = {**sizes, "model": kind, "files": files, "dir": str(directory), "rounds": common["rounds"],
              "per_replica_batch": common["per_replica_batch"]}
    env = clean_env(**thread_vars(1, None))
    out = subprocess.run([python(), str(TASKS / "input_task.py"), json.dumps(config)], check=False,
                         capture_output=True, text=True, env=env, timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(f"input benchmark for {kind} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["parquet_bytes"] = sum(os.path.getsize(f) for f in files)
    result["row_floats"] = width
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    started = time.monotonic()
    rows = []
    for kind in ("mlp", "conv"):
        with tempfile.TemporaryDirectory(prefix=f"stratkit-bench-input-{kind}-") as tmp:
            r = measure(kind, sizes[kind], sizes, Path(tmp), timeout=300.0 if args.quick else 600.0)
        model_rate = r["median"]["model"]
        for reader, label in (("stratkit", "ParquetShard.dataset_fn (stratkit.spark)"),
                              ("plain", "pyarrow read_table -> from_tensor_slices")):
            rows.append({"model": kind, "reader": label, "reader rows/s": r["median"][reader],
                         "model ex/s": model_rate, "ratio": r["median"][reader] / model_rate,
                         "goal met": r["median"][reader] / model_rate >= GOAL})
        rows[-1]["raw"] = rows[-2]["raw"] = r
    print_table(f"Parquet reader throughput vs model consumption, per worker (goal ratio >= {GOAL:g})",
                [{k: v for k, v in row.items() if k != "raw"} for row in rows])
    payload = {"quick": args.quick, "goal_ratio": GOAL, "threads": {"intra_op": 1}, "sizes": sizes, "rows": rows,
               "wall_seconds": time.monotonic() - started}
    print(f"wrote {write_result('input' + ('-quick' if args.quick else ''), payload)}")
    return payload


if __name__ == "__main__":
    main()
