"""A search as an srun step under a real Slurm: slurmctld and two slurmd on test hosts h1 and h2.

`srun -N2 --ntasks-per-node=1 --kill-on-bad-exit=0 python engine_searches.py ...` with the user's
STRATKIT_TUNE_TOKEN exported, as docs/tuning.md says: task 0 (on h1) hosts the search at h1's address in the
step (port STRATKIT_SLURM_PORT), task 1 (on h2) dials it. Task 1 SIGKILLs itself in its first trial's second
epoch: its lease expires, task 0 runs the trial again from its backup (the store is a directory both hosts
see), and ends the seeded RandomSearch with the one-process search's trials and scores (its first 4).
"""

from __future__ import annotations

import json
import sys

import engine_searches
import pytest

import hosts
import slurm_cluster
from procs import REPO_ROOT, child_env

from stratkit.tuning import environment

pytestmark = [pytest.mark.slow, pytest.mark.tune_acceptance, pytest.mark.timeout(1800), pytest.mark.hosts]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    hosts.gate()
    hosts.gate(slurm_cluster.unavailable_reason())
    with hosts.make_hosts(2) as made, slurm_cluster.slurm_cluster(made, tmp_path_factory.mktemp("slurm")) as cluster:
        cluster.check()
        yield cluster


def test_an_srun_step_on_two_hosts_searches_as_one_process_through_a_lost_task(slurm, tmp_path_factory, tmp_path):
    reference = engine_searches.shared_reference(tmp_path_factory)
    marker = tmp_path / "killed-1"
    env = {k: v for k, v in child_env(env={"STRATKIT_TUNE_TOKEN": environment.new_token(),
                                           "STRATKIT_TUNE_LEASE_SECONDS": "8",
                                           "SEARCH_KILL_1": f"1:1:{marker}"}).items() if v is not None}
    step = slurm.run(["srun", "-N2", "--ntasks-per-node=1", "--kill-on-bad-exit=0", sys.executable,
                      str(REPO_ROOT / "tests" / "engine_searches.py"), str(tmp_path), "random", "--trials", "4"],
                     timeout=1500, env=env)
    assert marker.exists(), step.stdout[-6000:] + slurm.logs()
    results = [json.loads(line.split(" ", 1)[1]) for line in step.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == 1 and results[0]["random"]["tuner"] == 0, step.stdout[-6000:]  # task 1 was lost
    assert engine_searches.compare(results[0]["random"], reference["random"], partial=True) == [], step.stdout
    lost_trial = marker.read_text().split()[0]
    rerun = [line for line in step.stdout.splitlines() if line.startswith(f"TRIAL {lost_trial} RUN 2 ")]
    assert rerun and all(line.endswith("HOST h1") for line in rerun), step.stdout[-6000:]  # on task 0's host
