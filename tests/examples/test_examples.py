"""The examples run unchanged as one process and as each task of a TF_CONFIG cluster."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from procs import REPO_ROOT, Result, child_env, describe, free_ports, run_cluster, run_process, worker_tf_configs

pytestmark = pytest.mark.slow

EXAMPLES = Path(REPO_ROOT) / "examples"
RESNET_TINY = ["--epochs", "2", "--examples", "64", "--image", "16", "--width", "4", "--per-replica-batch", "8"]


def test_digits_single_process_reaches_090():
    result = run_process(str(EXAMPLES / "digits.py"), args=["--epochs", "10"], timeout=300)
    assert result.ok, describe([result])
    report = result.last_json()
    assert report["strategy"] == "one_device" and report["held_out_accuracy"] >= 0.9


@pytest.mark.multiworker
def test_resnet_style_model_runs_unchanged_on_two_workers_with_lr_scaling():
    results = run_cluster(str(EXAMPLES / "resnet_synthetic.py"), worker_tf_configs(free_ports(2)),
                          args=RESNET_TINY, timeout=300, grace_after_failure=30)
    assert all(r.ok for r in results), describe(results)
    report = results[0].last_json()   # only the chief prints its result
    assert report["strategy"] == "multi_worker_mirrored" and report["replicas"] == 2
    assert len(report["loss"]) == 2 and all(loss == loss for loss in report["loss"])  # finite, not NaN
    assert "held_out_accuracy" not in results[1].stdout and '"loss"' not in results[1].stdout


def test_resnet_style_model_single_process():
    result = run_process(str(EXAMPLES / "resnet_synthetic.py"), args=RESNET_TINY, timeout=300)
    assert result.ok, describe([result])
    assert result.last_json()["replicas"] == 1


def test_check_exact_finds_one_processs_mathematics_in_float64():
    """docs/exact.md's check: one device against 2 replicas of one process, float32 and float64, AdamW and SGD.
    float64 leaves ~1e-15 (the mathematics is one process's), float32 ~1e-7 (the summation order)."""
    result = run_process(str(EXAMPLES / "check_exact.py"), timeout=300)
    assert result.ok, describe([result])
    gaps = result.last_json()
    assert set(gaps) == {"float32 adamw", "float32 sgd", "float64 adamw", "float64 sgd"}, gaps
    assert gaps["float64 adamw"] < 1e-12 and gaps["float64 sgd"] < 1e-12, gaps
    assert 0 < gaps["float32 sgd"] < 1e-5 and gaps["float32 adamw"] < 1e-5, gaps
    assert "largest weight difference, one device vs 2 replicas" in result.stdout


# -- the samples the README and the docs include (README "Quickstart", docs/spark.md) -------------

def _quickstart(argv: list[str], cwd: Path, env: dict[str, str | None] | None = None) -> str:
    proc = subprocess.run(argv, cwd=cwd, env=child_env(None, {"STRATKIT_WORKERS": None, **(env or {})}),
                          capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return output


def _sample(script: str, cwd: Path, args: list[str] = (), ok: bool = True) -> Result:
    """`python script args` in `cwd`, forked from the tests' fork servers (tests/procs.py): the script runs as in
    a new interpreter, without importing TensorFlow again (~3.5 CPU-s quiet; nothing here tests process start-up)."""
    (result,) = run_cluster(script, [None], env={"STRATKIT_WORKERS": None}, args=args, cwd=cwd, timeout=300)
    assert result.ok or not ok, describe([result])
    return result


def test_quickstart_runs_as_one_process(tmp_path):
    run = _sample(str(EXAMPLES / "quickstart.py"), tmp_path)
    output = run.stdout + run.stderr
    evaluation = ast.literal_eval(re.findall(r"^(\{'accuracy'.*\})$", output, re.M)[-1])
    assert set(evaluation) == {"accuracy", "loss"} and evaluation["accuracy"] >= 0.9
    assert (tmp_path / "out" / "digits.keras").is_file() and not (tmp_path / "backup").exists()


@pytest.mark.multiworker
def test_quickstart_runs_unchanged_on_two_workers_under_stratkit_launch(tmp_path):
    output = _quickstart([sys.executable, "-m", "stratkit.cli", "launch", "--workers", "2", "--timeout", "280", "--",
                          sys.executable, str(EXAMPLES / "quickstart.py")], tmp_path)
    evaluations = dict(re.findall(r"^\[(worker:\d)\] (\{'accuracy'.*\})$", output, re.M))
    assert set(evaluations) == {"worker:0", "worker:1"}, output[-6000:]
    assert evaluations["worker:0"] == evaluations["worker:1"]  # every worker gets the same result
    assert ast.literal_eval(evaluations["worker:0"])["accuracy"] >= 0.85
    assert (tmp_path / "out" / "digits.keras").is_file()


@pytest.mark.spark
def test_spark_example_trains_on_a_dataframe_with_two_workers(tmp_path):
    pytest.importorskip("pyspark")
    output = _quickstart([sys.executable, str(EXAMPLES / "spark_train.py")], tmp_path,
                         {"SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable})
    result = ast.literal_eval(re.findall(r"(\{'loss'.*\})", output)[-1])
    assert result["workers"] == 2 and result["accuracy"] >= 0.5, output[-6000:]


def test_the_callback_state_sample_counts_every_step_once_across_a_crash(tmp_path):
    """docs/fault-tolerance.md includes examples/callback_state.py: a user's get_state/set_state in the backups."""
    sample = str(EXAMPLES / "callback_state.py")
    crashed = _sample(sample, tmp_path, ["--stop-at", "23"], ok=False)
    assert crashed.returncode == -9, describe([crashed])
    assert "steps counted" not in crashed.stdout
    resumed = _sample(sample, tmp_path)
    output = resumed.stdout + resumed.stderr
    assert "resumed from" in output and "at epoch 2 + 1 steps" in output  # the backup of step 21
    assert "steps counted: 50" in output and not (tmp_path / "backup").exists()


@pytest.mark.multiworker
def test_train_from_lake_reads_a_parquet_table_on_s3_under_stratkit_launch(tmp_path, store_server):
    """examples/train_from_lake.py as its docstring says: make a table on S3 (moto), train on 2 workers."""
    s3 = store_server("s3")
    s3.make_bucket("lake-example")
    env = {**s3.env, "STRATKIT_BACKUP_STAGING": str(tmp_path / "staging")}
    script = str(EXAMPLES / "train_from_lake.py")
    made = subprocess.run([sys.executable, script, "make-table", "s3://lake-example/shapes", "--rows", "3000",
                           "--files", "6"], env=child_env(env=env), capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    output = _quickstart([sys.executable, "-m", "stratkit.cli", "launch", "--workers", "2", "--no-private-network",
                          "--timeout", "280", "--", sys.executable, script, "train", "s3://lake-example/shapes",
                          "--epochs", "2", "--backup-dir", "s3://lake-example/runs/shapes"], tmp_path, env)
    reports = dict(re.findall(r"^\[(worker:\d)\] (\{\"rows\".*\})$", output, re.M))
    assert set(reports) == {"worker:0", "worker:1"} and reports["worker:0"] == reports["worker:1"], output[-4000:]
    report = json.loads(reports["worker:0"])
    assert report["rows"] == 3000 and report["steps_per_epoch"] == 12 and report["workers"] == 2
    assert report["accuracy"][-1] > 0.6, report


# -- examples/tune_keras_tuner.py (docs/tuning.md) -------------------------------------------------

@pytest.mark.multiworker
def test_the_tuning_example_runs_on_two_tuners_under_launch(tmp_path):
    """The example's seeded search on 2 tuners under `stratkit launch --tune`: every tuner ends with the same
    trials, scores and best model (the equality with one process and LocalRunner: tests/tuning)."""
    launched = _quickstart([sys.executable, "-m", "stratkit.cli", "launch", "--tune", "--workers", "2", "--",
                            sys.executable, str(EXAMPLES / "tune_keras_tuner.py"), "--trials", "3", "--epochs", "1"],
                           tmp_path)
    reports = dict(re.findall(r"^\[(worker:\d)\] (\{.*\})$", launched, re.M))
    assert set(reports) == {"worker:0", "worker:1"}, launched[-6000:]
    first = json.loads(reports["worker:0"])
    assert json.loads(reports["worker:1"]) == first and len(first["trials"]) == 3 and first["accuracy"] > 0.3


# -- examples/tune_optuna.py (docs/tuning.md, "Optuna") --------------------------------------------

@pytest.mark.multiworker
@pytest.mark.tune_acceptance  # make test-tune; make test runs Optuna on 2 workers in tests/tuning/test_optuna.py
def test_the_optuna_example_tries_one_processs_trials_on_two_workers_and_prunes(tmp_path):
    """The example's study (8 trials, a seeded TPE, the median pruner, optuna-integration's Keras callback) on
    2 workers under `stratkit launch --tune`, beside the same study in one process: the same trials, every
    epoch's reported value the same (each trial trains as alone), the same value where both runs completed a
    trial, pruned trials in the study; which trials are pruned depends on which ended first (docs/tuning.md)."""
    example = str(EXAMPLES / "tune_optuna.py")
    env = child_env(None, {"STRATKIT_WORKERS": None})
    tiny = ["--epochs", "2"]
    runs = {"one": [sys.executable, example, *tiny],
            "two": [sys.executable, "-m", "stratkit.cli", "launch", "--tune", "--workers", "2", "--", sys.executable,
                    example, *tiny]}
    procs = {}
    for name, argv in runs.items():  # side by side: the wall time of the slower one
        (tmp_path / name).mkdir()
        procs[name] = subprocess.Popen(argv, cwd=tmp_path / name, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
    outputs = {name: proc.communicate(timeout=600)[0] for name, proc in procs.items()}
    assert all(proc.returncode == 0 for proc in procs.values()), outputs
    one = json.loads(outputs["one"].strip().splitlines()[-1])
    reports = dict(re.findall(r"^\[(worker:\d)\] (\{.*\})$", outputs["two"], re.M))
    assert set(reports) == {"worker:0", "worker:1"} and reports["worker:0"] == reports["worker:1"], outputs["two"]
    two = json.loads(reports["worker:0"])
    assert [t[:3:2] for t in two["trials"]] == [t[:3:2] for t in one["trials"]] and len(one["trials"]) == 8
    assert "PRUNED" in {t[1] for t in two["trials"]}
    print("pruned at epoch: one process %s, 2 workers %s" % tuple(
        {t[0]: len(t[4]) - 1 for t in run["trials"] if t[1] == "PRUNED"} for run in (one, two)))
    for (number, state, _, value, reported), (_, state1, _, value1, reported1) in zip(two["trials"], one["trials"]):
        steps = reported.keys() & reported1.keys()
        assert steps and all(abs(reported[s] - reported1[s]) <= 1e-6 for s in steps), (number, reported, reported1)
        if state == state1 == "COMPLETE":
            assert abs(value - value1) <= 1e-6, number

