"""What stratkit's parameter-server loop needs of Keras internals, checked before training starts.

Keras 3 has no parameter-server path of its own, so the training layer's ``training/ps/`` (through ``strategy/keras_ps.py``)
drives Keras's trainer pieces itself (``_compute_loss``, ``_symbolic_build``,
``_loss_tracker``, ...). This module lists those internals, refuses a Keras
that lacks them (:func:`check`, behind the same gate as the sync patches), and
holds the words every refusal of Keras's own loops under a
ParameterServerStrategy uses.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any

from stratkit.errors import ConfigError, KerasCompatError
from stratkit.strategy.keras_compat.versions import (
    COMPAT_COMMAND,
    ENV_VAR,
    TESTED_KERAS_VERSIONS,
    _major,
    _newest_tested,
    installed_keras_version,
    refuse_below_floor,
    supported_range,
    version_tuple,
)

log = logging.getLogger(__name__)

#: What to use instead of Keras's own loops for parameter-server training.
PS_FIX = ("use stratkit.Trainer(...).fit (or the coordinator API: ClusterCoordinator.schedule with raw "
          "tf.Variable counters, see docs/parameter-servers.md, 'Your own coordinator loop') "
          "for parameter-server training")

#: What the parameter-server loop (the training layer's training/ps/, via strategy/keras_ps.py) uses of Keras'
#: trainer, checked before training starts: class attributes, then attributes
#: Keras sets on each compiled model.
_PS_MODEL_ATTRIBUTES = ("_symbolic_build", "_compute_loss", "compute_metrics", "get_metrics_result",
                        "metrics_variables", "reset_metrics")
_PS_INSTANCE_ATTRIBUTES = ("_loss_tracker", "_call_has_training_arg")


def is_parameter_server(strategy: Any) -> bool:
    """True for a ``tf.distribute`` ParameterServerStrategy (V2, what ``make_strategy`` builds)."""
    import tensorflow as tf

    return isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy)


def parameter_server_refusal(what: str) -> ConfigError:
    """The error for Keras's own training code under a ParameterServerStrategy."""
    return ConfigError(
        f"{what} does not work under ParameterServerStrategy in Keras 3: Keras has no "
        f"parameter-server path (it fails deep inside Keras, and Keras metrics updated by "
        f"asynchronous workers are not atomic, so they report wrong values). Fix: {PS_FIX}."
    )


def parameter_server_internals_missing(model: Any = None) -> list[str]:
    """The Keras internals the parameter-server loop needs that this Keras lacks (empty: all there).

    Fails closed: anything that cannot be imported or inspected counts as missing.
    ``model`` (a compiled Keras model) lets the instance attributes be checked too.
    """
    missing: list[str] = []
    try:
        import keras
    except Exception:  # noqa: BLE001 - any failure means "cannot verify"
        return ["keras"]
    for name in _PS_MODEL_ATTRIBUTES:
        if not hasattr(keras.Model, name):
            missing.append(f"keras.Model.{name}")
    compute_loss = getattr(keras.Model, "_compute_loss", None)
    if compute_loss is not None:
        try:
            if "training" not in inspect.signature(compute_loss).parameters:
                missing.append("keras.Model._compute_loss(training=...)")
        except (TypeError, ValueError):
            missing.append("keras.Model._compute_loss(training=...)")
    scope = getattr(keras, "StatelessScope", None)
    if scope is None or not hasattr(scope, "get_current_value"):
        missing.append("keras.StatelessScope.get_current_value")
    optimizer_cls = getattr(getattr(keras, "optimizers", None), "Optimizer", None)
    if not hasattr(optimizer_cls, "scale_loss"):
        missing.append("keras.optimizers.Optimizer.scale_loss")
    try:
        from keras.src.losses.loss import unscale_loss_for_distribution  # noqa: F401
    except Exception:  # noqa: BLE001
        missing.append("keras.src.losses.loss.unscale_loss_for_distribution")
    if model is not None:
        missing.extend(f"model.{name}" for name in _PS_INSTANCE_ATTRIBUTES if not hasattr(model, name))
    return missing


def check(version: str, mode: str, model: Any = None) -> None:
    """``keras_compat.check_parameter_server`` for a known Keras ``version`` and gate ``mode``."""
    if _major(version) != 3:
        raise KerasCompatError(
            f"Keras {version} is in use, but parameter-server training needs Keras 3 "
            f"({supported_range()}). Fix: unset TF_USE_LEGACY_KERAS and pip install keras=={_newest_tested()}."
        )
    refuse_below_floor(version)
    if version not in TESTED_KERAS_VERSIONS and mode != "force":
        raise KerasCompatError(
            f"Keras {version} is installed, but stratkit's parameter-server training was only proved on "
            f"{supported_range()}. Fix: pip install keras=={_newest_tested()}; or prove Keras {version} with "
            f"`{COMPAT_COMMAND.format(keras=version)}` and add it to TESTED_KERAS_VERSIONS; or set "
            f"{ENV_VAR}=force to train with it at your own risk."
        )
    missing = parameter_server_internals_missing(model)
    if missing:
        raise KerasCompatError(
            f"Keras {version} lacks what stratkit's parameter-server loop uses: {', '.join(missing)}. "
            f"Fix: pip install keras=={_newest_tested()} ({supported_range()})."
        )
    if version not in TESTED_KERAS_VERSIONS:
        log.warning("Keras %s is not among the tested versions %s; %s=force: parameter-server training "
                    "at your own risk.", version, sorted(TESTED_KERAS_VERSIONS, key=version_tuple), ENV_VAR)


def model_losses_override(model: Any, losses: list[Any]) -> Any:
    """A context in which `model.losses` returns `losses`.

    The parameter-server step computes its loss and metric updates inside a
    `keras.StatelessScope` (so no Keras metric variable is written, see
    the training layer's `training/ps/metrics.py`). Inside one, Keras 3.15 reads the
    `add_loss` losses from the scope (empty: the forward pass ran outside it)
    and each regularized weight from the scope's state mapping (absent: it
    crashes with `'NoneType' object has no attribute 'dtype'`). Keras' own
    stateless (JAX) trainer hands the forward pass's losses to `compute_loss`
    through the private `Layer._losses_override`; this does the same with
    `model.losses` read outside the scope, so the losses and their gradients
    are exactly those of `model.fit`.
    """
    override = getattr(model, "_losses_override", None)
    if not isinstance(override, list):
        raise KerasCompatError(
            f"Keras {installed_keras_version()} has no Layer._losses_override, which stratkit uses to give "
            "parameter-server steps the model's add_loss and regularization losses. Fix: install a Keras 3 "
            f"version stratkit was tested on ({', '.join(sorted(TESTED_KERAS_VERSIONS))})")

    @contextlib.contextmanager
    def overridden() -> Any:
        override.clear()
        override.extend(losses)
        try:
            yield
        finally:
            override.clear()

    return overridden()
