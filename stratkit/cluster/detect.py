"""`detect()`: the one rule that maps an environment to a `ClusterSpec`.

The launcher, the Spark runner, the CLI and `make_strategy` all call this
function; none of them re-derives roles or strategies.

Order (first match wins; an explicit choice always beats detection):
  1. `strategy=` argument, then `STRATKIT_STRATEGY` -- the strategy kind.
  2. `STRATKIT_CLUSTER_ENV` -- "auto" (default), "none" (no auto-detection at
     all), or the name of one environment to use alone.
  3. The environments in `stratkit.cluster.environments.ENVIRONMENTS`, in
     that order (TF_CONFIG, TPU, Slurm, local); that module says why.
"""

from __future__ import annotations

import os
from typing import Mapping

from stratkit.cluster.devices import count_gpus
from stratkit.cluster.environments import ENVIRONMENTS, LocalEnvironment
from stratkit.cluster.environments.tf_config import LAUNCHER_VAR
from stratkit.cluster.spec import STRATEGIES, ClusterSpec
from stratkit.errors import ConfigError

STRATEGY_VAR = "STRATKIT_STRATEGY"
CLUSTER_ENV_VAR = "STRATKIT_CLUSTER_ENV"
CLUSTER_ENVS = ("auto", "none") + tuple(env.name for env in ENVIRONMENTS)

_ALIASES = {
    "onedevice": "one_device", "one_device": "one_device", "single": "one_device", "default": "one_device",
    "mirrored": "mirrored",
    "multi_worker_mirrored": "multi_worker_mirrored", "multiworkermirrored": "multi_worker_mirrored",
    "multi_worker": "multi_worker_mirrored", "mwms": "multi_worker_mirrored",
    "parameter_server": "parameter_server", "parameterserver": "parameter_server", "ps": "parameter_server",
    "tpu": "tpu",
}
_SOURCE_NAMES = {env.name: env.description for env in ENVIRONMENTS if env.name in ("slurm", "tpu")}


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
    known = ("auto", "none") + tuple(e.name for e in ENVIRONMENTS)
    if cluster_env not in known:
        raise ConfigError(f"{CLUSTER_ENV_VAR}={env[CLUSTER_ENV_VAR]!r} is not known. "
                          f"Fix: use one of {', '.join(known)}")
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
        return LocalEnvironment.detect(env, num_gpus, reasons=[f"{CLUSTER_ENV_VAR}=none: auto-detection is off"])
    for environment in ENVIRONMENTS:
        if cluster_env not in ("auto", environment.name):
            continue
        spec = environment.detect(env, num_gpus)
        if spec is not None:
            return spec
        if cluster_env == environment.name:
            raise environment.missing(env, CLUSTER_ENV_VAR)
    raise AssertionError("LocalEnvironment always matches")  # pragma: no cover


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
