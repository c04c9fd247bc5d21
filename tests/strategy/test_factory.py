"""make_strategy builds the real strategy for every kind this CPU machine can run.

Each case runs in a fresh process: TensorFlow fixes devices and collectives at
runtime start, so one pytest process cannot host them all.
"""

from __future__ import annotations

import textwrap

import pytest

from procs import cluster_tf_configs, describe, free_ports, run_cluster, run_process, worker_tf_configs

import stratkit
from stratkit.errors import ConfigError

pytestmark = pytest.mark.slow


def _code(body: str) -> str:
    return "import json, stratkit\n" + textwrap.dedent(body)


def test_one_device_is_the_default_on_a_cpu_host():
    result = run_process(_code("""
        s = stratkit.make_strategy()
        import tensorflow as tf
        print(json.dumps({"type": type(s).__name__, "replicas": s.num_replicas_in_sync,
                          "device": s.extended.worker_devices[0]}))
    """))
    assert result.ok, describe([result])
    report = result.last_json()
    assert report["type"] == "OneDeviceStrategy"
    assert report["replicas"] == 1
    assert report["device"].endswith("CPU:0")


def test_mirrored_over_two_logical_cpus_reduces_across_replicas_with_the_reduction_asked_for():
    result = run_process(_code("""
        import os
        s = stratkit.make_strategy(strategy="mirrored", logical_cpus=2)
        import tensorflow as tf
        from stratkit.errors import ConfigError
        ctx_ids = s.run(lambda: tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group + 1, tf.float32))
        total = s.reduce("SUM", ctx_ids, axis=None)
        report = {"type": type(s).__name__, "replicas": s.num_replicas_in_sync, "sum": float(total)}
        # the cross-device reduction by name (GPU hosts' fallbacks), or from STRATKIT_CROSS_DEVICE_OPS
        for name in ("reduce_to_one_device", "hierarchical_copy", "env"):
            if name == "env":
                os.environ["STRATKIT_CROSS_DEVICE_OPS"] = "Reduce-To-One-Device"
            s = stratkit.make_strategy(strategy="mirrored", logical_cpus=2,
                                       **({} if name == "env" else {"cross_device_ops": name}))
            total = s.reduce("SUM", s.run(lambda: tf.constant(1.5)), axis=None)
            report[name] = [type(s.extended._cross_device_ops).__name__, float(total)]
        os.environ["STRATKIT_CROSS_DEVICE_OPS"] = "ring"
        try:
            stratkit.make_strategy(strategy="mirrored", logical_cpus=2)
        except ConfigError as exc:
            report["refused"] = str(exc)
        print(json.dumps(report))
    """))
    assert result.ok, describe([result])
    report = result.last_json()
    assert {k: report[k] for k in ("type", "replicas", "sum")} == {"type": "MirroredStrategy", "replicas": 2,
                                                                 "sum": 3.0}
    assert report["reduce_to_one_device"] == ["ReductionToOneDevice", 3.0]
    assert report["hierarchical_copy"] == ["HierarchicalCopyAllReduce", 3.0]
    assert report["env"] == ["ReductionToOneDevice", 3.0]
    assert "STRATKIT_CROSS_DEVICE_OPS='ring'" in report["refused"] and "Fix:" in report["refused"]


def test_a_slurm_task_seeing_every_gpu_of_its_node_is_pinned_to_its_share_before_tensorflow_starts():
    # srun -N2 --ntasks-per-node=4 without --gpus-per-task, on 8-GPU nodes (the tests' stand-in inventory)
    slurm = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "8",
             "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "STRATKIT_FAKE_GPU_COUNT": "8",
             "CUDA_VISIBLE_DEVICES": None}
    result = run_process(_code("""
        import os
        from stratkit.strategy.factory import pin_gpus
        first = pin_gpus(stratkit.detect())
        again = pin_gpus(stratkit.detect())
        print(json.dumps({"first": first, "again": again, "env": os.environ["CUDA_VISIBLE_DEVICES"],
                          "gpus": stratkit.detect().num_gpus}))
    """), env=slurm)
    assert result.ok, describe([result])
    assert result.last_json() == {"first": "2,3", "again": None, "env": "2,3", "gpus": 2}


def test_multi_worker_mirrored_in_two_real_processes_all_reduces():
    ports = free_ports(2)
    results = run_cluster(_code("""
        s = stratkit.make_strategy()
        spec = stratkit.detect()
        import tensorflow as tf
        value = s.run(lambda: tf.constant(float(spec.task_index + 1)))
        mwms = isinstance(s, tf.distribute.MultiWorkerMirroredStrategy)
        print(json.dumps({"mwms": mwms, "replicas": s.num_replicas_in_sync,
                          "sum": float(s.reduce("SUM", value, axis=None)), "chief": spec.is_chief,
                          "implementation": s.extended._communication_options.implementation.name}))
    """), worker_tf_configs(ports), timeout=120, grace_after_failure=15)
    assert all(r.ok for r in results), describe(results)
    reports = [r.last_json() for r in results]
    assert [r["sum"] for r in reports] == [3.0, 3.0]
    assert [r["mwms"] for r in reports] == [True, True]
    assert [r["replicas"] for r in reports] == [2, 2]
    assert [r["chief"] for r in reports] == [True, False]
    assert [r["implementation"] for r in reports] == ["RING", "RING"]  # no GPU here: ring, not NCCL


def test_parameter_server_cluster_chief_coordinates_and_servers_exit_zero():
    ports = free_ports(3)
    cluster = {"chief": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"],
               "ps": [f"127.0.0.1:{ports[2]}"]}
    results = run_cluster(_code("""
        spec = stratkit.detect()
        s = stratkit.make_strategy()          # ps and worker tasks serve here and exit 0 at the end
        import tensorflow as tf
        from stratkit.strategy.server import signal_done
        with s.scope():
            counter = tf.Variable(0, dtype=tf.int64)
        coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(s)

        @tf.function
        def step():
            counter.assign_add(1)
            return counter.read_value()

        for _ in range(7):
            coordinator.schedule(step)
        coordinator.join()
        print(json.dumps({"type": type(s).__name__, "counter": int(counter.numpy()),
                          "device": counter.device}))
        signal_done(spec)
    """), cluster_tf_configs(cluster), timeout=150, grace_after_failure=20)
    assert all(r.ok for r in results), describe(results)
    report = results[0].last_json()
    assert report["type"].startswith("ParameterServerStrategy")
    assert report["counter"] == 7
    assert "/job:ps" in report["device"]
    assert "the chief finished training" in results[1].stdout
    assert "the chief finished training" in results[2].stdout


def test_tpu_without_a_tpu_says_which_tpu_and_what_to_do():
    result = run_process(_code("""
        try:
            stratkit.make_strategy()
        except stratkit.ConfigError as exc:
            print(json.dumps({"error": str(exc)}))
    """), env={"TPU_NAME": "local"})
    assert result.ok, describe([result])
    error = result.last_json()["error"]
    assert "TPU_NAME='local'" in error
    assert "Fix:" in error and "STRATKIT_STRATEGY" in error


def test_multi_worker_after_a_tensorflow_op_explains_the_startup_rule():
    # With a cluster (here of one worker) TF itself fails; without one it allows it (see
    # tests/strategy/test_model_fit_path.py for both, measured against TF).
    result = run_process(_code("""
        import tensorflow as tf
        tf.constant(1.0) + 1.0                     # the runtime starts here
        try:
            stratkit.make_strategy(strategy="multi_worker_mirrored")
        except stratkit.ConfigError as exc:
            print(json.dumps({"error": str(exc)}))
    """), tf_config=worker_tf_configs(free_ports(1))[0])
    assert result.ok, describe([result])
    error = result.last_json()["error"]
    assert "before any other TensorFlow op" in error
    assert "Collective ops must be configured at program startup" in error


def test_unknown_option_names_the_option_and_the_allowed_ones():
    with pytest.raises(ConfigError, match=r"bytes_per_pack.*one_device.*device"):
        stratkit.make_strategy(stratkit.detect({}), bytes_per_pack=1024)


def test_explicit_strategy_with_a_spec_is_checked_against_its_cluster():
    spec = stratkit.detect({"TF_CONFIG": '{"cluster": {"worker": ["a:1", "b:2", "c:3"]}, '
                                         '"task": {"type": "worker", "index": 0}}'})
    with pytest.raises(ConfigError, match=r"strategy='mirrored'.*3 worker"):
        stratkit.make_strategy(spec, strategy="mirrored")


def test_the_kind_as_first_positional_argument_builds_that_strategy():
    # As people type it: make_strategy("mirrored") used to fail with "'str' object has no attribute 'strategy'".
    result = run_process(_code("""
        s = stratkit.make_strategy("mirrored", logical_cpus=2)
        again = stratkit.make_strategy("MirroredStrategy", strategy="mirrored", logical_cpus=2)
        print(json.dumps({"type": type(s).__name__, "replicas": s.num_replicas_in_sync,
                          "again": type(again).__name__}))
    """))
    assert result.ok, describe([result])
    assert result.last_json() == {"type": "MirroredStrategy", "replicas": 2, "again": "MirroredStrategy"}


def test_a_positional_kind_and_a_different_strategy_keyword_are_refused():
    with pytest.raises(ConfigError, match=r"'mirrored'.*strategy='one_device'.*Fix"):
        stratkit.make_strategy("mirrored", strategy="one_device")


def test_a_positional_string_that_is_no_kind_names_the_argument_and_the_kinds():
    with pytest.raises(ConfigError, match=r"'mirrorred' is not a strategy.*one_device"):
        stratkit.make_strategy("mirrorred")
