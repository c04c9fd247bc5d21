"""What a run records about the cluster that trained it: the strategy, replicas, global batch, engine, versions.

`engine` says who started the processes: `launch` (`stratkit launch`), `local`
(`stratkit.LocalRunner`), `spark`, `ray` (the runners), `slurm` (srun), `tf_config`
(a TF_CONFIG from elsewhere: Kubeflow, Ray Train), `sagemaker`, `tpu`, or
`process` (one process, nothing around it).

Keras is imported with this module; TensorFlow by the model it reads.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Mapping
from typing import Any

from stratkit.cluster import ClusterSpec

#: Set by the runner that started the task when the TF_CONFIG source does not say it (`LocalRunner`: "local").
RUNNER_VAR = "STRATKIT_RUNNER"
_ENGINES = {"local": "process"}


def engine(spec: ClusterSpec, environ: Mapping[str, str] | None = None) -> str:
    """Who started this process (see the module docstring)."""
    environ = os.environ if environ is None else environ
    runner = environ.get(RUNNER_VAR, "").strip()
    return runner or _ENGINES.get(spec.source, spec.source)


def run_params(model: Any, spec: ClusterSpec, *, global_batch_size: int | None, epochs: Any,
               steps_per_epoch: Any) -> dict[str, str]:
    """The params of the run (strings, as MLflow keeps them); what is unknown is left out."""
    import keras

    strategy = getattr(model, "distribute_strategy", None)
    params: dict[str, Any] = {
        "strategy": spec.strategy,
        "strategy_class": type(strategy).__name__ if strategy is not None else None,
        "replicas": getattr(strategy, "num_replicas_in_sync", None),
        "workers": spec.num_workers,
        "global_batch_size": global_batch_size,
        "engine": engine(spec),
        "epochs": epochs,
        "steps_per_epoch": steps_per_epoch,
        "stratkit_version": _version("stratkit"),
        "keras_version": keras.__version__,
        "tensorflow_version": _version("tensorflow", "tensorflow-cpu", "tf-nightly"),
    }
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        params["optimizer"] = type(optimizer).__name__
        params["learning_rate"] = _learning_rate(optimizer)
    return {key: str(value) for key, value in params.items() if value is not None}


def pip_requirements() -> list[str]:
    """What a logged model needs: this Keras and TensorFlow, pinned (MLflow would start a Python to infer them)."""
    pins = [f"keras=={importlib.metadata.version('keras')}"]
    for dist in ("tensorflow", "tensorflow-cpu"):
        try:
            pins.append(f"{dist}=={importlib.metadata.version(dist)}")
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    return pins


def _version(*dists: str) -> str | None:
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _learning_rate(optimizer: Any) -> Any:
    rate = getattr(optimizer, "learning_rate", None)
    try:
        return float(rate)
    except (TypeError, ValueError):  # not one number (a schedule some Keras versions return as such)
        return type(rate).__name__
