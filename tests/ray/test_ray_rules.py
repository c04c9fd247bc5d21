"""`RayRunner`'s refusals that need no Ray cluster: bad arguments, Ray missing, too old or untested (fast, no Ray started)."""

from __future__ import annotations

import sys
import types

import pytest

from stratkit.errors import ConfigError
from stratkit.process import arguments
from stratkit.ray import elastic, versions
from stratkit.ray.runner import RayRunner, _plan, task_devices


def _train():
    return 1


@pytest.mark.parametrize("kwargs, names", [
    ({"num_workers": 0}, "num_workers must be an integer >= 1: got 0"),
    ({"num_workers": 2, "num_ps": -1}, "num_ps"),
    ({"num_workers": 2, "gpus_per_worker": 1}, "gpus_per_worker=1 needs use_gpu=True"),
    ({"num_workers": 2, "use_gpu": "yes"}, "use_gpu"),
    ({"num_workers": 2, "timeout": 0}, "timeout"),
    ({"num_workers": 2, "min_workers": 3}, "min_workers"),
    ({"num_workers": 2, "num_ps": 1, "min_workers": 1}, "min_workers=1 with num_ps=1"),
    ({"num_workers": 2, "cpus_per_worker": 0}, "cpus_per_worker"),
    ({"num_workers": 2, "placement_strategy": "ANYWHERE"}, "placement_strategy"),
    ({"num_workers": 2, "max_retries": -1}, "max_retries"),
])
def test_bad_arguments_are_config_errors_naming_the_value_and_fix(kwargs, names):
    with pytest.raises(ConfigError, match="Fix|must be") as caught:
        RayRunner(**kwargs)
    assert names in str(caught.value)


def test_no_ray_installed_is_a_config_error_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` does when Ray is not installed
    with pytest.raises(ConfigError) as caught:
        RayRunner(num_workers=2).run(_train)
    assert 'pip install "stratkit[ray]"' in str(caught.value)
    assert "RayRunner needs Ray" in str(caught.value)


@pytest.mark.parametrize("version", ["2.40.0", "1.13.1", "2.51.2"])
def test_a_ray_older_than_the_floor_is_a_config_error(monkeypatch, version):
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(__version__=version))
    with pytest.raises(ConfigError) as caught:
        RayRunner(num_workers=2).run(_train)
    assert f"Ray {version} is installed" in str(caught.value) and "2.52.0" in str(caught.value)
    assert 'pip install "stratkit[ray]"' in str(caught.value)


def _newer_than_tested() -> str:
    major, minor, _ = versions.parse(max(versions.TESTED_RAY_VERSIONS, key=versions.parse))
    return f"{major}.{minor + 1}.0"


def test_a_ray_newer_than_tested_is_a_config_error_naming_the_range_and_the_fixes(monkeypatch):
    monkeypatch.delenv("STRATKIT_RAY_UNTESTED", raising=False)
    newer = _newer_than_tested()
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(__version__=newer))
    with pytest.raises(ConfigError) as caught:
        RayRunner(num_workers=2).run(_train)
    message = str(caught.value)
    assert f"Ray {newer} is installed" in message
    assert "Ray >= 2.52.0, <= 2.60.x (tested: 2.52.1, 2.60.0)" in message
    assert 'pip install "stratkit[ray]"' in message and "STRATKIT_RAY_UNTESTED=1" in message


def test_untested_ray_runs_with_one_warning_when_opted_in(monkeypatch, caplog):
    monkeypatch.setenv(versions.ENV_VAR, "1")
    newer = _newer_than_tested()
    with caplog.at_level("WARNING"):
        versions.check_version(newer, "RayRunner")
        versions.check_version(newer, "RayRunner")
    assert sum(newer in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("version", ["2.52.0", "2.52.1", "2.55.3", "2.60.0", "2.60.2"])
def test_releases_from_the_floor_to_the_newest_tested_minor_need_no_opt_in(monkeypatch, version):
    monkeypatch.delenv(versions.ENV_VAR, raising=False)
    versions.check_version(version, "RayRunner")


def test_a_bad_opt_in_value_is_a_config_error(monkeypatch):
    monkeypatch.setenv(versions.ENV_VAR, "yes")
    with pytest.raises(ConfigError, match="STRATKIT_RAY_UNTESTED='yes' is not understood"):
        versions.check_version(_newer_than_tested(), "RayReportCallback")


def test_train_fn_must_be_callable():
    with pytest.raises(ConfigError, match="train_fn must be a function"):
        RayRunner(num_workers=2).run("train.py")


def test_ray_tasks_reporting_different_gpu_counts_are_refused_naming_every_task():
    # What the actors' where() reports: the CUDA_VISIBLE_DEVICES Ray set for each (one per task, rank order).
    workers = _plan(3, 0)
    with pytest.raises(ConfigError) as caught:
        task_devices(workers, ["0", "1,2", "3"], gpus_per_worker=1)
    message = str(caught.value)
    assert "the Ray tasks see different numbers of GPUs (worker:0: 1 GPU(s), worker:1: 2 GPU(s), worker:2: 1 GPU(s))" \
        in message and "workers with different GPU counts" in message and "Fix:" in message
    with pytest.raises(ConfigError, match=r"worker:1: 0 GPU\(s\).*mixing GPU and CPU-only workers"):
        task_devices(_plan(2, 0), ["0", None], gpus_per_worker=1)  # Ray set no CUDA_VISIBLE_DEVICES on worker 1


def test_ray_gpu_assignment_per_task_ps_tasks_get_none_and_no_gpu_hides_them():
    tasks = _plan(2, 1)  # chief, worker:0, worker:1, ps:0
    assert task_devices(tasks, ["0,1", "2,3", "4,5", None], gpus_per_worker=2) == ["0,1", "2,3", "4,5", ""]
    assert task_devices(_plan(2, 0), [None, "0"], gpus_per_worker=0) == ["", ""]  # use_gpu=False: hidden
    with pytest.raises(ConfigError, match="given CUDA_VISIBLE_DEVICES='0,1' by Ray, not 1 GPU"):
        task_devices(_plan(2, 0), ["0,1", "2,3"], gpus_per_worker=1)  # the same count, but not the one asked for


def test_a_retry_counts_the_workers_the_alive_nodes_fit_one_per_node_with_strict_spread():
    # ray.nodes() after a node loss: the lost node listed as not alive (Ray's verdict), the other with 2 CPUs.
    nodes = [{"NodeID": "a", "Alive": True, "Resources": {"CPU": 2.0, "GPU": 1.0}},
             {"NodeID": "b", "Alive": False, "Resources": {"CPU": 2.0, "GPU": 1.0}}]
    assert elastic.room_for_workers(nodes, 1, 0, "PACK") == 2
    assert elastic.room_for_workers(nodes, 1, 0, "SPREAD") == 2
    assert elastic.room_for_workers(nodes, 1, 0, "STRICT_SPREAD") == 1  # no two bundles on one node
    assert elastic.room_for_workers(nodes, 2, 0, "PACK") == 1
    assert elastic.room_for_workers(nodes, 1, 1, "PACK") == 1  # one GPU per worker
    assert [arguments.workers_within(room, 2, 1) for room in (0, 1, 2, 3)] == [None, 1, 2, 2]
    assert arguments.workers_within(1, 3, 2) is None


def test_a_task_stopped_while_its_port_waits_for_the_server_releases_the_port_once_with_no_thread_error():
    """The actor's start thread closes the held port once the TF server listens (or the process ends), and
    `stop()` closes it too: when `stop()` came first, the thread raised "'NoneType' object has no attribute
    'close'" (seen in a Ray test's output)."""
    import subprocess
    import threading

    from stratkit.ray.task import TaskActor

    actor = TaskActor("worker:0")
    actor.hold("127.0.0.1")
    actor._proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],   # never listens
                                   start_new_session=True)                               # its group, as start_child
    errors = []
    thread = threading.Thread(target=lambda: _recorded(actor._release_port_when_listening, errors))
    thread.start()
    actor.stop()
    thread.join(30)
    assert not thread.is_alive() and errors == []
    assert actor._holder is None and actor._proc.returncode is not None


def _recorded(call, errors):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - what the thread raised is the test's result
        errors.append(exc)
