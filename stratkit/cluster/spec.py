"""`ClusterSpec`: the answer to "where am I running, so which strategy and role?".

Pure Python on purpose: importing it never imports TensorFlow.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Mapping

#: Strategy kinds, in the order a user scales through them.
STRATEGIES = ("one_device", "mirrored", "multi_worker_mirrored", "parameter_server", "tpu")

#: The task roles TensorFlow's TF_CONFIG understands.
ROLES = ("chief", "worker", "ps", "evaluator")

#: Roles that run training steps (they count in `num_workers`).
TRAINING_ROLES = ("chief", "worker")


@dataclass(frozen=True)
class ClusterSpec:
    """Where this process runs and what it should build.

    Attributes:
        strategy: one of `STRATEGIES`.
        task_type: "chief", "worker", "ps", "evaluator", or None on a single host.
        task_index: index of this task within its role, or None on a single host.
        cluster: role -> list of "host:port"; empty on a single host.
        is_chief: True for the task that saves, logs and coordinates.
        num_workers: training hosts (chief + workers); 1 on a single host.
        source: which environment produced the spec ("tf_config", "sagemaker",
            "slurm", "tpu", "local", "launch", "spark", "ray").
        num_gpus: GPUs visible to this process (without importing TensorFlow).
        tpu: the TPU name or address for the "tpu" strategy, else None.
        reasons: human-readable lines saying which variables decided the spec.
    """

    strategy: str
    task_type: str | None = None
    task_index: int | None = None
    cluster: Mapping[str, list[str]] = field(default_factory=dict)
    is_chief: bool = True
    num_workers: int = 1
    source: str = "local"
    num_gpus: int = 0
    tpu: str | None = None
    reasons: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Copy so a caller's dict cannot change a spec after the fact.
        object.__setattr__(self, "cluster", {r: list(a) for r, a in self.cluster.items()})
        object.__setattr__(self, "reasons", tuple(self.reasons))

    def __hash__(self) -> int:
        frozen_cluster = tuple(sorted((r, tuple(a)) for r, a in self.cluster.items()))
        return hash((self.strategy, self.task_type, self.task_index, frozen_cluster, self.source))

    @property
    def is_multi_host(self) -> bool:
        """True when this process is one task of a TF_CONFIG-style cluster."""
        return bool(self.cluster)

    @property
    def worker_rank(self) -> int:
        """This task's rank among the training tasks (chief first), 0 when single-host.

        Non-training tasks (ps, evaluator) get -1.
        """
        if not self.cluster:
            return 0
        if self.task_type not in TRAINING_ROLES:
            return -1
        offset = len(self.cluster.get("chief", ())) if self.task_type == "worker" else 0
        return offset + (self.task_index or 0)

    def address(self) -> str | None:
        """This task's own "host:port", or None (single host, or an unlisted evaluator)."""
        addresses = self.cluster.get(self.task_type or "", [])
        if self.task_index is not None and self.task_index < len(addresses):
            return addresses[self.task_index]
        return None

    def to_tf_config_dict(self) -> dict:
        """The TF_CONFIG object TensorFlow accepts; `{}` on a single host."""
        if not self.cluster:
            return {}
        config: dict = {"cluster": {r: list(a) for r, a in self.cluster.items()}}
        if self.task_type is not None:
            config["task"] = {"type": self.task_type, "index": self.task_index}
        return config

    def to_tf_config(self) -> str:
        """The TF_CONFIG JSON string TensorFlow accepts (`"{}"` on a single host)."""
        return json.dumps(self.to_tf_config_dict(), sort_keys=True)

    def to_dict(self) -> dict:
        """A JSON-ready view of every field (used by `stratkit info --json`)."""
        return {
            "strategy": self.strategy,
            "task_type": self.task_type,
            "task_index": self.task_index,
            "cluster": {r: list(a) for r, a in self.cluster.items()},
            "is_chief": self.is_chief,
            "num_workers": self.num_workers,
            "source": self.source,
            "num_gpus": self.num_gpus,
            "tpu": self.tpu,
            "reasons": list(self.reasons),
        }
