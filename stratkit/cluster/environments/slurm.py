"""Slurm job steps started with `srun` (more than one task): a worker-only cluster."""

from __future__ import annotations

from typing import ClassVar, Mapping

from stratkit.cluster import gpus, slurm
from stratkit.cluster.environments.base import ClusterEnvironment
from stratkit.cluster.rules import spec_for_cluster
from stratkit.cluster.spec import ClusterSpec
from stratkit.errors import ConfigError


class SlurmEnvironment(ClusterEnvironment):
    name: ClassVar[str] = "slurm"
    description: ClassVar[str] = "the Slurm step (SLURM_STEP_NUM_TASKS)"

    @staticmethod
    def detect(environ: Mapping[str, str], num_gpus: int) -> ClusterSpec | None:
        if not slurm.is_slurm_step(environ):
            return None
        cluster, rank = slurm.slurm_cluster(environ)
        share = slurm.gpu_share(environ)  # this task's own GPUs when its node's tasks all see all of them
        if share is not None:
            num_gpus = gpus.Assignment(share).count or 0
        return spec_for_cluster(cluster, "worker", rank, source="slurm", num_gpus=num_gpus, reasons=[
            f"SLURM_STEP_NUM_TASKS={environ['SLURM_STEP_NUM_TASKS']} > 1 and "
            f"SLURM_PROCID={environ['SLURM_PROCID']}: a Slurm job step"])

    @classmethod
    def missing(cls, environ: Mapping[str, str], var: str) -> ConfigError:
        return ConfigError(f"{var}=slurm but this is not an srun step with more than one "
                           f"task (SLURM_STEP_NUM_TASKS={environ.get('SLURM_STEP_NUM_TASKS', '<unset>')!r}). "
                           "Fix: start the script with srun --ntasks=N")
