"""`stratkit launch --tune`: what each tuner gets (no TF_CONFIG, its own GPUs, the service's address and the run's
token), and the layouts a tune run refuses. Real launches of a tiny script; no TensorFlow."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from procs import child_env

from stratkit.cli import main

SHOW = ("import json, os; print('ENV', json.dumps({k: os.environ.get(k) for k in ('TF_CONFIG', "
        "'CUDA_VISIBLE_DEVICES', 'STRATKIT_TUNE_ADDRESS', 'STRATKIT_TUNE_TOKEN', 'STRATKIT_TUNE_TUNER', "
        "'STRATKIT_TUNE_TUNERS', 'STRATKIT_TUNE_SERVE')}))")


@pytest.mark.slow
def test_each_tuner_gets_its_own_gpu_the_services_address_and_the_token_and_no_tf_config():
    proc = subprocess.run([sys.executable, "-m", "stratkit.cli", "launch", "--tune", "--workers", "gpu", "--",
                           sys.executable, "-c", SHOW], capture_output=True, text=True, timeout=120,
                          env=child_env(None, {"CUDA_VISIBLE_DEVICES": None, "STRATKIT_FAKE_GPU_COUNT": "2"}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = {task: json.loads(body) for task, body in re.findall(r"^\[(\w+:\d+)\] ENV (.*)$", proc.stdout, re.M)}
    assert set(seen) == {"worker:0", "worker:1"}
    address = re.search(r"worker:0 started: pid \d+ at (127\.0\.0\.1:\d+)", proc.stderr)[1]
    for index, env in enumerate(seen[f"worker:{i}"] for i in range(2)):
        assert env["TF_CONFIG"] is None and env["CUDA_VISIBLE_DEVICES"] == str(index)  # never two on one GPU
        assert env["STRATKIT_TUNE_ADDRESS"] == address and env["STRATKIT_TUNE_TUNER"] == str(index)
        assert env["STRATKIT_TUNE_TUNERS"] == "2" and env["STRATKIT_TUNE_SERVE"] == str(int(index == 0))
    assert seen["worker:0"]["STRATKIT_TUNE_TOKEN"] == seen["worker:1"]["STRATKIT_TUNE_TOKEN"]
    assert len(seen["worker:0"]["STRATKIT_TUNE_TOKEN"]) == 32
    assert "a tune run starts no TensorFlow server" in proc.stderr


@pytest.mark.parametrize("args, expected", [
    (["--workers", "2", "--chief"], r"--chief does not go with --tune.*Fix: drop --chief"),
    (["--workers", "2", "--ps", "1"], r"--ps does not go with --tune"),
    (["--workers", "2", "--share-gpus"], r"--share-gpus does not go with --tune: two trials on one GPU.*Fix: drop"),
    (["--hosts", "h1,h2", "--print-tf-config"], r"--tune runs one search's tuners on this machine.*Fix"),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1"], r"--tune True does not go with --nnodes.*Fix: run"),
])
def test_a_tune_run_refuses_layouts_it_cannot_run(args, expected, capsys, monkeypatch):
    monkeypatch.setenv("STRATKIT_RDZV_TOKEN", "x" * 32)
    assert main(["launch", "--tune", *args, "--", sys.executable, "x.py"]) == 2
    assert re.search(expected, capsys.readouterr().err, re.S)


def test_more_tuners_than_gpus_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("STRATKIT_FAKE_GPU_COUNT", "2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert main(["launch", "--tune", "--workers", "3", "--", sys.executable, "x.py"]) == 2
    assert re.search(r"--workers 3 tuners but this host shows 2 GPU\(s\): a trial trains on its tuner's own GPU, "
                     r"never two on one\. Fix: --workers gpu", capsys.readouterr().err)
