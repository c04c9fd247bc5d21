"""A trial bigger than one worker: `stratkit launch --tune --workers 4 --workers-per-trial 2`.

Two groups of two MultiWorkerMirrored workers, each group one tuner (its chief the only one that talks to the
search service; worker 0's group also hosts it), each trial trained by its whole group with the trial's batch
as the global batch. The seeded RandomSearch (4 trials: the one-process search's first 4) tries the same
trials and gets the same scores as one process (within 1e-5), and every worker of a group ends with the
search's results.
"""

from __future__ import annotations

import json
import subprocess
import sys

import engine_searches
import pytest
from procs import REPO_ROOT, child_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800), pytest.mark.multiworker, pytest.mark.tune_acceptance]


def test_two_groups_of_two_workers_search_as_one_process(tmp_path_factory, tmp_path):
    reference = engine_searches.shared_reference(tmp_path_factory)
    argv = [sys.executable, "-m", "stratkit.cli", "launch", "--tune", "--workers", "4", "--workers-per-trial", "2",
            "--", sys.executable, str(REPO_ROOT / "tests" / "engine_searches.py"), str(tmp_path), "random",
            "--trials", "4"]
    done = subprocess.run(argv, env=child_env(), cwd=tmp_path, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-4000:]
    results = {}
    for line in done.stdout.splitlines():  # "[worker:2] RESULT {...}"
        if "] RESULT " in line:
            task, _, text = line.partition("] RESULT ")
            results[task.strip("[")] = json.loads(text)["random"]
    assert sorted(results) == [f"worker:{i}" for i in range(4)], done.stdout[-4000:]
    assert [results[f"worker:{i}"]["tuner"] for i in range(4)] == [0, 0, 1, 1]  # a tuner per group
    for task, result in results.items():
        assert engine_searches.compare(result, reference["random"], partial=True) == [], task  # its trials 0-3
    epochs: dict[tuple[str, str], set[str]] = {}  # (trial, epoch) -> the workers that trained it
    for line in done.stdout.splitlines():
        if " EPOCH " in line and " TUNER " in line:
            task, _, text = line.partition("] TRIAL ")
            trial, _, rest = text.partition(" RUN ")
            epochs.setdefault((trial, rest.split(" EPOCH ")[1].split()[0]), set()).add(task.strip("["))
    groups = [{"worker:0", "worker:1"}, {"worker:2", "worker:3"}]
    assert epochs and all(workers in groups for workers in epochs.values()), epochs  # each epoch: one whole group
    assert {frozenset(w) for w in epochs.values()} == {frozenset(g) for g in groups}  # both groups trained
