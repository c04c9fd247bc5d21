"""The `stratkit` command: info and tf-config answer without importing TensorFlow."""

from __future__ import annotations

import json
import subprocess
import sys

from procs import child_env


def _run(*code_or_args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *code_or_args], capture_output=True, text=True, timeout=60,
                          env=child_env(env=env))


def test_info_json_reports_spec_reasons_and_versions_without_tensorflow():
    code = ("import sys, stratkit.cli as c; rc = c.main(['info', '--json']); "
            "assert 'tensorflow' not in sys.modules, 'info imported TensorFlow'; sys.exit(rc)")
    tf_config = {"cluster": {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}, "task": {"type": "worker",
                                                                                        "index": 0}}
    result = _run("-c", code, env={"TF_CONFIG": json.dumps(tf_config)})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["spec"]["strategy"] == "multi_worker_mirrored"
    assert report["spec"]["task_type"] == "worker" and report["spec"]["is_chief"] is False
    assert any("TF_CONFIG" in reason for reason in report["spec"]["reasons"])
    assert report["versions"]["tensorflow"] and report["versions"]["keras"]
    assert json.loads(report["tf_config"])["task"] == {"type": "worker", "index": 0}


def test_info_explains_a_bad_environment_instead_of_a_traceback():
    result = _run("-m", "stratkit.cli", "info", env={"TF_CONFIG": "{not json"})
    assert result.returncode == 2
    assert "TF_CONFIG is not valid JSON" in result.stderr and "Traceback" not in result.stderr


def test_info_shows_the_visible_gpus_and_which_worker_would_get_which():
    result = _run("-m", "stratkit.cli", "info", "--workers", "2", env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert result.returncode == 0, result.stderr
    assert "gpus          4,5,6,7 (from CUDA_VISIBLE_DEVICES)" in result.stdout
    assert "worker:0    CUDA_VISIBLE_DEVICES='4,5'" in result.stdout
    assert "worker:1    CUDA_VISIBLE_DEVICES='6,7'" in result.stdout
    stand_in = {"CUDA_VISIBLE_DEVICES": None, "STRATKIT_FAKE_GPU_COUNT": "8"}  # tests' stand-in for 8 GPUs
    report = json.loads(_run("-m", "stratkit.cli", "info", "--json", "--workers", "gpu", env=stand_in).stdout)
    assert report["devices"]["visible_gpus"] == [str(i) for i in range(8)]
    assert report["launch_gpus"] == {f"worker:{i}": str(i) for i in range(8)}
    refused = _run("-m", "stratkit.cli", "info", "--workers", "3", env=stand_in)
    assert refused.returncode == 2 and "--workers 3" in refused.stderr and "Fix:" in refused.stderr


def test_help_lists_the_commands():
    result = _run("-m", "stratkit.cli", "--help")
    assert result.returncode == 0
    for command in ("info", "tf-config"):
        assert command in result.stdout


def test_tf_config_with_an_absurd_task_index_exits_2_naming_the_flag():
    huge = "9" * 5000  # longer than Python's int-string limit
    result = _run("-m", "stratkit.cli", "tf-config", "--cluster", "worker=a:1,b:2", "--task", f"worker:{huge}")
    assert result.returncode == 2, result.stderr
    assert "--task" in result.stderr and "Fix:" in result.stderr and "Traceback" not in result.stderr
    ok = _run("-m", "stratkit.cli", "tf-config", "--cluster", "worker=a:1,b:2", "--task", "worker:1")
    assert ok.returncode == 0 and json.loads(ok.stdout)["task"] == {"type": "worker", "index": 1}
