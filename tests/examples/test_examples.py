"""The examples run unchanged as one process and as each task of a TF_CONFIG cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from procs import REPO_ROOT, describe, free_ports, run_cluster, run_process, worker_tf_configs

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
