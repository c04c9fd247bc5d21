"""A tune run of the launcher (`stratkit launch --tune`, `LocalRunner(tune=True)`): its plan and its refusals.

Every task is a tuner of one hyperparameter search (`stratkit.tuning`): no
TF_CONFIG (each trial trains alone on its tuner's own devices), the service's
address and the run's token in each task's environment
(`stratkit.tuning.environment.task_env`, written by `LaunchPlan.task_env`),
and the service on worker 0 (`host_task`, on the port the attempt holds for
it, as a TF server's) or on the driver (`LocalRunner`: `address`). With
`--workers-per-trial K` each K workers are one tuner that trains its trials
as a MultiWorkerMirrored cluster of its own (`stratkit.tuning.groups`; the
groups' tasks are `stratkit.cluster.layout`'s `trial_group`): every worker
then holds a TF port, and the service's port is the attempt's own.

How a tune run treats a task that ends badly (`launch/attempt.py`
`_lost_tuner`): the host's failure is the run's (restarted with
--max-restarts: the new host resumes from the search's store); another
tuner's, once the search started (`markers`), is a lost lease: said once, the
run goes on, its trial runs again on another tuner; before the start, it is
the run's failure (a tuner that cannot run is a bad configuration). A run
whose tuners all died is a failure unless every search that started ended.

Imports no TensorFlow.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stratkit.cluster import layout
from stratkit.errors import ConfigError
from stratkit.tuning import environment as tune_env


@dataclass(frozen=True)
class TunePlan:
    """A tune run (`--tune`, `LocalRunner(tune=True)`): every task a tuner of one search, no TF_CONFIG.

    `host_task` runs the search service beside its own tuner on the port the attempt holds for it (the
    launcher: worker 0); None: the service runs at `address` (`LocalRunner`'s driver). A tuner other than
    the host that dies after the search started (`markers`) is a lost lease, not the attempt's failure.
    """

    token: str
    engine: str
    markers: str
    host_task: str | None = "worker:0"
    address: tuple[str, int] | None = None
    #: Workers per trial (`--workers-per-trial K`): each group of K is one tuner, a cluster of its own.
    workers_per_trial: int = 1

    def markers_for(self, attempt: int) -> str:
        """Each attempt's own markers (a restarted host starts its search's start again) when a task hosts."""
        return os.path.join(self.markers, f"attempt-{attempt}") if self.host_task else self.markers

    def task_env(self, cluster: Mapping[str, Sequence[str]], task: layout.Task, attempt: int,
                 tasks: int) -> dict[str, str]:
        """A tuner's variables in attempt `attempt` of a run of `tasks` tasks: its part of the search
        (`stratkit.tuning.environment`); in a multi-worker trial group (`workers_per_trial` > 1), its tuner is
        its group's and its TF_CONFIG is its group's cluster (`cluster["worker"]`: every worker's address)."""
        per = self.workers_per_trial
        address = self.address or tune_env.parse_address(cluster["service"][0], "the service's address")
        group, place = layout.trial_group(task, per)
        env = tune_env.task_env(address, self.token, group, tasks // per, serve=task.name == self.host_task,
                                markers=self.markers_for(attempt), engine=self.engine, group=(place.index, per))
        if per > 1:
            env["TF_CONFIG"] = layout.tf_config_json(layout.group_cluster(cluster["worker"], group, per),
                                                     place.role, place.index)
        return env


def check_tune(*, chief: bool, ps: int, evaluator: bool, share_gpus: bool,
               machines: Sequence[Sequence[layout.Task]] | None) -> None:
    """A tune run's layout: N tuners (`--workers N`, or `gpu`: one per GPU), each trial on its own devices.

    Raises:
        ConfigError: naming the flag that has no meaning in a tune run, and the fix.
    """
    for given, flag in ((chief, "--chief"), (ps, "--ps"), (evaluator, "--evaluator")):
        if given:
            raise ConfigError(f"{flag} does not go with --tune: a tune run is N tuners (--workers N), each training "
                              f"its trials alone on its own devices; worker 0 also runs the search. Fix: drop {flag}")
    if share_gpus:
        raise ConfigError("--share-gpus does not go with --tune: two trials on one GPU would compete for its memory "
                          "and time (and train differently than alone). Fix: drop --share-gpus; --workers gpu runs one "
                          "tuner per GPU, or give each tuner several with --gpus-per-worker")
    if machines is not None:
        raise ConfigError("--tune with --nnodes is not supported yet: a tune run is the tuners of one machine. Fix: "
                          "run `stratkit launch --tune --workers N` on one machine, or use a Spark/Ray/Slurm search "
                          "(docs/tuning.md)")


def check_groups(workers: int, per_trial: int) -> None:
    """`--workers` is a whole number of trial groups of `--workers-per-trial` (each group trains one trial).

    Raises:
        ConfigError: naming both flags and the fix.
    """
    if isinstance(per_trial, bool) or not isinstance(per_trial, int) or per_trial < 1:
        raise ConfigError(f"--workers-per-trial must be a whole number >= 1: got {per_trial!r}. Fix: e.g. "
                          "--workers-per-trial 2 (each trial trains on 2 workers), or drop it (one per worker)")
    if workers % per_trial:
        raise ConfigError(f"--workers {workers} is not a whole number of trial groups of --workers-per-trial "
                          f"{per_trial}. Fix: --workers {per_trial * max(1, workers // per_trial)} (each group of "
                          f"{per_trial} workers trains one trial at a time, as one MultiWorkerMirrored cluster)")


def check_tuner_gpus(tuners: int, visible: Sequence[str], gpus_per_worker: int | None) -> None:
    """Never two trials on one GPU: more tuners than GPUs (unless they search on the CPU) is refused."""
    if visible and gpus_per_worker != 0 and tuners > len(visible):
        raise ConfigError(f"--workers {tuners} tuners but this host shows {len(visible)} GPU(s): a trial trains on "
                          "its tuner's own GPU, never two on one. Fix: --workers gpu (one tuner per GPU), "
                          f"--workers {len(visible)}, or --gpus-per-worker 0 to search on the CPU")


__all__ = ["TunePlan", "check_groups", "check_tune", "check_tuner_gpus"]
