"""The one rule from a TF_CONFIG-style cluster to a strategy and a chief.

Every environment that finds a cluster (TF_CONFIG, Slurm, ...) ends here, so
"which strategy does this cluster mean?" and "who is the chief?" are decided
in one place.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from stratkit.cluster.spec import TRAINING_ROLES, ClusterSpec


def spec_for_cluster(cluster: Mapping[str, list[str]], task_type: str | None, task_index: int | None,
                     source: str, num_gpus: int, reasons: Sequence[str]) -> ClusterSpec:
    """The `ClusterSpec` of one task: a "ps" role means parameter_server, else multi_worker_mirrored."""
    strategy = "parameter_server" if "ps" in cluster else "multi_worker_mirrored"
    reasons = list(reasons) + ['a "ps" role -> parameter_server' if "ps" in cluster
                               else "chief/worker roles only -> multi_worker_mirrored"]
    return ClusterSpec(
        strategy=strategy,
        task_type=task_type,
        task_index=task_index,
        cluster=cluster,
        is_chief=is_chief(cluster, task_type, task_index),
        num_workers=sum(len(cluster.get(r, ())) for r in TRAINING_ROLES),
        source=source,
        num_gpus=num_gpus,
        reasons=tuple(reasons),
    )


def is_chief(cluster: Mapping[str, list[str]], task_type: str | None, task_index: int | None) -> bool:
    """TensorFlow's rule: the chief task, else worker 0 when there is no chief.

    The evaluator is never the chief: it does not save the trained model.
    """
    if task_type == "chief":
        return True
    return task_type == "worker" and task_index == 0 and "chief" not in cluster
