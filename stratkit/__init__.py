"""stratkit: distributed Keras 3 training on TensorFlow as a one-line decision.

Importing stratkit and calling `detect()` never imports TensorFlow; the names
that need TensorFlow (`make_strategy`, `Trainer`, ...) load it on first use
(in a task srun started, with TensorFlow's start-up noise filtered:
`tf_logging.quiet_tensorflow_import`).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from stratkit import tf_logging
from stratkit.cluster import STRATEGIES, ClusterSpec, detect
from stratkit.errors import ConfigError, KerasCompatError, ReplicaDivergenceError, StratkitError

__version__ = "0.1.0"

# name -> module that defines it; imported lazily so `import stratkit` stays TF-free.
_LAZY = {
    "make_strategy": "stratkit.strategy.factory",
    "Trainer": "stratkit.training.trainer",
    "callbacks": "stratkit.callbacks",
    "check_replicas": "stratkit.strategy.replica_check",
    "LocalRunner": "stratkit.launch.runner",
    "tune": "stratkit.tuning",
}

if TYPE_CHECKING:  # pragma: no cover
    from stratkit.launch.runner import LocalRunner
    from stratkit.strategy.factory import make_strategy
    from stratkit.strategy.replica_check import check_replicas
    from stratkit.training.trainer import Trainer
    from stratkit.tuning import tune

__all__ = ["ClusterSpec", "ConfigError", "KerasCompatError", "LocalRunner", "ReplicaDivergenceError", "STRATEGIES",
           "StratkitError", "Trainer", "check_replicas", "detect", "make_strategy", "tune", "__version__"]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'stratkit' has no attribute {name!r}")
    import importlib

    if "tensorflow" not in sys.modules and tf_logging.started_by_srun(os.environ):
        # Slurm started this task: no stratkit parent filters TensorFlow's start-up lines, so do it here
        with tf_logging.quiet_tensorflow_import():
            module = importlib.import_module(module_name)
    else:
        module = importlib.import_module(module_name)
    value = module if module_name.endswith(name) else getattr(module, name)
    globals()[name] = value
    return value
