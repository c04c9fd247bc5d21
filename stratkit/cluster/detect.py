"""`detect()`: the one rule that maps an environment to a `ClusterSpec`.

The launcher, the Spark runner, the CLI and `make_strategy` all call this
function; none of them re-derives roles or strategies.

Order (first match wins; an explicit choice always beats detection):
  1. `strategy=` argument, then `STRATKIT_STRATEGY` -- the strategy kind.
  2. `STRATKIT_CLUSTER_ENV` -- "auto" (default), "none" (no auto-detection at
     all), or one environment to use: "tf_config", "tpu", "slurm", "local".
  3. TF_CONFIG (covers Kubeflow TFJob, SageMaker, AI Platform, Ray, our
     launcher and Spark runner) -- it is the most explicit description of a
     cluster, so it beats the scheduler variables around it.
  4. A TPU environment -- a TPU host runs one process, so it beats Slurm.
  5. A Slurm `srun` step with more than one task.
  6. Local: "mirrored" with 2+ visible GPUs, else "one_device".
"""

from __future__ import annotations

import os
from typing import Mapping

from stratkit.cluster import slurm
from stratkit.cluster.devices import count_gpus
from stratkit.cluster.spec import STRATEGIES, TRAINING_ROLES, ClusterSpec
from stratkit.cluster.tf_config import parse_tf_config
from stratkit.cluster.tpu import detect_tpu
from stratkit.errors import ConfigError

STRATEGY_VAR = "STRATKIT_STRATEGY"
CLUSTER_ENV_VAR = "STRATKIT_CLUSTER_ENV"
#: Set by `stratkit launch` ("launch") and the Spark runner ("spark") next to TF_CONFIG.
LAUNCHER_VAR = "STRATKIT_LAUNCHER"

CLUSTER_ENVS = ("auto", "none", "tf_config", "tpu", "slurm", "local")

_ALIASES = {
    "onedevice": "one_device", "one_device": "one_device", "single": "one_device", "default": "one_device",
    "mirrored": "mirrored",
    "multi_worker_mirrored": "multi_worker_mirrored", "multiworkermirrored": "multi_worker_mirrored",
    "multi_worker": "multi_worker_mirrored", "mwms": "multi_worker_mirrored",
    "parameter_server": "parameter_server", "parameterserver": "parameter_server", "ps": "parameter_server",
    "tpu": "tpu",
}
_SAGEMAKER_VARS = ("SM_CURRENT_HOST", "SM_TRAINING_ENV", "SM_HOSTS")
_SOURCE_NAMES = {"slurm": "the Slurm step (SLURM_STEP_NUM_TASKS)", "tpu": "the TPU environment"}


def normalize_strategy(value: str | None, var: str = "strategy") -> str | None:
    """Map a user's strategy name (any case, "-" or "_", "Strategy" suffix) to a kind in `STRATEGIES`."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{var} must be a string naming a strategy: got {value!r}. "
                          f"Fix: use one of {', '.join(STRATEGIES)}")
    key = value.strip().lower().replace("-", "_")
    if key == "":
        return None  # an empty variable means "not set"
    if key.endswith("strategy"):
        key = key[: -len("strategy")].rstrip("_")
    kind = _ALIASES.get(key) or _ALIASES.get(key.replace("_", ""))
    if kind is None:
        raise ConfigError(f"{var}={value!r} is not a strategy. Fix: use one of {', '.join(STRATEGIES)}")
    return kind


def detect(environ: Mapping[str, str] | None = None, strategy: str | None = None) -> ClusterSpec:
    """Detect where this process runs and which strategy and role it gets.

    Pure Python: never imports TensorFlow.

    Args:
        environ: the environment to read (default: `os.environ`).
        strategy: an explicit strategy kind; beats `STRATKIT_STRATEGY` and detection.

    Returns:
        The `ClusterSpec` for this process.

    Raises:
        ConfigError: when the environment is malformed or contradicts the explicit choice.
    """
    env = os.environ if environ is None else environ
    override, override_reason = _choose_override(env, strategy)
    cluster_env = env.get(CLUSTER_ENV_VAR, "auto").strip().lower() or "auto"
    if cluster_env not in CLUSTER_ENVS:
        raise ConfigError(f"{CLUSTER_ENV_VAR}={env[CLUSTER_ENV_VAR]!r} is not known. "
                          f"Fix: use one of {', '.join(CLUSTER_ENVS)}")
    base = _detect_environment(env, cluster_env)
    if override is None:
        return base
    return _apply_override(base, override, override_reason)


def _choose_override(env: Mapping[str, str], strategy: str | None) -> tuple[str | None, str]:
    if strategy is not None:
        return normalize_strategy(strategy, "strategy"), f"strategy={strategy!r} was passed explicitly"
    if env.get(STRATEGY_VAR, "").strip():
        return normalize_strategy(env[STRATEGY_VAR], STRATEGY_VAR), f"{STRATEGY_VAR}={env[STRATEGY_VAR]!r}"
    return None, ""


def _detect_environment(env: Mapping[str, str], cluster_env: str) -> ClusterSpec:
    num_gpus = count_gpus(env)
    if cluster_env == "none":
        return _local(num_gpus, [f"{CLUSTER_ENV_VAR}=none: auto-detection is off"])

    if cluster_env in ("auto", "tf_config"):
        spec = _from_tf_config(env, num_gpus)
        if spec is not None:
            return spec
        if cluster_env == "tf_config":
            raise ConfigError(f"{CLUSTER_ENV_VAR}=tf_config but TF_CONFIG describes no cluster "
                              f"(TF_CONFIG={env.get('TF_CONFIG', '<unset>')!r}). Fix: set TF_CONFIG, "
                              f"or set {CLUSTER_ENV_VAR}=auto")

    if cluster_env in ("auto", "tpu"):
        found = detect_tpu(env)
        if found is not None:
            var, name = found
            return ClusterSpec(strategy="tpu", source="tpu", num_gpus=num_gpus, tpu=name,
                               reasons=(f"{var}={env[var]!r}: a TPU environment",))
        if cluster_env == "tpu":
            raise ConfigError(f"{CLUSTER_ENV_VAR}=tpu but no TPU variable is set (TPU_NAME, "
                              "COLAB_TPU_ADDR, TPU_ACCELERATOR_TYPE, ...). Fix: set TPU_NAME to your TPU")

    if cluster_env in ("auto", "slurm"):
        if slurm.is_slurm_step(env):
            cluster, rank = slurm.slurm_cluster(env)
            return _cluster_spec(cluster, "worker", rank, source="slurm", num_gpus=num_gpus, reasons=[
                f"SLURM_STEP_NUM_TASKS={env['SLURM_STEP_NUM_TASKS']} > 1 and SLURM_PROCID={env['SLURM_PROCID']}: "
                "a Slurm job step"])
        if cluster_env == "slurm":
            raise ConfigError(f"{CLUSTER_ENV_VAR}=slurm but this is not an srun step with more than one "
                              f"task (SLURM_STEP_NUM_TASKS={env.get('SLURM_STEP_NUM_TASKS', '<unset>')!r}). "
                              "Fix: start the script with srun --ntasks=N")

    return _local(num_gpus, ["no TF_CONFIG, TPU or Slurm step: a single host"])


def _local(num_gpus: int, reasons: list[str]) -> ClusterSpec:
    strategy = "mirrored" if num_gpus > 1 else "one_device"
    reasons = reasons + [f"{num_gpus} GPU(s) visible -> {strategy}"]
    return ClusterSpec(strategy=strategy, num_gpus=num_gpus, source="local", reasons=tuple(reasons))


def _from_tf_config(env: Mapping[str, str], num_gpus: int) -> ClusterSpec | None:
    parsed = parse_tf_config(env.get("TF_CONFIG", ""))
    if parsed is None:
        return None
    launcher = env.get(LAUNCHER_VAR, "").strip()
    if parsed.renamed_master or any(var in env for var in _SAGEMAKER_VARS):
        source = "sagemaker"
    elif launcher in ("launch", "spark"):
        source = launcher
    else:
        source = "tf_config"
    reasons = [f"TF_CONFIG sets task {parsed.task_type}:{parsed.task_index} in a cluster of "
               + ", ".join(f"{len(a)} {r}" for r, a in parsed.cluster.items())]
    if parsed.renamed_master:
        reasons.append('SageMaker role "master" read as "chief"')
    return _cluster_spec(parsed.cluster, parsed.task_type, parsed.task_index, source, num_gpus, reasons)


def _cluster_spec(cluster: dict[str, list[str]], task_type: str | None, task_index: int | None,
                  source: str, num_gpus: int, reasons: list[str]) -> ClusterSpec:
    strategy = "parameter_server" if "ps" in cluster else "multi_worker_mirrored"
    reasons = reasons + ['a "ps" role -> parameter_server' if "ps" in cluster
                         else "chief/worker roles only -> multi_worker_mirrored"]
    return ClusterSpec(
        strategy=strategy,
        task_type=task_type,
        task_index=task_index,
        cluster=cluster,
        is_chief=_is_chief(cluster, task_type, task_index),
        num_workers=sum(len(cluster.get(r, ())) for r in TRAINING_ROLES),
        source=source,
        num_gpus=num_gpus,
        reasons=tuple(reasons),
    )


def _is_chief(cluster: Mapping[str, list[str]], task_type: str | None, task_index: int | None) -> bool:
    """TensorFlow's rule: the chief task, else worker 0 when there is no chief.

    The evaluator is never the chief: it does not save the trained model.
    """
    if task_type == "chief":
        return True
    return task_type == "worker" and task_index == 0 and "chief" not in cluster


def _apply_override(base: ClusterSpec, override: str, why: str) -> ClusterSpec:
    from dataclasses import replace

    def contradiction(fix: str) -> ConfigError:
        layout = ", ".join(f"{len(a)} {r}" + ("" if len(a) == 1 or r == "ps" else "s")
                           for r, a in base.cluster.items()) or "a single host"
        where = _SOURCE_NAMES.get(base.source, "TF_CONFIG")
        return ConfigError(f"{why} contradicts the cluster in {where} ({layout}, which means "
                           f"{base.strategy}). Fix: {fix}")

    if base.cluster:
        if base.strategy == "parameter_server" and override != "parameter_server":
            raise contradiction(f'use strategy "parameter_server" for a cluster with "ps" tasks, or remove '
                                f'the "ps" role from TF_CONFIG, or set {CLUSTER_ENV_VAR}=none to ignore the cluster')
        if base.strategy == "multi_worker_mirrored":
            if override == "parameter_server":
                raise contradiction('add "ps" tasks and one "chief" to the cluster, or use "multi_worker_mirrored"')
            if override == "tpu":
                raise contradiction(f'unset TF_CONFIG on a TPU host, or set {CLUSTER_ENV_VAR}=none')
            if override in ("one_device", "mirrored") and base.num_workers > 1:
                raise contradiction(f'use "multi_worker_mirrored" for {base.num_workers} workers, run one '
                                    f'worker, or set {CLUSTER_ENV_VAR}=none to ignore the cluster')
    elif override == "parameter_server":
        raise ConfigError(f"{why}, but no cluster is configured (parameter-server training needs chief, "
                          "worker and ps tasks). Fix: set TF_CONFIG with chief, worker and ps roles, or "
                          "start it with `stratkit launch --ps 1 --workers 2 --chief -- python train.py`")
    if override == base.strategy:
        return replace(base, reasons=base.reasons + (f"{why} (agrees with detection)",))
    tpu = base.tpu
    return replace(base, strategy=override, tpu=tpu, reasons=base.reasons + (f"{why} -> {override}",))
