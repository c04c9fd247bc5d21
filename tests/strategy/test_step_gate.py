"""A step that meets the end of an input of unknown length changes nothing (issue 49; keras_compat/step_gate.py).

Round 5's script (benchmarks/tasks/unknown_length_task.py): ``filter().batch(64)``, no ``steps_per_epoch``,
``model.fit`` under ``make_strategy()``, Adam. Keras learns where such an input ends from the step whose
``get_next`` fails, once an epoch; the ops of that step with no path from the batch (the optimizer's step
counter, assigned per device) ran or not as the abort caught them: on one device ``iterations`` counted a step
per epoch that never trained, and on Mirrored one device's copy moved and the other's did not, so the replica
check stopped correct jobs at random (``'adam/iteration' ... largest difference 1``). The load the race needs is
here: two CPU-bound processes run beside every test. On the code before the fix (main at b1fe468) every run of
these tests failed the step count (``iterations`` one ahead per epoch, on one device too), and at load 11-15 the
Mirrored run stopped with ``ReplicaDivergenceError`` in N of M runs (see docs/keras3.md); the 2 workers, whose
end of data is agreed by a collective first, counted the extra step alike.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from procs import REPO_ROOT, describe, free_ports, run_cluster, run_process, worker_tf_configs
from stratkit.process.children import kill_group, start_child

pytestmark = [pytest.mark.slow, pytest.mark.multiworker]

TASK = REPO_ROOT / "benchmarks" / "tasks" / "unknown_length_task.py"
#: 400 rows, 282 kept: 5 batches of 64 (the last of 26) an epoch; 4 epochs: 4 steps that meet the end
ARGS = ["--epochs", "4", "--rows", "400"]


@pytest.fixture(scope="module")
def load():
    """Two CPU-bound processes beside the tests of this module (on 2 cores: the load the race needs)."""
    burners = [start_child([sys.executable, "-c", "while True: pass"], {}, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL) for _ in range(2)]
    try:
        yield
    finally:
        for burner in burners:
            kill_group(burner.pid)
            burner.wait()


def _result(stdout: str) -> dict:
    return json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])


@pytest.fixture(scope="module")
def mirrored(load) -> dict:
    """Mirrored over 2 logical CPUs, and before it, in the same process, one device (the reference)."""
    result = run_process(TASK, args=["mirrored", "--reference", *ARGS], timeout=600)
    assert result.ok, describe([result])
    return _result(result.stdout)


def _counts_its_steps(run: dict, where: str) -> None:
    assert run["error"] is None, f"{where}: {run['error']}"
    assert run["steps"] == 20, f"{where}: {run['steps']} steps trained, 20 expected"
    assert run["iterations"] == [run["steps"]] * len(run["iterations"]), (
        f"{where}: the optimizer's step counter {run['iterations']} (one per copy) after {run['steps']} steps")


def _within(run: dict, reference: dict, where: str) -> None:
    gap = max(abs(a - b) for a, b in zip(run["w"], reference["w"]))
    assert gap <= 1e-5, f"{where}: weights {gap:.2g} from one device"
    assert run["loss"] == pytest.approx(reference["loss"], rel=1e-5, abs=1e-6), where


def test_one_device_counts_the_steps_that_trained(mirrored):
    _counts_its_steps(mirrored["reference"], "one device")


def test_on_mirrored_every_copy_counts_the_steps_that_trained_and_the_run_is_one_devices(mirrored):
    _counts_its_steps(mirrored, "Mirrored over 2 logical CPUs")
    _within(mirrored, mirrored["reference"], "Mirrored over 2 logical CPUs")


def test_two_workers_count_the_steps_that_trained_alike_and_equal_one_device(load, mirrored):
    results = run_cluster(TASK, worker_tf_configs(free_ports(2)), args=["mwms", *ARGS], timeout=600,
                          grace_after_failure=30)
    assert all(r.ok for r in results), describe(results)
    chief, worker = (_result(r.stdout) for r in results)
    for index, run in enumerate((chief, worker)):
        _counts_its_steps(run, f"worker {index}")
    assert chief["w"] == worker["w"], "the workers' weights differ"
    _within(chief, mirrored["reference"], "2 workers")
