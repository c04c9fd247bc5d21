"""spark_jobs/pipeline_job.py, the example Spark ML job, run as a user runs it: its own process and Spark.

The job fits Pipeline([VectorAssembler, StandardScaler, KerasEstimator]) on the executors, saves it, scores the
table with the fitted pipeline, stops its SparkSession, and in a new SparkSession loads the saved pipeline
and scores the table again: both scorings must agree row by row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from spark_helpers import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def test_the_pipeline_job_fits_saves_and_scores_the_same_in_a_new_session(tmp_path):
    pytest.importorskip("pyspark")
    pytest.importorskip("sklearn")
    import pyarrow.parquet as pq

    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    # One worker on local[1]: one Python worker per session imports TensorFlow (2 workers are
    # tests/spark/test_spark_ml.py's); the job's flags as a user passes them.
    done = subprocess.run([sys.executable, str(REPO_ROOT / "spark_jobs" / "pipeline_job.py"), "--out",
                           str(tmp_path), "--master", "local[1]", "--workers", "1", "--epochs", "3"], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["rows"] == 442 and summary["workers"] == 1
    assert "[worker:0] Epoch 3/3" in done.stdout
    fitted = dict(zip(*pq.read_table(tmp_path / "fitted", columns=["id", "prediction"]).to_pydict().values()))
    scored = dict(zip(*pq.read_table(tmp_path / "scored", columns=["id", "prediction"]).to_pydict().values()))
    assert len(fitted) == len(scored) == 442
    assert max(abs(fitted[i] - scored[i]) for i in fitted) <= 1e-5
    assert abs(summary["rmse"] - summary["fit_rmse"]) <= 1e-4
