"""`make demo`: what stratkit decides here, then the digits model on a local
2-worker cluster (`stratkit launch`), then the same training through Spark in
local mode (`stratkit.spark.SparkRunner`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "examples" / "digits.py"


def banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def stratkit_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "stratkit.cli", *args]


def last_json(output: str) -> dict:
    for line in reversed(output.splitlines()):
        start = line.find("{")
        if start >= 0:
            try:
                return json.loads(line[start:])
            except json.JSONDecodeError:
                continue
    raise RuntimeError("no result line in the output")


def multi_worker() -> float:
    banner("2-worker MultiWorkerMirrored on 127.0.0.1 via `stratkit launch`")
    command = stratkit_cmd("launch", "--workers", "2", "--", sys.executable, str(DIGITS), "--epochs", "10")
    print("$ stratkit launch --workers 2 -- python examples/digits.py --epochs 10", flush=True)
    start = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if "examples/sec" in line or "held_out_accuracy" in line or "Root cause" in line:
            print(line, end="", flush=True)
    if proc.wait() != 0:
        print("".join(lines[-40:]))
        raise SystemExit(f"the 2-worker run failed (exit {proc.returncode})")
    result = last_json("".join(line for line in lines if "held_out_accuracy" in line))
    print(f"2 workers, held-out accuracy {result['held_out_accuracy']:.3f} "
          f"({result['replicas']} replicas, {time.monotonic() - start:.0f}s)", flush=True)
    return result["held_out_accuracy"]


def spark_train_fn(epochs: int) -> float:
    """Runs on each Spark task, in a fresh process, under the TF_CONFIG the runner set."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("digits_example", DIGITS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(["--epochs", str(epochs)])["held_out_accuracy"]


def spark() -> float | None:
    banner("The same training through Spark (local mode) via stratkit.spark.SparkRunner")
    try:
        from pyspark.sql import SparkSession

        from stratkit.spark import SparkRunner
    except ImportError as exc:
        print(f"skipped: {exc}")
        return None
    spark_session = (SparkSession.builder.master("local[2]").appName("stratkit-demo")
                     .config("spark.driver.host", "127.0.0.1").config("spark.ui.enabled", "false")
                     .config("spark.ui.showConsoleProgress", "false")
                     .getOrCreate())
    try:
        accuracy = SparkRunner(num_workers=2, spark=spark_session).run(spark_train_fn, 10)
    finally:
        spark_session.stop()
    print(f"Spark, 2 tasks, held-out accuracy {accuracy:.3f}", flush=True)
    return accuracy


def main() -> None:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    # Spark's Python workers must be this interpreter (the one with stratkit installed).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    banner("stratkit info (what this process would get)")
    subprocess.run(stratkit_cmd("info"), check=True)
    accuracy = multi_worker()
    spark_accuracy = spark()
    banner("summary")
    print(f"local 2-worker cluster: held-out accuracy {accuracy:.3f}")
    if spark_accuracy is not None:
        print(f"Spark local mode:       held-out accuracy {spark_accuracy:.3f}")
    if accuracy < 0.9 or (spark_accuracy is not None and spark_accuracy < 0.9):
        raise SystemExit("accuracy below 0.9")


if __name__ == "__main__":
    main()
