"""Cluster environments are small classes tried in one documented order."""

from __future__ import annotations

from typing import ClassVar, Mapping

import pytest

import importlib

import stratkit
from stratkit.cluster import environments
from stratkit.cluster.environments import ENVIRONMENTS, ClusterEnvironment
from stratkit.cluster.rules import spec_for_cluster
from stratkit.cluster.spec import ClusterSpec

detect_module = importlib.import_module("stratkit.cluster.detect")

TF_CONFIG = '{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}}'
SLURM = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "n[1-2]",
         "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}


class _Toy(ClusterEnvironment):
    """A made-up scheduler that says "TOY_RANK" and "TOY_HOSTS"."""

    name: ClassVar[str] = "toy"
    description: ClassVar[str] = "TOY_HOSTS"

    @staticmethod
    def detect(environ: Mapping[str, str], num_gpus: int) -> ClusterSpec | None:
        if "TOY_HOSTS" not in environ:
            return None
        hosts = environ["TOY_HOSTS"].split(",")
        return spec_for_cluster({"worker": hosts}, "worker", int(environ["TOY_RANK"]), "toy", num_gpus,
                                ["TOY_HOSTS is set"])


def test_the_order_is_tf_config_tpu_slurm_local() -> None:
    assert [e.name for e in ENVIRONMENTS] == ["tf_config", "tpu", "slurm", "local"]
    assert detect_module.CLUSTER_ENVS == ("auto", "none", "tf_config", "tpu", "slurm", "local")


def test_tf_config_beats_slurm_and_tpu_beats_slurm() -> None:
    assert stratkit.detect({"TF_CONFIG": TF_CONFIG, **SLURM}).source == "tf_config"
    assert stratkit.detect({"TPU_NAME": "t1", **SLURM}).strategy == "tpu"
    assert stratkit.detect(SLURM).source == "slurm"


def test_a_new_environment_is_one_class_in_the_tuple(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(detect_module, "ENVIRONMENTS", (ENVIRONMENTS[0], _Toy, *ENVIRONMENTS[1:]))
    spec = stratkit.detect({"TOY_HOSTS": "h1:5,h2:5,h3:5", "TOY_RANK": "2"})
    assert (spec.strategy, spec.task_index, spec.num_workers, spec.is_chief) == ("multi_worker_mirrored", 2, 3, False)
    assert spec.source == "toy" and "TOY_HOSTS is set" in spec.reasons
    # Earlier environments still win; an explicit choice selects it alone and fails loudly when absent.
    assert stratkit.detect({"TOY_HOSTS": "h1:5", "TOY_RANK": "0", "TF_CONFIG": TF_CONFIG}).source == "tf_config"
    assert stratkit.detect({"TOY_HOSTS": "h1:5,h2:5", "TOY_RANK": "0", "TF_CONFIG": TF_CONFIG,
                            "STRATKIT_CLUSTER_ENV": "toy"}).source == "toy"
    with pytest.raises(stratkit.ConfigError, match="STRATKIT_CLUSTER_ENV=toy but TOY_HOSTS is not set"):
        stratkit.detect({"STRATKIT_CLUSTER_ENV": "toy"})


def test_an_explicit_strategy_still_beats_every_environment() -> None:
    spec = stratkit.detect({"TPU_NAME": "t1"}, strategy="one_device")
    assert spec.strategy == "one_device"
    assert any("passed explicitly" in r for r in spec.reasons)


def test_every_environment_is_importable_without_tensorflow() -> None:
    import subprocess
    import sys

    code = ("import sys, stratkit.cluster.environments as e; "
            "assert 'tensorflow' not in sys.modules, 'tensorflow imported'; print(len(e.ENVIRONMENTS))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(len(environments.ENVIRONMENTS))
