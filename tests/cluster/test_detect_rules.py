"""The detection rule of `stratkit.detect(environ=None, strategy=None)`, one behaviour per test.

Order (first match wins; an explicit choice always beats detection):
  1. the `strategy=` argument, then STRATKIT_STRATEGY;
  2. STRATKIT_CLUSTER_ENV: "auto" (default), "none" (no auto-detection), or one of
     "tf_config", "tpu", "slurm", "local";
  3. TF_CONFIG;  4. a TPU environment;  5. an srun step with more than one task;
  6. local: "mirrored" with 2+ visible GPUs, else "one_device".
Contradictions between the explicit choice and the environment raise ConfigError.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import stratkit
from stratkit import ClusterSpec, ConfigError
from stratkit.cluster import normalize_strategy
from stratkit.cluster import devices

REPO = Path(__file__).resolve().parents[2]

NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}
TWO_GPUS = {"CUDA_VISIBLE_DEVICES": "0,1"}


def env(**variables: str) -> dict[str, str]:
    """An explicit environ: no GPU unless the test says otherwise, so /proc never decides."""
    return {**NO_GPU, **variables}


def tf_config(cluster: dict, task_type: str = "worker", index: int = 0, **extra) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}, **extra})


THREE_WORKERS = tf_config({"worker": ["w0:2222", "w1:2222", "w2:2222"]}, "worker", 1)
ONE_WORKER = tf_config({"worker": ["w0:2222"]})
PS_CLUSTER = tf_config({"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"], "ps": ["p0:2222"]}, "worker", 0)

SLURM_4 = {  # srun --nodes=2 --ntasks=4 on node[01-02], this is rank 2
    "SLURM_PROCID": "2",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NODELIST": "node[01-02]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_JOB_ID": "4242",
}
TPU = {"TPU_NAME": "my-tpu-v3-8"}


def kind(spec: ClusterSpec) -> tuple:
    return spec.strategy, spec.source


def assert_config_error(excinfo: pytest.ExceptionInfo, *parts: str) -> str:
    message = str(excinfo.value)
    assert isinstance(excinfo.value, ValueError)
    assert "Fix" in message, message
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"
    return message


# ------------------------------------------------------------------ local: GPU counting


@pytest.mark.parametrize(("visible", "gpus", "strategy"), [
    ("", 0, "one_device"),
    ("-1", 0, "one_device"),
    ("0", 1, "one_device"),
    ("0,1", 2, "mirrored"),
    ("0,1,2", 3, "mirrored"),
    (" 0 , 1 ", 2, "mirrored"),
    ("0,-1,1", 1, "one_device"),  # CUDA stops at the first invalid id
    ("GPU-8a2c1f3e-aaaa-bbbb-cccc-1234567890ab,GPU-5d1b2e4f-dddd-eeee-ffff-0987654321ba", 2, "mirrored"),
], ids=["empty", "minus-one", "one", "two", "three", "spaces", "stops-at-minus-one", "uuids"])
def test_local_strategy_from_cuda_visible_devices(visible: str, gpus: int, strategy: str) -> None:
    spec = stratkit.detect({"CUDA_VISIBLE_DEVICES": visible})
    assert (spec.strategy, spec.num_gpus, spec.source) == (strategy, gpus, "local")
    assert (spec.task_type, spec.task_index, spec.cluster) == (None, None, {})
    assert (spec.is_chief, spec.num_workers, spec.is_multi_host, spec.worker_rank) == (True, 1, False, 0)
    assert spec.to_tf_config() == "{}"


def test_without_cuda_visible_devices_gpus_are_counted_from_the_driver(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for gpu in ("0000:3b:00.0", "0000:af:00.0"):
        (tmp_path / gpu).mkdir()
    monkeypatch.setattr(devices, "_DRIVER_DIR", str(tmp_path))
    assert (stratkit.detect({}).strategy, stratkit.detect({}).num_gpus) == ("mirrored", 2)
    monkeypatch.setattr(devices, "_DRIVER_DIR", str(tmp_path / "absent"))
    assert (stratkit.detect({}).strategy, stratkit.detect({}).num_gpus) == ("one_device", 0)


def test_cuda_visible_devices_beats_the_driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for gpu in ("a", "b", "c"):
        (tmp_path / gpu).mkdir()
    monkeypatch.setattr(devices, "_DRIVER_DIR", str(tmp_path))
    assert stratkit.detect({"CUDA_VISIBLE_DEVICES": "2"}).num_gpus == 1


# ------------------------------------------------------------------ explicit choice and aliases


@pytest.mark.parametrize(("name", "expected"), [
    ("MultiWorkerMirroredStrategy", "multi_worker_mirrored"),
    ("multi_worker_mirrored", "multi_worker_mirrored"),
    ("multi-worker-mirrored", "multi_worker_mirrored"),
    ("mwms", "multi_worker_mirrored"),
    ("MWMS", "multi_worker_mirrored"),
    ("ps", "parameter_server"),
    ("ParameterServerStrategy", "parameter_server"),
    ("parameter_server", "parameter_server"),
    ("MirroredStrategy", "mirrored"),
    (" mirrored ", "mirrored"),
    ("OneDeviceStrategy", "one_device"),
    ("one-device", "one_device"),
    ("TPUStrategy", "tpu"),
    ("tpu", "tpu"),
])
def test_strategy_aliases(name: str, expected: str) -> None:
    assert normalize_strategy(name) == expected
    assert expected in stratkit.STRATEGIES


@pytest.mark.parametrize(("name", "expected"), [
    ("MultiWorkerMirroredStrategy", "multi_worker_mirrored"),
    ("mwms", "multi_worker_mirrored"),
    ("MirroredStrategy", "mirrored"),
    ("one_device", "one_device"),
    ("TPUStrategy", "tpu"),
])
def test_explicit_strategy_on_a_single_host(name: str, expected: str) -> None:
    assert stratkit.detect(env(), strategy=name).strategy == expected
    assert stratkit.detect(env(STRATKIT_STRATEGY=name)).strategy == expected


@pytest.mark.parametrize("name", ["ps", "ParameterServerStrategy", "parameter-server"])
def test_ps_aliases_on_a_ps_cluster(name: str) -> None:
    spec = stratkit.detect(env(TF_CONFIG=PS_CLUSTER), strategy=name)
    assert (spec.strategy, spec.task_type, spec.task_index) == ("parameter_server", "worker", 0)


def test_argument_beats_environment_variable_beats_detection() -> None:
    environ = {**TWO_GPUS}
    assert stratkit.detect(environ).strategy == "mirrored"  # detection
    environ["STRATKIT_STRATEGY"] = "one_device"
    assert stratkit.detect(environ).strategy == "one_device"  # the variable beats detection
    assert stratkit.detect(environ, strategy="mwms").strategy == "multi_worker_mirrored"  # the argument beats both


def test_argument_wins_even_over_a_bad_environment_variable() -> None:
    assert stratkit.detect(env(STRATKIT_STRATEGY="horovod"), strategy="mirrored").strategy == "mirrored"


def test_explicit_choice_keeps_the_detected_role_and_says_why() -> None:
    spec = stratkit.detect(env(TF_CONFIG=THREE_WORKERS), strategy="MultiWorkerMirroredStrategy")
    assert (spec.strategy, spec.task_type, spec.task_index, spec.num_workers) == (
        "multi_worker_mirrored", "worker", 1, 3)
    assert any("explicitly" in reason for reason in spec.reasons)


@pytest.mark.parametrize("blank", ["", "   "])
def test_blank_strategy_variable_means_detect(blank: str) -> None:
    assert stratkit.detect({**TWO_GPUS, "STRATKIT_STRATEGY": blank}).strategy == "mirrored"


def test_unknown_strategy_argument() -> None:
    with pytest.raises(ConfigError) as excinfo:
        stratkit.detect(env(), strategy="horovod")
    assert_config_error(excinfo, "strategy", "'horovod'", "multi_worker_mirrored")


def test_unknown_strategy_variable() -> None:
    with pytest.raises(ConfigError) as excinfo:
        stratkit.detect(env(STRATKIT_STRATEGY="CentralStorageStrategy"))
    assert_config_error(excinfo, "STRATKIT_STRATEGY", "'CentralStorageStrategy'", "one_device")


def test_strategy_argument_must_be_a_string() -> None:
    with pytest.raises(ConfigError) as excinfo:
        stratkit.detect(env(), strategy=2)  # type: ignore[arg-type]
    assert_config_error(excinfo, "strategy", "2")


# ------------------------------------------------------------------ contradictions


CLUSTERS = {"3-workers": THREE_WORKERS, "1-worker": ONE_WORKER, "ps-cluster": PS_CLUSTER}


@pytest.mark.parametrize(("cluster", "override", "via"), [
    ("3-workers", "mirrored", "argument"),
    ("3-workers", "MirroredStrategy", "variable"),
    ("3-workers", "one_device", "argument"),
    ("3-workers", "OneDeviceStrategy", "variable"),
    ("3-workers", "parameter_server", "argument"),
    ("3-workers", "ps", "variable"),
    ("3-workers", "tpu", "argument"),
    ("1-worker", "tpu", "variable"),
    ("1-worker", "ps", "argument"),
    ("ps-cluster", "multi_worker_mirrored", "argument"),
    ("ps-cluster", "mwms", "variable"),
    ("ps-cluster", "mirrored", "argument"),
    ("ps-cluster", "one_device", "variable"),
    ("ps-cluster", "tpu", "argument"),
])
def test_override_contradicting_the_cluster(cluster: str, override: str, via: str) -> None:
    environ = env(TF_CONFIG=CLUSTERS[cluster])
    with pytest.raises(ConfigError) as excinfo:
        if via == "variable":
            stratkit.detect({**environ, "STRATKIT_STRATEGY": override})
        else:
            stratkit.detect(environ, strategy=override)
    name = "STRATKIT_STRATEGY" if via == "variable" else "strategy="
    assert_config_error(excinfo, name, repr(override), "contradicts", "TF_CONFIG")


@pytest.mark.parametrize("override", ["mirrored", "one_device"])
def test_single_device_strategies_are_allowed_on_a_one_worker_cluster(override: str) -> None:
    spec = stratkit.detect(env(TF_CONFIG=ONE_WORKER), strategy=override)
    assert (spec.strategy, spec.task_type, spec.num_workers) == (override, "worker", 1)


def test_mirrored_contradicts_a_slurm_cluster() -> None:
    with pytest.raises(ConfigError) as excinfo:
        stratkit.detect(env(**SLURM_4, STRATKIT_STRATEGY="mirrored"))
    assert_config_error(excinfo, "STRATKIT_STRATEGY", "'mirrored'", "Slurm", "4 workers")


def test_tpu_contradicts_a_slurm_cluster() -> None:
    with pytest.raises(ConfigError) as excinfo:
        stratkit.detect(env(**SLURM_4), strategy="tpu")
    assert_config_error(excinfo, "strategy='tpu'", "Slurm")


@pytest.mark.parametrize("environ", [
    env(),
    env(**TPU),
    {**TWO_GPUS},
    env(TF_CONFIG=PS_CLUSTER, STRATKIT_CLUSTER_ENV="none"),
], ids=["local", "tpu", "two-gpus", "detection-off"])
def test_parameter_server_needs_a_cluster(environ: dict) -> None:
    with pytest.raises(ConfigError) as excinfo:
        stratkit.detect(environ, strategy="parameter_server")
    assert_config_error(excinfo, "strategy='parameter_server'", "no cluster", "TF_CONFIG")


def test_multi_worker_mirrored_is_allowed_without_a_cluster() -> None:
    """MWMS with one worker and no TF_CONFIG is valid TensorFlow (it trains on the local devices)."""
    spec = stratkit.detect(env(), strategy="mwms")
    assert (spec.strategy, spec.cluster, spec.source, spec.is_chief, spec.num_workers) == (
        "multi_worker_mirrored", {}, "local", True, 1)


def test_override_agreeing_with_detection_changes_nothing_but_reasons() -> None:
    detected = stratkit.detect(env(TF_CONFIG=PS_CLUSTER))
    chosen = stratkit.detect(env(TF_CONFIG=PS_CLUSTER), strategy="ps")
    assert dataclasses.replace(chosen, reasons=()) == dataclasses.replace(detected, reasons=())
    assert len(chosen.reasons) == len(detected.reasons) + 1


# ------------------------------------------------------------------ STRATKIT_CLUSTER_ENV


def test_cluster_env_none_ignores_tf_config_tpu_and_slurm() -> None:
    everything = {**TWO_GPUS, **TPU, **SLURM_4, "TF_CONFIG": PS_CLUSTER, "COLAB_TPU_ADDR": "10.0.0.2:8470"}
    assert kind(stratkit.detect(everything)) == ("parameter_server", "tf_config")
    spec = stratkit.detect({**everything, "STRATKIT_CLUSTER_ENV": "none"})
    assert (spec.strategy, spec.source, spec.cluster, spec.task_type, spec.tpu) == ("mirrored", "local", {}, None, None)
    assert stratkit.detect({**everything, "STRATKIT_CLUSTER_ENV": "none", **NO_GPU}).strategy == "one_device"


@pytest.mark.parametrize("value", ["none", "NONE", " None "])
def test_cluster_env_none_ignores_malformed_variables(value: str) -> None:
    environ = env(TF_CONFIG="{not json", SLURM_PROCID="x", SLURM_STEP_NUM_TASKS="many",
                  SLURM_STEP_NODELIST="node[", STRATKIT_CLUSTER_ENV=value)
    assert kind(stratkit.detect(environ)) == ("one_device", "local")


def test_cluster_env_none_still_honours_an_explicit_strategy() -> None:
    spec = stratkit.detect(env(TF_CONFIG=THREE_WORKERS, STRATKIT_CLUSTER_ENV="none"), strategy="mwms")
    assert (spec.strategy, spec.cluster, spec.source) == ("multi_worker_mirrored", {}, "local")


@pytest.mark.parametrize("value", ["kubernetes", "off", "sagemaker"])
def test_invalid_cluster_env(value: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        stratkit.detect(env(STRATKIT_CLUSTER_ENV=value))
    assert_config_error(excinfo, "STRATKIT_CLUSTER_ENV", repr(value), "none")


@pytest.mark.parametrize("value", ["", "auto", "AUTO"])
def test_cluster_env_auto(value: str) -> None:
    assert kind(stratkit.detect(env(STRATKIT_CLUSTER_ENV=value, TF_CONFIG=ONE_WORKER))) == (
        "multi_worker_mirrored", "tf_config")


def test_cluster_env_picks_one_environment() -> None:
    everything = env(**TPU, **SLURM_4, TF_CONFIG=PS_CLUSTER)
    assert kind(stratkit.detect({**everything, "STRATKIT_CLUSTER_ENV": "tf_config"})) == ("parameter_server",
                                                                                          "tf_config")
    assert kind(stratkit.detect({**everything, "STRATKIT_CLUSTER_ENV": "tpu"})) == ("tpu", "tpu")
    assert kind(stratkit.detect({**everything, "STRATKIT_CLUSTER_ENV": "slurm"})) == ("multi_worker_mirrored",
                                                                                      "slurm")
    assert kind(stratkit.detect({**everything, "STRATKIT_CLUSTER_ENV": "local"})) == ("one_device", "local")


@pytest.mark.parametrize(("value", "variable"), [
    ("tf_config", "TF_CONFIG"), ("tpu", "TPU_NAME"), ("slurm", "SLURM_STEP_NUM_TASKS")])
def test_cluster_env_forcing_an_absent_environment(value: str, variable: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        stratkit.detect(env(STRATKIT_CLUSTER_ENV=value))
    assert_config_error(excinfo, f"STRATKIT_CLUSTER_ENV={value}", variable)


# ------------------------------------------------------------------ TF_CONFIG beats TPU and Slurm


def test_tf_config_beats_tpu_and_slurm() -> None:
    spec = stratkit.detect(env(**TPU, **SLURM_4, TF_CONFIG=THREE_WORKERS))
    assert (spec.strategy, spec.source, spec.task_index, spec.tpu) == ("multi_worker_mirrored", "tf_config", 1, None)


@pytest.mark.parametrize("empty", ["", "  ", "{}", '{"environment": "cloud"}', '{"cluster": {}}',
                                   '{"cluster": null, "task": {}}'])
def test_tf_config_without_a_cluster_falls_through(empty: str) -> None:
    assert kind(stratkit.detect(env(TF_CONFIG=empty, **SLURM_4))) == ("multi_worker_mirrored", "slurm")
    assert kind(stratkit.detect(env(TF_CONFIG=empty, **TPU))) == ("tpu", "tpu")
    assert kind(stratkit.detect({**TWO_GPUS, "TF_CONFIG": empty})) == ("mirrored", "local")


# ------------------------------------------------------------------ TPU


@pytest.mark.parametrize(("variables", "name"), [
    ({"TPU_NAME": "my-tpu"}, "my-tpu"),
    ({"TPU_NAME": "grpc://10.240.1.2:8470"}, "grpc://10.240.1.2:8470"),
    ({"COLAB_TPU_ADDR": "10.0.0.2:8470"}, "grpc://10.0.0.2:8470"),
    ({"COLAB_TPU_ADDR": "grpc://10.0.0.2:8470"}, "grpc://10.0.0.2:8470"),
    ({"TPU_ACCELERATOR_TYPE": "v4-8"}, "local"),
    ({"TPU_WORKER_ID": "0"}, "local"),
    ({"KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS": "grpc://10.4.5.6:8470"}, "grpc://10.4.5.6:8470"),
    ({"TPU_NAME": "named", "TPU_ACCELERATOR_TYPE": "v4-8"}, "named"),
], ids=["tpu-name", "tpu-name-grpc", "colab", "colab-grpc", "tpu-vm", "tpu-worker-id", "gke", "name-first"])
def test_tpu_environment(variables: dict, name: str) -> None:
    spec = stratkit.detect(env(**variables))
    assert (spec.strategy, spec.source, spec.tpu, spec.cluster, spec.is_chief) == ("tpu", "tpu", name, {}, True)


def test_blank_tpu_variable_is_not_a_tpu() -> None:
    assert kind(stratkit.detect(env(TPU_NAME="  "))) == ("one_device", "local")


def test_tpu_beats_slurm_and_gpus() -> None:
    assert kind(stratkit.detect({**TWO_GPUS, **SLURM_4, **TPU})) == ("tpu", "tpu")


# ------------------------------------------------------------------ Slurm


def slurm(**variables: str) -> dict[str, str]:
    return env(**{**SLURM_4, **variables})


def test_slurm_step_becomes_a_worker_only_cluster() -> None:
    spec = stratkit.detect(slurm())
    assert (spec.strategy, spec.source, spec.task_type, spec.task_index) == ("multi_worker_mirrored", "slurm",
                                                                             "worker", 2)
    assert spec.cluster == {"worker": ["node01:8888", "node01:8889", "node02:8888", "node02:8889"]}
    assert (spec.is_chief, spec.num_workers, spec.address()) == (False, 4, "node02:8888")


@pytest.mark.parametrize("rank", range(4))
def test_slurm_procid_is_the_worker_index(rank: int) -> None:
    spec = stratkit.detect(slurm(SLURM_PROCID=str(rank)))
    assert (spec.task_index, spec.is_chief, spec.worker_rank) == (rank, rank == 0, rank)


@pytest.mark.parametrize(("nodelist", "hosts"), [
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("gpu[1-2],cpu-a[1-2]x", ["gpu1", "gpu2", "cpu-a1x", "cpu-a2x"]),
    ("login1,login2,compute07,compute08", ["login1", "login2", "compute07", "compute08"]),
    ("c[1,3]-[5-6]", ["c1-5", "c1-6", "c3-5", "c3-6"]),
], ids=["ranges-and-singles", "padding-carries", "no-padding", "padding-widens", "two-groups", "two-items",
        "plain", "group-then-group"])
def test_slurm_hostlist_expansion(nodelist: str, hosts: list[str]) -> None:
    spec = stratkit.detect(slurm(SLURM_PROCID="0", SLURM_STEP_NUM_TASKS=str(len(hosts)),
                                 SLURM_STEP_NODELIST=nodelist, SLURM_STEP_TASKS_PER_NODE=f"1(x{len(hosts)})"))
    assert spec.cluster == {"worker": [f"{host}:8888" for host in hosts]}


def test_slurm_tasks_per_node_and_port_layout() -> None:
    spec = stratkit.detect(slurm(SLURM_PROCID="6", SLURM_STEP_NUM_TASKS="7", SLURM_STEP_NODELIST="gpu[1-4]",
                                 SLURM_STEP_TASKS_PER_NODE="2(x3),1", STRATKIT_SLURM_PORT="12000"))
    assert spec.cluster == {"worker": ["gpu1:12000", "gpu1:12001", "gpu2:12000", "gpu2:12001",
                                       "gpu3:12000", "gpu3:12001", "gpu4:12000"]}
    assert (spec.task_index, spec.address(), spec.num_workers) == (6, "gpu4:12000", 7)


def test_slurm_without_tasks_per_node_spreads_tasks_evenly() -> None:
    environ = slurm(SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="5", SLURM_STEP_NODELIST="n[1-2]")
    del environ["SLURM_STEP_TASKS_PER_NODE"]
    assert stratkit.detect(environ).cluster == {"worker": ["n1:8888", "n1:8889", "n1:8890", "n2:8888", "n2:8889"]}


def test_slurm_job_variables_are_the_fallback_for_step_variables() -> None:
    environ = slurm(SLURM_JOB_NODELIST="a[1-2]", SLURM_TASKS_PER_NODE="2(x2)")
    del environ["SLURM_STEP_NODELIST"], environ["SLURM_STEP_TASKS_PER_NODE"]
    assert stratkit.detect(environ).cluster == {"worker": ["a1:8888", "a1:8889", "a2:8888", "a2:8889"]}


@pytest.mark.parametrize(("port", "tasks_per_node"), [("65535", "1(x2)"), ("65534", "2")])
def test_slurm_port_range_may_end_at_65535(port: str, tasks_per_node: str) -> None:
    nodes = "n[1-2]" if tasks_per_node == "1(x2)" else "n1"
    spec = stratkit.detect(slurm(SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST=nodes,
                                 SLURM_STEP_TASKS_PER_NODE=tasks_per_node, STRATKIT_SLURM_PORT=port))
    assert max(int(address.rsplit(":", 1)[1]) for address in spec.cluster["worker"]) == 65535


@pytest.mark.parametrize(("port", "tasks_per_node"), [("65536", "1(x2)"), ("65535", "2"), ("0", "1(x2)"),
                                                      ("http", "1(x2)")])
def test_slurm_port_out_of_range(port: str, tasks_per_node: str) -> None:
    nodes = "n[1-2]" if tasks_per_node == "1(x2)" else "n1"
    with pytest.raises(ConfigError) as excinfo:
        stratkit.detect(slurm(SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST=nodes,
                              SLURM_STEP_TASKS_PER_NODE=tasks_per_node, STRATKIT_SLURM_PORT=port))
    assert_config_error(excinfo, "STRATKIT_SLURM_PORT", port)


def test_slurm_batch_script_is_not_a_cluster() -> None:
    """sbatch runs the script once on the first node: no SLURM_STEP_NUM_TASKS, so no cluster."""
    batch = env(SLURM_PROCID="0", SLURM_JOB_ID="4242", SLURM_NTASKS="8", SLURM_JOB_NODELIST="node[01-02]",
                SLURM_TASKS_PER_NODE="4(x2)", SLURM_NNODES="2")
    spec = stratkit.detect(batch)
    assert (spec.strategy, spec.source, spec.cluster) == ("one_device", "local", {})


def test_slurm_step_with_one_task_is_not_a_cluster() -> None:
    spec = stratkit.detect({**TWO_GPUS, **SLURM_4, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1",
                            "SLURM_STEP_NODELIST": "node01", "SLURM_STEP_TASKS_PER_NODE": "1"})
    assert kind(spec) == ("mirrored", "local")


def test_slurm_step_without_procid_is_not_a_cluster() -> None:
    environ = slurm()
    del environ["SLURM_PROCID"]
    assert kind(stratkit.detect(environ)) == ("one_device", "local")


@pytest.mark.parametrize("nodelist", ["node[01-03", "node[03-01]", "node[a-b]", "node[]", "node01]", "n[1--2]",
                                      "n[ 1-2]", "n[1-2]]"])
def test_bad_slurm_hostlist(nodelist: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        stratkit.detect(slurm(SLURM_STEP_NODELIST=nodelist))
    assert_config_error(excinfo, "SLURM_STEP_NODELIST", repr(nodelist))


@pytest.mark.parametrize(("variables", "names"), [
    ({"SLURM_STEP_NUM_TASKS": "four"}, ("SLURM_STEP_NUM_TASKS", "'four'")),
    ({"SLURM_PROCID": "x"}, ("SLURM_PROCID", "'x'")),
    ({"SLURM_PROCID": "4"}, ("SLURM_PROCID=4", "SLURM_STEP_NUM_TASKS=4")),
    ({"SLURM_PROCID": "-1"}, ("SLURM_PROCID=-1",)),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3)"}, ("SLURM_STEP_TASKS_PER_NODE", "'2(x3)'", "2 hosts")),
    ({"SLURM_STEP_TASKS_PER_NODE": "two"}, ("SLURM_STEP_TASKS_PER_NODE", "'two'")),
    ({"SLURM_STEP_TASKS_PER_NODE": "3,1", "SLURM_STEP_NUM_TASKS": "5"}, ("SLURM_STEP_TASKS_PER_NODE", "'3,1'")),
    ({"SLURM_STEP_NODELIST": ""}, ("SLURM_STEP_NODELIST",)),
], ids=["num-tasks-not-int", "procid-not-int", "procid-too-big", "procid-negative", "per-node-too-many-nodes",
        "per-node-garbage", "per-node-sum-mismatch", "no-nodelist"])
def test_inconsistent_slurm_step(variables: dict, names: tuple) -> None:
    with pytest.raises(ConfigError) as excinfo:
        stratkit.detect(slurm(**variables))
    assert_config_error(excinfo, *names)


# ------------------------------------------------------------------ sources


@pytest.mark.parametrize(("launcher", "source"), [("launch", "launch"), ("spark", "spark"), ("", "tf_config"),
                                                  ("other", "tf_config")])
def test_launcher_variable_sets_the_source(launcher: str, source: str) -> None:
    assert stratkit.detect(env(TF_CONFIG=THREE_WORKERS, STRATKIT_LAUNCHER=launcher)).source == source


def test_launcher_variable_alone_is_not_a_cluster() -> None:
    assert kind(stratkit.detect(env(STRATKIT_LAUNCHER="launch"))) == ("one_device", "local")


@pytest.mark.parametrize("variable", ["SM_CURRENT_HOST", "SM_TRAINING_ENV", "SM_HOSTS"])
def test_sagemaker_variables_make_the_source_sagemaker(variable: str) -> None:
    spec = stratkit.detect(env(TF_CONFIG=THREE_WORKERS, **{variable: "algo-1"}))
    assert kind(spec) == ("multi_worker_mirrored", "sagemaker")


# ------------------------------------------------------------------ environ=None reads os.environ


def test_detect_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert kind(stratkit.detect()) == ("one_device", "local")
    monkeypatch.setenv("TF_CONFIG", PS_CLUSTER)
    spec = stratkit.detect()
    assert (spec.strategy, spec.task_type, spec.task_index) == ("parameter_server", "worker", 0)
    monkeypatch.setenv("STRATKIT_CLUSTER_ENV", "none")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert kind(stratkit.detect()) == ("mirrored", "local")
    monkeypatch.setenv("STRATKIT_STRATEGY", "one_device")
    assert kind(stratkit.detect()) == ("one_device", "local")
    assert stratkit.detect(strategy="mwms").strategy == "multi_worker_mirrored"


def test_explicit_environ_ignores_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TF_CONFIG", "{broken")
    monkeypatch.setenv("STRATKIT_STRATEGY", "horovod")
    assert kind(stratkit.detect(env())) == ("one_device", "local")


def test_detect_does_not_modify_the_environ() -> None:
    environ = slurm(TF_CONFIG=THREE_WORKERS, STRATKIT_STRATEGY="mwms")
    before = dict(environ)
    stratkit.detect(environ)
    assert environ == before


# ------------------------------------------------------------------ ClusterSpec


@pytest.mark.parametrize("environ", [
    env(TF_CONFIG=THREE_WORKERS),
    env(TF_CONFIG=PS_CLUSTER),
    env(TF_CONFIG=tf_config({"chief": ["c:1"], "worker": ["w:1"]}, "evaluator", 0)),
    env(TF_CONFIG=tf_config({"master": ["algo-1:2222"], "worker": ["algo-2:2222"], "ps": ["algo-1:2223"]},
                            "master", 0, environment="cloud")),
    slurm(),
    env(),
    {**TWO_GPUS},
    env(**TPU),
], ids=["mwms", "ps", "evaluator-unlisted", "sagemaker-master", "slurm", "one-device", "mirrored", "tpu"])
def test_to_tf_config_round_trip(environ: dict) -> None:
    spec = stratkit.detect(environ)
    text = spec.to_tf_config()
    config = json.loads(text)
    assert isinstance(config, dict)
    assert set(config) <= {"cluster", "task"}
    again = stratkit.detect({**NO_GPU, "TF_CONFIG": text})
    fields = ("task_type", "task_index", "cluster", "is_chief", "num_workers")
    assert {f: getattr(again, f) for f in fields} == {f: getattr(spec, f) for f in fields}
    if spec.cluster:
        assert again.strategy == spec.strategy
        assert config["task"] == {"type": spec.task_type, "index": spec.task_index}
        assert set(config["cluster"]) <= set(stratkit.cluster.ROLES)
    else:
        assert text == "{}"
        assert again.source == "local"


def test_cluster_spec_is_frozen() -> None:
    spec = stratkit.detect(env(TF_CONFIG=THREE_WORKERS))
    for name, value in [("strategy", "mirrored"), ("task_index", 0), ("is_chief", True), ("cluster", {})]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(spec, name, value)
    assert spec.task_index == 1


def test_cluster_spec_copies_the_callers_cluster() -> None:
    cluster = {"worker": ["a:1", "b:1"]}
    spec = ClusterSpec(strategy="multi_worker_mirrored", task_type="worker", task_index=0, cluster=cluster)
    cluster["worker"].append("c:1")
    cluster["ps"] = ["p:1"]
    assert spec.cluster == {"worker": ["a:1", "b:1"]}


def test_cluster_spec_is_hashable_and_equal_specs_hash_equal() -> None:
    first = stratkit.detect(env(TF_CONFIG=PS_CLUSTER))
    second = stratkit.detect(env(TF_CONFIG=PS_CLUSTER))
    other = stratkit.detect(env(TF_CONFIG=THREE_WORKERS))
    assert first == second and hash(first) == hash(second)
    assert first != other
    assert len({first, second, other, stratkit.detect(env()), stratkit.detect(env())}) == 3
    assert {first: "x"}[second] == "x"


def test_worker_rank_and_address() -> None:
    cluster = {"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "ps": ["p:1"]}
    by_task = {(t, i): stratkit.detect(env(TF_CONFIG=tf_config(cluster, t, i))) for t, i in
               [("chief", 0), ("worker", 0), ("worker", 1), ("ps", 0)]}
    assert {k: s.worker_rank for k, s in by_task.items()} == {("chief", 0): 0, ("worker", 0): 1, ("worker", 1): 2,
                                                             ("ps", 0): -1}
    assert {k: s.address() for k, s in by_task.items()} == {("chief", 0): "c:1", ("worker", 0): "w0:1",
                                                           ("worker", 1): "w1:1", ("ps", 0): "p:1"}
    evaluator = stratkit.detect(env(TF_CONFIG=tf_config(cluster, "evaluator", 0)))
    assert (evaluator.address(), evaluator.worker_rank, evaluator.is_chief) == (None, -1, False)


def test_reasons_explain_the_decision() -> None:
    spec = stratkit.detect(env(TF_CONFIG=PS_CLUSTER))
    text = " ".join(spec.reasons)
    assert "TF_CONFIG" in text and "ps" in text
    assert json.loads(json.dumps(spec.to_dict()))["strategy"] == "parameter_server"


# ------------------------------------------------------------------ no TensorFlow


def test_detect_does_not_import_tensorflow() -> None:
    code = (
        "import json, os, sys, stratkit\n"
        "stratkit.detect()\n"
        "stratkit.detect({'TF_CONFIG': json.dumps({'cluster': {'chief': ['c:1'], 'worker': ['w:1'], 'ps': ['p:1']},"
        " 'task': {'type': 'worker', 'index': 0}})})\n"
        "stratkit.detect({'SLURM_PROCID': '1', 'SLURM_STEP_NUM_TASKS': '2', 'SLURM_STEP_NODELIST': 'n[1-2]'})\n"
        "stratkit.detect({'TPU_NAME': 'x'}).to_tf_config()\n"
        "try:\n"
        "    stratkit.detect({'TF_CONFIG': '{bad'})\n"
        "except stratkit.ConfigError:\n"
        "    pass\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras', 'tf_keras'))\n"
        "assert not loaded, loaded\n"
    )
    child_env = {k: v for k, v in os.environ.items()}
    child_env["PYTHONPATH"] = os.pathsep.join([str(REPO), child_env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=child_env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
