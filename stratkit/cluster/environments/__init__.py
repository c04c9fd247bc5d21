"""Cluster environments: one small class per file, each with a static `detect(environ, num_gpus)`.

Adding an environment is one new file here plus one entry in `ENVIRONMENTS`.
An environment answers None when its variables are absent; it raises
`ConfigError` when they are present but malformed (never a half-guess).

`ENVIRONMENTS` is the detection order (first match wins):
  1. TF_CONFIG -- the most explicit description of a cluster (Kubeflow TFJob,
     SageMaker, AI Platform, Ray, our launcher and Spark runner), so it beats
     the scheduler variables around it.
  2. TPU -- a TPU host runs one process, so it beats Slurm.
  3. Slurm -- an `srun` step with more than one task.
  4. Local -- always matches: mirrored with 2+ GPUs, else one_device.
An explicit `STRATKIT_CLUSTER_ENV=<name>` uses that environment alone and
fails loudly when it finds nothing; `none` turns detection off.
"""

from __future__ import annotations

from stratkit.cluster.environments.base import ClusterEnvironment
from stratkit.cluster.environments.local import LocalEnvironment
from stratkit.cluster.environments.slurm import SlurmEnvironment
from stratkit.cluster.environments.tf_config import TFConfigEnvironment
from stratkit.cluster.environments.tpu import TPUEnvironment

ENVIRONMENTS: tuple[type[ClusterEnvironment], ...] = (
    TFConfigEnvironment, TPUEnvironment, SlurmEnvironment, LocalEnvironment,
)

__all__ = ["ENVIRONMENTS", "ClusterEnvironment", "LocalEnvironment", "SlurmEnvironment",
           "TFConfigEnvironment", "TPUEnvironment"]
