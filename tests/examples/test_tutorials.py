"""TensorFlow's distributed-training tutorials, as ported in examples/tutorials/, run under `stratkit launch`.

Each test runs a ported tutorial the way a user would (the launcher, real
processes on 127.0.0.1) and checks that it exits 0 with numbers in a sane band,
and, where the maths says so, equal to the single-process run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from procs import REPO_ROOT, child_env, run_process

pytestmark = [pytest.mark.slow, pytest.mark.multiworker]

TUTORIALS = Path(REPO_ROOT) / "examples" / "tutorials"


def _launch(script: str, layout: list[str], args: list[str], timeout: float = 240) -> dict[str, dict]:
    """Run `stratkit launch <layout> -- python <script> <args>`; return task -> its last JSON line."""
    argv = [sys.executable, "-m", "stratkit.cli", "launch", *layout, "--timeout", str(int(timeout) - 20), "--",
            sys.executable, str(TUTORIALS / script), *args]
    proc = subprocess.run(argv, env=child_env(None, {"STRATKIT_WORKERS": None}), capture_output=True, text=True,
                          timeout=timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    reports = {task: json.loads(line) for task, line in re.findall(r"^\[(\w+:\d+)\] (\{.*\})$", output, re.M)}
    assert reports, output[-6000:]
    return reports


def _single(script: str, args: list[str]) -> dict:
    result = run_process(str(TUTORIALS / script), args=args, timeout=240)
    assert result.ok, result.stderr[-6000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_keras_tutorial_two_workers_train_as_one_process_with_the_same_global_batch(tmp_path):
    # 2 workers x 32 per replica and 1 process x 64 see the same global batches in the same order.
    cluster = _launch("keras_distributed.py", ["--workers", "2"],
                      ["--epochs", "3", "--per-replica-batch", "32", "--out", str(tmp_path / "cluster")])
    single = _single("keras_distributed.py", ["--epochs", "3", "--per-replica-batch", "64",
                                              "--out", str(tmp_path / "single")])
    chief, other = cluster["worker:0"], cluster["worker:1"]
    assert chief["replicas"] == 2 and chief["chief"] and not other["chief"]
    assert chief["loss"] == pytest.approx(single["loss"], rel=1e-3)
    assert chief["loss"] == other["loss"] and chief["eval_accuracy"] == other["eval_accuracy"]
    assert 0.85 <= chief["eval_accuracy"] <= 1.0
    assert chief["loaded_accuracy"] == chief["loaded_in_scope_accuracy"] == chief["eval_accuracy"]
    # The chief's callbacks wrote where asked; worker 1's private copies are gone.
    assert sorted(p.name for p in (tmp_path / "cluster" / "training_checkpoints").iterdir()) == [
        f"ckpt_{e}.weights.h5" for e in (1, 2, 3)]
    assert (tmp_path / "cluster" / "model.keras").is_file()


def test_multi_worker_keras_tutorial_with_backup_and_restore(tmp_path):
    reports = _launch("multi_worker_keras.py", ["--workers", "2"], ["--out", str(tmp_path)])
    chief, other = reports["worker:0"], reports["worker:1"]
    assert chief["workers"] == 2 and chief["loss"] == other["loss"]
    assert 0.75 <= chief["eval_accuracy"] <= 1.0
    assert (tmp_path / "model.keras").is_file()
    assert not (tmp_path / "backup").exists()   # BackupAndRestore removes its backup after a finished run


def test_custom_loop_tutorial_checkpoints_on_the_chief_and_resumes(tmp_path):
    first = _launch("custom_loop_mwms.py", ["--workers", "2"], ["--epochs", "2", "--out", str(tmp_path)])
    assert first["worker:0"]["steps"] == 40 and first["worker:0"]["resumed_at"] == 0
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir())[0] == "checkpoint"
    resumed = _launch("custom_loop_mwms.py", ["--workers", "2"], ["--epochs", "3", "--out", str(tmp_path)])
    for report in resumed.values():   # both workers restored the chief's epoch-2 checkpoint
        assert report["resumed_at"] == 2 and report["steps"] == 60
    assert resumed["worker:0"]["loss"] == resumed["worker:1"]["loss"]
    assert 0.75 <= resumed["worker:0"]["eval_accuracy"] <= 1.0


def test_parameter_server_tutorial_model_fit_becomes_trainer_fit():
    reports = _launch("parameter_server.py", ["--chief", "--workers", "2", "--ps", "1"], ["--mode", "fit"])
    chief = reports["chief:0"]
    assert chief["strategy"] == "parameter_server"
    assert 0.6 <= chief["train_accuracy"] <= 1.0 and 0.75 <= chief["eval_accuracy"] <= 1.0


def test_parameter_server_tutorial_custom_loop_with_atomic_counters_and_sharded_weights():
    # Two ps tasks and a 1 KiB partitioner: both Dense kernels are split, as in the tutorial.
    reports = _launch("parameter_server.py", ["--chief", "--workers", "2", "--ps", "2"],
                      ["--mode", "loop", "--min-shard-bytes", "1024"])
    chief = reports["chief:0"]
    assert chief["sharded"] == 2
    assert chief["steps"] == chief["scheduled"] == 80
    assert 0.6 <= chief["train_accuracy"] <= 1.0 and 0.75 <= chief["eval_accuracy"] <= 1.0


def test_save_load_tutorial_loads_under_another_strategy_and_without(tmp_path):
    reports = _launch("save_load.py", ["--workers", "2"], ["--out", str(tmp_path)])
    for report in reports.values():
        accuracies = {report[k] for k in ("trained_accuracy", "loaded_accuracy", "other_strategy_accuracy",
                                          "saved_model_accuracy")}
        assert len(accuracies) == 1 and 0.85 <= accuracies.pop() <= 1.0
    assert (tmp_path / "model.keras").is_file() and (tmp_path / "saved_model" / "saved_model.pb").is_file()
