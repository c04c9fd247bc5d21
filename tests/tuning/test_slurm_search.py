"""A search as an srun step, on one host without slurmd: each task's part from Slurm's variables alone.

`srun --ntasks 2 python search.py` gives each task SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_STEP_NODELIST,
SLURM_STEP_TASKS_PER_NODE and SLURM_LOCALID, and passes the user's STRATKIT_TUNE_TOKEN on; the two processes
here get exactly those (what `stratkit.tuning.slurm` reads: the same code path as under srun), nothing of
stratkit's own. Task 0 hosts the search on loopback (one node) at STRATKIT_SLURM_PORT, task 1 joins it, and
the seeded RandomSearch (4 trials) equals the one-process search's first 4 trials. Slurm's own daemons are
not installed on the test machine (tests/test_slurm_hosts.py skips there): docs/tuning.md says what this
leaves untested.
"""

from __future__ import annotations

import json

import engine_searches
import pytest
from procs import REPO_ROOT, describe, free_ports, run_cluster

from stratkit.errors import ConfigError
from stratkit.tuning import environment, slurm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800), pytest.mark.multiworker]


def step_env(rank: int, tasks: int, port: int, token: str | None, nodes: str | None = None) -> dict:
    env = {"SLURM_PROCID": str(rank), "SLURM_STEP_NUM_TASKS": str(tasks),
           "SLURM_STEP_NODELIST": nodes or "node1", "SLURM_STEP_TASKS_PER_NODE": str(tasks),
           "SLURM_LOCALID": str(rank), "SLURM_JOB_ID": "4242", "STRATKIT_SLURM_PORT": str(port)}
    if token is not None:
        env["STRATKIT_TUNE_TOKEN"] = token
    return env


@pytest.mark.tune_acceptance  # the real srun on test hosts: tests/test_slurm_tune_hosts.py (make test-hosts)
def test_an_srun_step_of_two_tasks_is_one_search_hosted_by_task_0_equal_to_one_process(tmp_path_factory, tmp_path):
    reference = engine_searches.shared_reference(tmp_path_factory)
    [port] = free_ports(1)
    token = environment.new_token()
    results = run_cluster(REPO_ROOT / "tests" / "engine_searches.py", [None, None], timeout=1500,
                          args=[str(tmp_path), "random", "--trials", "4"], cwd=tmp_path,
                          per_process_env=[step_env(rank, 2, port, token) for rank in range(2)])
    assert all(r.returncode == 0 for r in results), describe(results)
    out = [json.loads(r.stdout.split("RESULT ", 1)[1])["random"] for r in results]
    assert [o["tuner"] for o in out] == [0, 1]
    for tuner in out:  # every tuner ends with the search's results: the one-process search's first 4 trials
        assert engine_searches.compare(tuner, reference["random"], partial=True) == []
    epochs = "".join(r.stdout for r in results)
    assert " TUNER 0 " in epochs and " TUNER 1 " in epochs  # both ran trials


def test_a_step_task_without_the_token_is_told_how_to_make_one():
    with pytest.raises(ConfigError, match="STRATKIT_TUNE_TOKEN") as caught:
        slurm.from_slurm(step_env(1, 2, 8888, None))
    assert slurm.MAKE_TOKEN in str(caught.value)


def test_task_0_hosts_on_loopback_for_one_node_and_on_the_first_host_of_several():
    token = "t" * 32
    one = slurm.from_slurm(step_env(0, 2, 9000, token))
    assert (one.address, one.serve, one.tuner, one.tuners, one.engine) == (("127.0.0.1", 9000), True, 0, 2, "srun")
    env = {**step_env(3, 4, 9000, token, nodes="n[1-2]"), "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_LOCALID": "1"}
    several = slurm.from_slurm(env)
    assert (several.address, several.serve, several.tuner) == (("n1", 9000), False, 3)
    assert slurm.from_slurm({**env, "STRATKIT_TUNE_HOST": "198.18.0.7"}).address == ("198.18.0.7", 9000)
    assert slurm.from_slurm({"SLURM_PROCID": "0"}) is None  # a batch script itself: one process
