"""A single host: MirroredStrategy over 2+ visible GPUs, else one device. Always matches."""

from __future__ import annotations

from typing import ClassVar, Mapping, Sequence

from stratkit.cluster.environments.base import ClusterEnvironment
from stratkit.cluster.spec import ClusterSpec


class LocalEnvironment(ClusterEnvironment):
    name: ClassVar[str] = "local"
    description: ClassVar[str] = "a single host"

    @staticmethod
    def detect(environ: Mapping[str, str], num_gpus: int,
               reasons: Sequence[str] = ("no TF_CONFIG, TPU or Slurm step: a single host",)) -> ClusterSpec:
        strategy = "mirrored" if num_gpus > 1 else "one_device"
        return ClusterSpec(strategy=strategy, num_gpus=num_gpus, source="local",
                           reasons=tuple(reasons) + (f"{num_gpus} GPU(s) visible -> {strategy}",))
