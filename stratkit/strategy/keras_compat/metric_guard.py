"""Refuse Keras metrics updated inside a parameter-server step (their updates are not atomic there).

``Variable.assign_add`` is ``assign(self + v)`` in Keras 3: a read and a write,
not atomic under asynchronous workers (measured: accuracy 1.156). Metric
variables created under a PS scope are marked, and their in-step updates
refused while TensorFlow traces the step. Patches private Keras code
(``Metric.add_variable``, ``Variable._direct_assign``); installed by the fit
guards on tested Keras versions only.
"""

from __future__ import annotations

import threading
from typing import Any

from stratkit.errors import ConfigError
from stratkit.strategy.keras_compat.parameter_server import PS_FIX, is_parameter_server
from stratkit.strategy.keras_compat.versions import _PATCH_MARK

_PS_METRIC_MARK = "_stratkit_parameter_server_metric"
_lock = threading.Lock()
_originals: dict[str, Any] = {}


class ParameterServerMetricError(ConfigError):
    """A Keras metric updated inside a parameter-server step (raised while TF traces it).

    Its ``__init__`` is ``Exception.__init__`` on purpose: autograph re-raises
    such an exception with its own type (adding the user's code location), where
    any other type would reach the user as a bare ``StagingError``.
    """

    __init__ = Exception.__init__


def _in_parameter_server_step() -> bool:
    """True while tracing code that ParameterServerStrategy workers will run.

    That is a ``strategy.run`` replica function, or any ``tf.function`` (what
    ``ClusterCoordinator.schedule`` runs on the workers). Eager code on the
    coordinator runs in one thread and is exact.
    """
    import tensorflow as tf

    if not tf.executing_eagerly():
        return True
    return (tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context()
            and is_parameter_server(tf.distribute.get_strategy()))


def install() -> None:
    """Mark metric variables created under a PS scope; refuse their in-step updates (idempotent).

    Reached only outside a ``StatelessScope``: stratkit's own PS loop updates
    metrics statelessly and accumulates deltas in raw atomic ``tf.Variable``
    counters, so it never gets here.
    """
    import tensorflow as tf
    from keras.src.backend.tensorflow import core
    from keras.src.metrics import metric

    with _lock:
        add_variable = metric.Metric.__dict__["add_variable"]
        if not getattr(add_variable, _PATCH_MARK, False):
            def guarded_add_variable(self: Any, *args: Any, **kwargs: Any) -> Any:
                variable = add_variable(self, *args, **kwargs)
                if tf.distribute.has_strategy() and is_parameter_server(tf.distribute.get_strategy()):
                    setattr(variable, _PS_METRIC_MARK, type(self).__name__)
                return variable

            setattr(guarded_add_variable, _PATCH_MARK, True)
            _originals["Metric.add_variable"] = add_variable
            metric.Metric.add_variable = guarded_add_variable

        direct_assign = core.Variable.__dict__["_direct_assign"]
        if not getattr(direct_assign, _PATCH_MARK, False):
            def guarded_direct_assign(self: Any, value: Any) -> Any:
                owner = getattr(self, _PS_METRIC_MARK, None)
                if owner is not None and _in_parameter_server_step():
                    raise ParameterServerMetricError(
                        f"the Keras metric {owner} (variable {self.path!r}) is updated inside a "
                        f"parameter-server step. Keras 3 metric updates are not atomic across "
                        f"asynchronous workers (assign_add is a read and a write), so its value would be "
                        f"wrong. Fix: {PS_FIX}: count with raw tf.Variable.assign_add, which is atomic "
                        f"on the ps."
                    )
                return direct_assign(self, value)

            setattr(guarded_direct_assign, _PATCH_MARK, True)
            _originals["Variable._direct_assign"] = direct_assign
            core.Variable._direct_assign = guarded_direct_assign


def revert() -> None:
    """Put Keras's own methods back (for tests)."""
    with _lock:
        if "Metric.add_variable" in _originals:
            from keras.src.metrics import metric

            metric.Metric.add_variable = _originals.pop("Metric.add_variable")
        if "Variable._direct_assign" in _originals:
            from keras.src.backend.tensorflow import core

            core.Variable._direct_assign = _originals.pop("Variable._direct_assign")
