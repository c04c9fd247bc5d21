"""Which GPUs each process on a host gets (`stratkit.cluster.gpus`): the rule the launcher, Slurm and Spark share.

Pure Python, no TensorFlow: GPU inventories are given as lists of ids, or
through the documented test stand-in STRATKIT_FAKE_GPU_COUNT.
"""

from __future__ import annotations

import pytest

from stratkit.cluster import gpus
from stratkit.cluster.devices import count_gpus
from stratkit.errors import ConfigError

EIGHT = [str(i) for i in range(8)]


def _visible(assignments: list[gpus.Assignment]) -> list[str | None]:
    return [a.visible for a in assignments]


@pytest.mark.parametrize("workers, expected", [
    (1, ["0,1,2,3,4,5,6,7"]),
    (2, ["0,1,2,3", "4,5,6,7"]),
    (4, ["0,1", "2,3", "4,5", "6,7"]),
    (8, EIGHT),
])
def test_n_workers_split_eight_gpus_evenly_in_order(workers, expected):
    assignments = gpus.assign(EIGHT, ["worker"] * workers)
    assert _visible(assignments) == expected
    assert not any(a.shared for a in assignments)
    assert all(gpus.GROWTH_VAR not in a.env() for a in assignments)


def test_a_preset_cuda_visible_devices_is_what_the_processes_are_given():
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    visible = gpus.visible_gpus(env)
    assert visible == ["4", "5", "6", "7"]
    assert _visible(gpus.assign(visible, ["worker"] * 2)) == ["4,5", "6,7"]
    assert gpus.translate([1, 3], "4,5,6,7", what="index", fix="x") == ["5", "7"]
    assert gpus.translate([1, 3], None, what="index", fix="x") == ["1", "3"]


def test_cuda_stops_at_the_first_invalid_id_and_so_does_the_count():
    assert gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": "2,-1,3"}) == ["2"]
    assert gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


def test_the_stand_in_inventory_counts_only_without_cuda_visible_devices():
    assert count_gpus({"STRATKIT_FAKE_GPU_COUNT": "8"}) == 8
    assert gpus.visible_gpus({"STRATKIT_FAKE_GPU_COUNT": "3"}) == ["0", "1", "2"]
    assert count_gpus({"STRATKIT_FAKE_GPU_COUNT": "8", "CUDA_VISIBLE_DEVICES": "1,2"}) == 2
    with pytest.raises(ConfigError, match="STRATKIT_FAKE_GPU_COUNT='lots'.*Fix"):
        count_gpus({"STRATKIT_FAKE_GPU_COUNT": "lots"})


def test_without_gpus_and_without_a_request_no_environment_changes():
    assignments = gpus.assign([], ["chief", "worker", "worker", "ps"])
    assert _visible(assignments) == [None] * 4
    assert all(a.env() == {} for a in assignments)


def test_zero_gpus_per_worker_hides_every_gpu_with_or_without_gpus():
    assert _visible(gpus.assign(EIGHT, ["worker"] * 3, per_task=0)) == ["", "", ""]
    assert _visible(gpus.assign([], ["worker"] * 3, per_task=0)) == ["", "", ""]


def test_the_ps_layout_gives_chief_and_workers_gpus_and_ps_none_unless_asked():
    roles = ["chief", "worker", "worker", "worker", "ps", "ps"]
    assert _visible(gpus.assign(EIGHT[:4], roles)) == ["0", "1", "2", "3", "", ""]
    assert _visible(gpus.assign(EIGHT, roles, per_task=1, per_ps=2)) == ["0", "1", "2", "3", "4,5", "6,7"]


def test_an_explicit_count_takes_the_first_gpus_and_leaves_the_rest_idle():
    assert _visible(gpus.assign(EIGHT, ["worker"] * 3, per_task=2)) == ["0,1", "2,3", "4,5"]


def test_sharing_is_round_robin_and_only_the_sharing_processes_grow_their_memory():
    assignments = gpus.assign(["0", "1"], ["worker"] * 3, share=True)
    assert _visible(assignments) == ["0", "1", "0"]
    assert [a.shared for a in assignments] == [True, False, True]
    assert assignments[0].env() == {"CUDA_VISIBLE_DEVICES": "0", gpus.GROWTH_VAR: "true"}
    assert assignments[1].env() == {"CUDA_VISIBLE_DEVICES": "1"}


@pytest.mark.parametrize("visible, roles, options, words", [
    (EIGHT, ["worker"] * 3, {}, ["--workers 3", "8 GPUs", "--workers 1/2/4/8", "--share-gpus"]),
    (EIGHT[:2], ["worker"] * 4, {}, ["--workers 4", "2 GPUs", "--share-gpus"]),
    (EIGHT, ["chief", "worker", "worker"], {}, ["--workers 2 (with the chief/evaluator: 3 training processes)",
                                                "--workers 1/3/7 (1 more for the chief/evaluator)"]),
    (EIGHT, ["worker"] * 3, {"per_task": 3}, ["--gpus-per-worker 3", "3 x 3 = 9 GPUs", "has 8"]),
    (EIGHT[:4], ["chief", "worker", "ps"], {"per_task": 1, "per_ps": 3},
     ["--gpus-per-ps 3", "2 x 1 + 1 x 3 = 5 GPUs", "has 4"]),
    ([], ["worker"] * 2, {"per_task": 1}, ["--gpus-per-worker", "0 visible GPUs"]),
    (EIGHT, ["worker"], {"per_task": -1}, ["--gpus-per-worker must be a whole number >= 0", "-1"]),
])
def test_every_refusal_names_the_numbers_and_the_fix(visible, roles, options, words):
    with pytest.raises(ConfigError) as info:
        gpus.assign(visible, roles, **options)
    message = str(info.value)
    for word in words:
        assert word in message, message
    assert "Fix:" in message


def test_the_start_up_text_says_which_process_has_which_gpus():
    assignments = gpus.assign(["4", "5", "6", "7"], ["worker", "worker", "ps"])
    assert [a.describe() for a in assignments] == ["GPUs 4,5", "GPUs 6,7", "no GPU"]
    assert gpus.assign(["0", "1"], ["worker"] * 3, share=True)[2].describe() == "GPU 0 (shared)"
    assert gpus.assign([], ["worker"])[0].describe() == "GPUs as the environment sets them"


# -- Slurm: tasks that see every GPU of their node ---------------------------------------------------------------

def _slurm_step(local_id: int, **extra: str) -> dict[str, str]:
    """Task SLURM_LOCALID=`local_id` of node 1 in `srun -N2 --ntasks-per-node=4` (no --gpus-per-task)."""
    return {"SLURM_PROCID": str(4 + local_id), "SLURM_LOCALID": str(local_id), "SLURM_NODEID": "1",
            "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
            "STRATKIT_FAKE_GPU_COUNT": "8", **extra}


def test_a_slurm_task_gets_its_share_of_the_node_by_slurm_localid():
    import stratkit
    from stratkit.cluster import slurm

    assert [slurm.gpu_share(_slurm_step(i)) for i in range(4)] == ["0,1", "2,3", "4,5", "6,7"]
    spec = stratkit.detect(_slurm_step(2))
    assert (spec.source, spec.task_index, spec.num_gpus) == ("slurm", 6, 2)
    # Slurm's step GPUs in CUDA_VISIBLE_DEVICES are split in their own terms
    assert slurm.gpu_share(_slurm_step(3, CUDA_VISIBLE_DEVICES="4,5,6,7")) == "7"


def test_slurm_own_gpu_binding_stands_and_one_task_per_node_keeps_all():
    import stratkit
    from stratkit.cluster import slurm

    bound = _slurm_step(1, SLURM_GPUS_PER_TASK="1", CUDA_VISIBLE_DEVICES="1")
    assert slurm.gpu_share(bound) is None and stratkit.detect(bound).num_gpus == 1
    one_per_node = {**_slurm_step(0), "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "2",
                    "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    assert slurm.gpu_share(one_per_node) is None and stratkit.detect(one_per_node).num_gpus == 8
    assert slurm.gpu_share(_slurm_step(0, STRATKIT_FAKE_GPU_COUNT="0")) is None  # a CPU node: nothing set
    pinned = _slurm_step(1, CUDA_VISIBLE_DEVICES="2,3", STRATKIT_PINNED_GPUS="2,3")
    assert slurm.gpu_share(pinned) is None and stratkit.detect(pinned).num_gpus == 2  # not split twice


def test_a_slurm_node_whose_gpus_its_tasks_cannot_split_is_refused():
    import stratkit

    with pytest.raises(ConfigError) as info:
        stratkit.detect(_slurm_step(0, STRATKIT_FAKE_GPU_COUNT="6"))
    message = str(info.value)
    for word in ("srun --ntasks-per-node 4", "6 GPUs", "this Slurm node", "srun --gpus-per-task", "Fix:"):
        assert word in message, message
    assert "--share-gpus" not in message
