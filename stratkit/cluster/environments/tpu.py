"""TPU hosts: Cloud TPU (TPU_NAME), GKE, Colab, and TPU VMs."""

from __future__ import annotations

from typing import ClassVar, Mapping

from stratkit.cluster.environments.base import ClusterEnvironment
from stratkit.cluster.spec import ClusterSpec
from stratkit.cluster.tpu import detect_tpu
from stratkit.errors import ConfigError


class TPUEnvironment(ClusterEnvironment):
    name: ClassVar[str] = "tpu"
    description: ClassVar[str] = "the TPU environment"

    @staticmethod
    def detect(environ: Mapping[str, str], num_gpus: int) -> ClusterSpec | None:
        found = detect_tpu(environ)
        if found is None:
            return None
        var, tpu_name = found
        return ClusterSpec(strategy="tpu", source="tpu", num_gpus=num_gpus, tpu=tpu_name,
                           reasons=(f"{var}={environ[var]!r}: a TPU environment",))

    @classmethod
    def missing(cls, environ: Mapping[str, str], var: str) -> ConfigError:
        return ConfigError(f"{var}=tpu but no TPU variable is set (TPU_NAME, "
                           "COLAB_TPU_ADDR, TPU_ACCELERATOR_TYPE, ...). Fix: set TPU_NAME to your TPU")
