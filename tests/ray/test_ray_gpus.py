"""`RayRunner`'s GPUs on a real local Ray with two logical GPUs: Ray's assignment reaches each task.

Its own Ray session (`ray_helpers.local_ray(num_gpus=2)`): the node's
CUDA_VISIBLE_DEVICES is "0,1", which would make a TensorFlow process in it plan
for GPUs, so nothing here starts TensorFlow. The counts the actors report go
through the shared rule (`cluster.gpus.check_counts`, tests/ray/test_ray_rules.py
for the refusals) before any training process starts.
"""

from __future__ import annotations

import os
import sys

import pytest

from ray_helpers import local_ray, needs_ray
from stratkit.errors import ConfigError
from stratkit.ray.runner import RayRunner

pytestmark = [pytest.mark.slow, pytest.mark.ray, needs_ray]


@pytest.fixture(scope="module")
def ray_session():
    import cloudpickle

    with local_ray(num_cpus=3, num_gpus=2) as ray:
        import ray.cloudpickle

        for pickler in (cloudpickle, ray.cloudpickle):
            pickler.register_pickle_by_value(sys.modules[__name__])
        yield ray
        for pickler in (cloudpickle, ray.cloudpickle):
            pickler.unregister_pickle_by_value(sys.modules[__name__])


def visible_gpus():
    devices = os.environ["CUDA_VISIBLE_DEVICES"]
    print("VISIBLE", repr(devices), flush=True)
    return devices


def test_each_training_task_gets_the_gpus_ray_assigned_its_actor_and_ps_tasks_none(ray_session, capsys):
    runner = RayRunner(num_workers=1, num_ps=1, use_gpu=True, gpus_per_worker=1, timeout=120)
    result = runner.run(visible_gpus)
    lines = capsys.readouterr().out.splitlines()
    seen = {line.split(" ", 1)[0]: line.split()[-1] for line in lines if " VISIBLE " in line}
    # The ps actor asked for no GPU and sees the node's "0,1"; its training process gets none.
    assert seen["[ps:0]"] == "''", lines
    assert {seen["[chief:0]"], seen["[worker:0]"]} == {"'0'", "'1'"}, lines  # one GPU each, different ones
    assert repr(result) == seen["[chief:0]"]  # the chief's value comes back


def test_more_gpus_than_the_cluster_has_is_a_config_error_before_any_actor(ray_session):
    with pytest.raises(ConfigError) as caught:
        RayRunner(num_workers=2, use_gpu=True, gpus_per_worker=2).run(visible_gpus)
    text = str(caught.value)
    assert "needs 4 GPU(s)" in text and "the Ray cluster has 2" in text and "Fix:" in text
