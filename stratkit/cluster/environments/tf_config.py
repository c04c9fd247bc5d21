"""TF_CONFIG: plain, Kubeflow TFJob, SageMaker (its "master" read as "chief"), AI Platform, Ray Train,
and the TF_CONFIG that `stratkit launch`, the Spark runner and the Ray runner write."""

from __future__ import annotations

from typing import ClassVar, Mapping

from stratkit.cluster.environments.base import ClusterEnvironment
from stratkit.cluster.rules import spec_for_cluster
from stratkit.cluster.spec import ClusterSpec
from stratkit.cluster.tf_config import parse_tf_config
from stratkit.errors import ConfigError

#: Set by `stratkit launch` ("launch"), the Spark runner ("spark") and the Ray runner ("ray") next to TF_CONFIG.
LAUNCHER_VAR = "STRATKIT_LAUNCHER"
#: Set by `stratkit launch --nnodes MIN:MAX` ("MIN:MAX" workers): the world size may change between restarts.
ELASTIC_VAR = "STRATKIT_ELASTIC"
_SAGEMAKER_VARS = ("SM_CURRENT_HOST", "SM_TRAINING_ENV", "SM_HOSTS")


class TFConfigEnvironment(ClusterEnvironment):
    name: ClassVar[str] = "tf_config"
    description: ClassVar[str] = "a TF_CONFIG with a cluster"

    @staticmethod
    def detect(environ: Mapping[str, str], num_gpus: int) -> ClusterSpec | None:
        parsed = parse_tf_config(environ.get("TF_CONFIG", ""))
        if parsed is None:
            return None
        launcher = environ.get(LAUNCHER_VAR, "").strip()
        if parsed.renamed_master or any(var in environ for var in _SAGEMAKER_VARS):
            source = "sagemaker"
        elif launcher in ("launch", "spark", "ray"):
            source = launcher
        else:
            source = "tf_config"
        reasons = [f"TF_CONFIG sets task {parsed.task_type}:{parsed.task_index} in a cluster of "
                   + ", ".join(f"{len(a)} {r}" for r, a in parsed.cluster.items())]
        if parsed.renamed_master:
            reasons.append('SageMaker role "master" read as "chief"')
        return spec_for_cluster(parsed.cluster, parsed.task_type, parsed.task_index, source, num_gpus, reasons)

    @classmethod
    def missing(cls, environ: Mapping[str, str], var: str) -> ConfigError:
        return ConfigError(f"{var}=tf_config but TF_CONFIG describes no cluster "
                           f"(TF_CONFIG={environ.get('TF_CONFIG', '<unset>')!r}). Fix: set TF_CONFIG, "
                           f"or set {var}=auto")
