"""`stratkit launch` on a GPU host: every task's own CUDA_VISIBLE_DEVICES, refusals before anything starts.

There is no GPU here: the documented stand-in STRATKIT_FAKE_GPU_COUNT=8 tells
the launcher (and only `count_gpus`) that the host has 8, and each task, a
real process, prints what it was given. The refusals run `stratkit launch`
in-process (`refused_launch`: exit 2, the words and the fix).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from procs import child_env

SHOW = ("import json, os; print('ENV', json.dumps({k: os.environ.get(k) for k in "
        "('CUDA_VISIBLE_DEVICES', 'TF_FORCE_GPU_ALLOW_GROWTH')}))")


def _tasks_env(*args: str, env: dict[str, str | None]) -> tuple[dict[str, dict], str]:
    """task name -> the GPU variables it saw; and the launcher's stderr."""
    proc = subprocess.run([sys.executable, "-m", "stratkit.cli", "launch", "--no-private-network", *args, "--",
                           sys.executable, "-c", SHOW], env=child_env(None, env), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = {task: json.loads(body) for task, body in re.findall(r"^\[(\w+:\d+)\] ENV (.*)$", proc.stdout, re.M)}
    return seen, proc.stderr


EIGHT = {"CUDA_VISIBLE_DEVICES": None, "STRATKIT_FAKE_GPU_COUNT": "8"}


@pytest.mark.slow
@pytest.mark.parametrize("workers, expected", [
    ("1", ["0,1,2,3,4,5,6,7"]),
    ("2", ["0,1,2,3", "4,5,6,7"]),
    ("4", ["0,1", "2,3", "4,5", "6,7"]),
    ("8", [str(i) for i in range(8)]),
    ("gpu", [str(i) for i in range(8)]),
])
def test_each_worker_gets_its_own_share_of_eight_gpus(workers, expected):
    seen, stderr = _tasks_env("--workers", workers, env=EIGHT)
    assert {t: e["CUDA_VISIBLE_DEVICES"] for t, e in seen.items()} == \
        {f"worker:{i}": ids for i, ids in enumerate(expected)}
    assert all(e["TF_FORCE_GPU_ALLOW_GROWTH"] is None for e in seen.values())  # one process per GPU: TF's default
    for i, ids in enumerate(expected):  # the start-up line says it
        plural = "s" if "," in ids else ""
        assert re.search(rf"worker:{i} started: pid \d+ at [\d.:]+, GPU{plural} {ids}\n", stderr), stderr


@pytest.mark.slow
def test_a_preset_cuda_visible_devices_is_split_in_its_own_terms_and_ps_gets_none():
    seen, _ = _tasks_env("--chief", "--workers", "1", "--ps", "2", env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert {t: e["CUDA_VISIBLE_DEVICES"] for t, e in seen.items()} == \
        {"chief:0": "4,5", "worker:0": "6,7", "ps:0": "", "ps:1": ""}


@pytest.mark.slow
def test_gpus_per_worker_zero_hides_the_gpus_and_sharing_sets_memory_growth():
    seen, _ = _tasks_env("--workers", "2", "--gpus-per-worker", "0", env=EIGHT)
    assert {t: e["CUDA_VISIBLE_DEVICES"] for t, e in seen.items()} == {"worker:0": "", "worker:1": ""}
    seen, stderr = _tasks_env("--workers", "3", env={**EIGHT, "STRATKIT_FAKE_GPU_COUNT": "2",
                                                      "STRATKIT_SHARE_GPUS": "1"})
    assert seen == {"worker:0": {"CUDA_VISIBLE_DEVICES": "0", "TF_FORCE_GPU_ALLOW_GROWTH": "true"},
                    "worker:1": {"CUDA_VISIBLE_DEVICES": "1", "TF_FORCE_GPU_ALLOW_GROWTH": None},
                    "worker:2": {"CUDA_VISIBLE_DEVICES": "0", "TF_FORCE_GPU_ALLOW_GROWTH": "true"}}
    assert "worker:2 started" in stderr and "GPU 0 (shared)" in stderr


@pytest.mark.slow
def test_without_gpus_the_tasks_environment_is_left_as_it_was():
    seen, stderr = _tasks_env("--workers", "2", env={"CUDA_VISIBLE_DEVICES": None, "STRATKIT_FAKE_GPU_COUNT": "0"})
    assert seen == {f"worker:{i}": {"CUDA_VISIBLE_DEVICES": None, "TF_FORCE_GPU_ALLOW_GROWTH": None}
                    for i in range(2)}
    assert "GPU" not in stderr


@pytest.mark.parametrize("argv, env, words", [
    (["--workers", "3"], {"STRATKIT_FAKE_GPU_COUNT": "8"}, ["--workers 3", "8 GPUs", "--workers 1/2/4/8"]),
    (["--workers", "2", "--gpus-per-worker", "5"], {"STRATKIT_FAKE_GPU_COUNT": "8"},
     ["--gpus-per-worker 5", "2 x 5 = 10 GPUs", "has 8"]),
    (["--workers", "gpu"], {"STRATKIT_FAKE_GPU_COUNT": "0"}, ["--workers gpu", "has 0"]),
    (["--workers", "1", "--gpus-per-worker", "1"], {"STRATKIT_FAKE_GPU_COUNT": "0"},
     ["--gpus-per-worker", "0 visible GPUs"]),
    (["--chief", "--workers", "1", "--ps", "1", "--gpus-per-ps", "4"], {"CUDA_VISIBLE_DEVICES": "4,5,6,7"},
     ["--gpus-per-ps 4", "2 x 2 + 1 x 4 = 8 GPUs", "has 4"]),
    (["--workers", "2"], {"STRATKIT_FAKE_GPU_COUNT": "8", "STRATKIT_GPUS_PER_WORKER": "6"},
     ["--gpus-per-worker 6", "has 8"]),
])
def test_every_refusal_comes_before_anything_starts(refused_launch, monkeypatch, argv, env, words):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    refused_launch(argv, words)



def test_every_node_of_nnodes_checks_its_own_split_before_it_joins(refused_launch, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("STRATKIT_FAKE_GPU_COUNT", "8")
    monkeypatch.setenv("STRATKIT_RDZV_TOKEN", "0123456789abcdef0123")
    refused_launch(["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "--workers-per-node", "3"],
                   ["--workers-per-node 3", "8 GPUs of this node", "--workers-per-node 1/2/4/8"])
    monkeypatch.setenv("STRATKIT_FAKE_GPU_COUNT", "0")
    refused_launch(["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "--workers-per-node", "gpu"],
                   ["--workers-per-node gpu", "has 0"])


def test_the_gpu_flags_come_from_their_variables_too():
    import argparse

    from stratkit.launch.cli import resolve_options

    options = resolve_options(argparse.Namespace(), {"STRATKIT_WORKERS": "GPU", "STRATKIT_GPUS_PER_WORKER": "2",
                                                     "STRATKIT_GPUS_PER_PS": "1", "STRATKIT_SHARE_GPUS": "yes",
                                                     "STRATKIT_WORKERS_PER_NODE": "gpu"})
    assert (options["workers"], options["gpus_per_worker"], options["gpus_per_ps"], options["share_gpus"],
            options["workers_per_node"]) == ("gpu", 2, 1, True, "gpu")
    flags = resolve_options(argparse.Namespace(workers=3, gpus_per_worker=0), {"STRATKIT_WORKERS": "gpu",
                                                                              "STRATKIT_GPUS_PER_WORKER": "2"})
    assert (flags["workers"], flags["gpus_per_worker"]) == (3, 0)  # the flag wins
