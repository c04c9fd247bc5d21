"""Which GPUs each process on a host gets: the one rule for `stratkit launch`, Slurm steps and Spark.

Pure Python (no TensorFlow): the value of a process's CUDA_VISIBLE_DEVICES
is decided before TensorFlow starts in it, because TensorFlow maps nearly all
memory of every GPU it sees (tensorflow/tensorflow#18225) and MultiWorkerMirrored
counts every visible GPU as a replica of its own.

The rule:
  * G GPUs are visible to the host's launcher (`visible_gpus`: its own
    CUDA_VISIBLE_DEVICES when set, else the driver's count). Each process's
    value is written in the launcher's terms (`translate`): with a preset
    CUDA_VISIBLE_DEVICES="4,5,6,7", the process that gets the launcher's GPU 1
    is given "5".
  * N processes that train (chief, workers, evaluator) get G / N GPUs each,
    in order, when N divides G; an explicit K per process takes the first
    N * K; a ps task gets none ("") unless asked.
  * Two processes share a GPU only when asked (`share=True`); each process
    that shares one gets TF_FORCE_GPU_ALLOW_GROWTH=true, so TensorFlow does not
    map the whole GPU for the first of them (set before TensorFlow starts).
  * With no GPU and nothing asked, no process's environment changes.
Everything else is a `ConfigError` naming both numbers and the fix, before
any process starts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stratkit.cluster.devices import count_gpus
from stratkit.errors import ConfigError

#: Set in a process whose GPU another process also uses (TensorFlow reads it at start).
GROWTH_VAR = "TF_FORCE_GPU_ALLOW_GROWTH"
#: The roles that compute on GPUs by default; a ps task only holds variables.
TRAINING_ROLES = ("chief", "worker", "evaluator")


def visible_gpus(env: Mapping[str, str]) -> list[str]:
    """The GPUs a process with environment `env` sees, as the ids to hand on in CUDA_VISIBLE_DEVICES.

    The entries of a preset CUDA_VISIBLE_DEVICES (up to the first invalid one,
    as CUDA reads it; UUIDs stay UUIDs), else "0" .. "G-1" for the G GPUs
    `stratkit.cluster.devices.count_gpus` finds.
    """
    preset = env.get("CUDA_VISIBLE_DEVICES")
    count = count_gpus(env)
    if preset is None:
        return [str(i) for i in range(count)]
    return [d.strip() for d in preset.split(",") if d.strip()][:count]


def translate(indices: Sequence[int | str], preset: str | None, *, what: str, fix: str,
              where: str = "this host") -> list[str]:
    """Indices into the visible GPUs -> the ids a child process must be given.

    Without a preset CUDA_VISIBLE_DEVICES the indices are the ids. With
    preset "10,11,12,13", index 2 is "12". `what` and `fix` word the
    ConfigError for an index beyond the preset (e.g. a Spark address).
    """
    if preset is None:
        return [str(i) for i in indices]
    visible = [d.strip() for d in preset.split(",") if d.strip()]
    out = []
    for index in indices:
        if int(index) >= len(visible):
            raise ConfigError(f"{what} {index} but CUDA_VISIBLE_DEVICES={preset!r} on {where} lists only {len(visible)} "
                              f"device(s). Fix: {fix}")
        out.append(visible[int(index)])
    return out


def check_counts(counts: Sequence[tuple[str, int]], *, tasks: str, fix: str) -> None:
    """Refuse a cluster whose training tasks see different numbers of GPUs, naming every task's count.

    The one rule for the clusters a runner forms from per-task reports (Spark's barrier tasks, Ray's
    actors; the launcher's rendezvous words it per node): MultiWorkerMirrored needs as many devices on
    every worker, and NCCL refuses a mix of GPU and CPU-only workers deep inside TensorFlow
    (tensorflow/tensorflow#60847), so the cluster is refused before TensorFlow starts.

    Args:
        counts: (task label, GPUs its training process sees) for every training task (not ps tasks).
        tasks: what the tasks are, for the message ("Spark tasks", "Ray tasks").
        fix: what to change, for the message.
    """
    if len({count for _, count in counts}) <= 1:
        return
    shown = ", ".join(f"{label}: {count} GPU(s)" for label, count in counts)
    mixed = any(count == 0 for _, count in counts)
    raise ConfigError(f"the {tasks} see different numbers of GPUs ({shown}); "
                      + ("a cluster mixing GPU and CPU-only workers" if mixed else "workers with different GPU counts")
                      + f" cannot train in one MultiWorkerMirrored cluster. Fix: {fix}")


def split_evenly(total: int, parts: int, index: int) -> int:
    """How many of `total` items part `index` of `parts` gets: sizes differ by at most one, larger first."""
    return total // parts + (1 if index < total % parts else 0)


@dataclass(frozen=True)
class Spelling:
    """How a front door writes the GPU settings in its messages (flags, arguments, Slurm options)."""

    per_task: str = "--gpus-per-worker"
    per_ps: str = "--gpus-per-ps"
    share: str = "--share-gpus"
    tasks: str = "--workers"
    where: str = "this host"


FLAGS = Spelling()


@dataclass(frozen=True)
class Assignment:
    """What one process gets: its CUDA_VISIBLE_DEVICES (None: leave the environment as it is) and growth."""

    visible: str | None
    shared: bool = False

    @property
    def count(self) -> int | None:
        """GPUs the process sees (None: whatever the environment gives it)."""
        if self.visible is None:
            return None
        return len([d for d in self.visible.split(",") if d])

    def env(self) -> dict[str, str]:
        """The variables to set in the process (the user's own GROWTH_VAR is kept by the caller)."""
        out: dict[str, str] = {}
        if self.visible is not None:
            out["CUDA_VISIBLE_DEVICES"] = self.visible
        if self.shared:
            out[GROWTH_VAR] = "true"
        return out

    def describe(self) -> str:
        """`GPUs 0,1`, `no GPU`, `GPU 3 (shared)`, or `GPUs as the environment sets them`."""
        if self.visible is None:
            return "GPUs as the environment sets them"
        ids = [d for d in self.visible.split(",") if d]
        if not ids:
            return "no GPU"
        return f"GPU{'s' if len(ids) > 1 else ''} {','.join(ids)}" + (" (shared)" if self.shared else "")


def assign(visible: Sequence[str], roles: Sequence[str], *, per_task: int | None = None, per_ps: int | None = None,
           share: bool = False, spelling: Spelling = FLAGS) -> list[Assignment]:
    """Each process's GPUs, in the order of `roles` (see the module docstring for the rule).

    Args:
        visible: the host's GPU ids (`visible_gpus`), in the order processes take them.
        roles: each local process's role ("chief", "worker", "ps", "evaluator").
        per_task: GPUs per training process; None: G / N (N must divide G); 0 hides GPUs.
        per_ps: GPUs per ps task; None or 0: none.
        share: let several processes use one GPU (round robin) instead of refusing.

    Raises:
        ConfigError: naming the numbers and the fix, when the GPUs cannot be split so.
    """
    gpus = len(visible)
    training = [i for i, role in enumerate(roles) if role in TRAINING_ROLES]
    servers = [i for i, role in enumerate(roles) if role not in TRAINING_ROLES]
    for value, name in ((per_task, spelling.per_task), (per_ps, spelling.per_ps)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ConfigError(f"{name} must be a whole number >= 0: got {value!r}. Fix: e.g. {name} 1")
    if gpus == 0 and not per_task and not per_ps:
        hide = per_task == 0
        # Nothing asked on a host without GPUs: leave every environment exactly as it was.
        return [Assignment("" if hide or (per_ps == 0 and i in servers) else None) for i in range(len(roles))]
    asked = len(training) * (per_task or 0) + len(servers) * (per_ps or 0)
    if gpus == 0:
        raise ConfigError(f"{spelling.per_task if per_task else spelling.per_ps} asks for {asked} GPU(s) in all, "
                          f"but {spelling.where} has 0 visible GPUs (CUDA_VISIBLE_DEVICES and the NVIDIA driver show "
                          f"none). Fix: drop {spelling.per_task}/{spelling.per_ps} to train on CPU, or run where "
                          "the GPUs are visible")
    explicit = per_task is not None
    if per_task is None:
        count = len(training)
        if count and gpus % count and not share:
            workers = sum(roles[i] == "worker" for i in training)
            extra = count - workers  # the chief and evaluator take their share too
            others = f" (with the chief/evaluator: {count} training processes)" if extra else ""
            fits = [d - extra for d in range(1, gpus + 1) if gpus % d == 0 and d > extra]
            raise ConfigError(f"{spelling.tasks} {workers}{others}: {count} process(es) cannot split the {gpus} GPUs "
                              f"of {spelling.where} evenly. Fix: {spelling.tasks} {'/'.join(map(str, fits)) or 'N'}"
                              + (f" ({extra} more for the chief/evaluator)" if extra else "")
                              + f", or {spelling.per_task} K with {count} x K <= {gpus} (the rest stay idle)"
                              + (f", or {spelling.share} to let processes share GPUs" if spelling.share else ""))
        per_task = max(1, gpus // count) if count else 0
        asked = len(training) * per_task + len(servers) * (per_ps or 0)
    if asked > gpus and not share:
        parts = [f"{len(training)} x {per_task}"] + ([f"{len(servers)} x {per_ps}"] if per_ps else [])
        first = f"{spelling.per_task} {per_task}" if explicit else f"{per_task} GPU(s) per worker (the even split)"
        raise ConfigError(first + (f" and {spelling.per_ps} {per_ps}" if per_ps else "")
                          + f" ask for {' + '.join(parts)} = {asked} GPUs, but {spelling.where} has {gpus}. Fix: ask "
                          f"for at most {gpus} (fewer {spelling.tasks} or GPUs per process), or {spelling.share} to "
                          "let processes share GPUs (each then grows its memory as it needs it)")
    taken: list[list[int]] = [[] for _ in roles]
    cursor = 0
    for indices, per in ((training, per_task), (servers, per_ps or 0)):
        for i in indices:
            taken[i] = [(cursor + j) % gpus for j in range(per)]
            cursor += per
    users = Counter(g for ids in taken for g in ids)
    return [Assignment(",".join(visible[g] for g in ids), shared=any(users[g] > 1 for g in ids)) for ids in taken]
