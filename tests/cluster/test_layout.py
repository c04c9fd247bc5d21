"""`stratkit.cluster.layout`: one task planner, one TF_CONFIG writer, one check, for both front doors.

Pure Python: `stratkit launch` and the Spark runner plan through the same
functions, so the same layout gives the same tasks and the same refusals.
"""

from __future__ import annotations

import json

import pytest

from stratkit.cluster import layout
from stratkit.errors import ConfigError
from stratkit.launch import plan as launch_plan
from stratkit.spark import layout as spark_layout


@pytest.mark.parametrize(("num_workers", "num_ps"), [(1, 0), (3, 0), (2, 1), (3, 2)])
def test_both_front_doors_plan_the_same_tasks_for_the_same_layout(num_workers, num_ps):
    spark_tasks = [role.task for role in spark_layout.plan_roles(num_workers, num_ps)]
    launch_tasks = launch_plan.plan_tasks(num_workers, chief=num_ps > 0, ps=num_ps)
    assert [t.name for t in spark_tasks] == [t.name for t in launch_tasks]
    # Spark's rank is the position in TF_CONFIG order, and rank 0 is the chief both ways.
    assert layout.primary_task(spark_tasks).name == layout.primary_task(launch_tasks).name == spark_tasks[0].name


def test_tasks_come_in_tf_config_order_and_the_evaluator_holds_no_port():
    tasks = layout.plan_tasks(2, chief=True, ps=1, evaluator=True)
    assert [t.name for t in tasks] == ["chief:0", "worker:0", "worker:1", "ps:0", "evaluator:0"]
    assert [t.serves for t in tasks] == [True, True, True, True, False]
    cluster = layout.build_cluster(tasks, ["a:1", "b:1", "c:1", "d:1"])
    assert cluster == {"chief": ["a:1"], "worker": ["b:1", "c:1"], "ps": ["d:1"]}
    assert layout.primary_task(layout.plan_tasks(2)).name == "worker:0"  # TensorFlow's rule without a chief


@pytest.mark.parametrize(("kwargs", "flags", "arguments"), [
    ({"workers": 0}, "--workers 0 without --chief", "num_workers=0 without a chief"),
    ({"workers": 2, "ps": 1}, "--ps 1 needs a coordinator", "num_ps=1 needs a coordinator"),
    ({"workers": 0, "chief": True, "ps": 1}, "--ps 1 with --workers 0", "num_ps=1 with num_workers=0"),
])
def test_a_layout_that_cannot_train_is_refused_in_each_front_doors_spelling(kwargs, flags, arguments):
    with pytest.raises(ConfigError, match=flags) as info:
        layout.plan_tasks(**kwargs, spelling=launch_plan.FLAGS)
    assert "Fix: " in str(info.value)
    with pytest.raises(ConfigError, match=arguments):
        layout.plan_tasks(**kwargs, spelling=spark_layout.ARGUMENTS)


def test_the_check_returns_what_the_task_will_detect_from_its_tf_config():
    tasks = layout.plan_tasks(2, chief=True, ps=1)
    cluster = layout.build_cluster(tasks, ["h:1", "h:2", "h:3", "h:4"])
    spec = layout.check_task(cluster, tasks[2], launcher="spark", fix="x", chief=tasks[0])
    assert (spec.task_type, spec.task_index, spec.strategy, spec.source, spec.is_chief) == (
        "worker", 1, "parameter_server", "spark", False)
    assert json.loads(spec.to_tf_config()) == {"cluster": cluster, "task": {"type": "worker", "index": 1}}


def test_a_task_that_would_not_see_its_place_fails_with_the_front_doors_fix():
    tasks = layout.plan_tasks(2)
    cluster = layout.build_cluster(tasks, ["h:1", "h:2"])
    # detection switched off in the task's environment: it would train alone, not as worker:1
    with pytest.raises(ConfigError, match=r"read task None:None .*written for worker:1\. Fix: the door's fix"):
        layout.check_task(cluster, tasks[1], launcher="launch", fix="the door's fix",
                          environ={"STRATKIT_CLUSTER_ENV": "none"})


def test_only_a_front_door_that_allows_it_lets_the_users_strategy_win():
    one_worker = layout.plan_tasks(1)
    cluster = layout.build_cluster(one_worker, ["h:1"])
    preset = {"STRATKIT_STRATEGY": "mirrored"}
    # stratkit launch: an explicit choice wins (a single worker may run MirroredStrategy)
    assert layout.check_task(cluster, one_worker[0], launcher="launch", fix="x", environ=preset).strategy == "mirrored"
    # the Spark runner decides the strategy itself
    with pytest.raises(ConfigError, match=r"\(multi_worker_mirrored\)\. Fix: do not set STRATKIT_STRATEGY"):
        spark_layout.validate(spark_layout.plan_roles(1), ["h:1"], 0, preset)
    with pytest.raises(ConfigError, match="STRATKIT_STRATEGY"):
        layout.check_plan(one_worker, launcher="spark", fix="x", environ=preset, allow_preset=False)


def test_check_plan_validates_every_task_with_placeholder_ports_on_the_host():
    tasks = layout.plan_tasks(1, chief=True, ps=1, evaluator=True)
    layout.check_plan(tasks, launcher="launch", fix="x", host="::1")  # IPv6 placeholders are bracketed
    with pytest.raises(ConfigError, match="contradicts the cluster"):
        layout.check_plan(tasks, launcher="launch", fix="x", environ={"STRATKIT_STRATEGY": "mirrored"})


def test_a_launch_inside_a_sagemaker_job_is_still_checked_by_its_tf_config_not_by_the_source_label():
    tasks = layout.plan_tasks(2)
    cluster = layout.build_cluster(tasks, ["h:1", "h:2"])
    spec = layout.check_task(cluster, tasks[1], launcher="launch", fix="x", environ={"SM_CURRENT_HOST": "algo-1"})
    assert (spec.task_type, spec.task_index, spec.source) == ("worker", 1, "sagemaker")
