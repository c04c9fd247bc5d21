"""Guards for the user's own ``model.fit`` / ``evaluate`` / ``predict`` under a stratkit strategy.

Users who take only the strategy from stratkit (``make_strategy()``) and keep
calling Keras's ``model.fit`` get the checks ``Trainer`` makes, at the one
place every such call passes: the Keras 3 TensorFlow trainer's ``fit``,
``evaluate`` and ``predict``. The wrappers read only the public surface of
those calls (their ``callbacks`` and ``verbose`` arguments, the model's
``distribute_strategy``). Installed by ``keras_compat.apply`` (and by
``make_strategy`` for one-device and parameter-server strategies):

* ParameterServerStrategy: Keras 3 has no coordinator path, so refuse up front
  instead of failing deep inside Keras.
* ``steps_per_execution > 1`` with several Mirrored/MWMS replicas: refuse
  (:func:`check_steps_per_execution`), as ``Trainer.build`` does; the same for a
  stateful RNN layer (:func:`check_stateful_rnn`) and for ``jit_compile=True``
  on CPU replicas (:func:`check_jit_compile`).
* The file-writing Keras callbacks of a model whose strategy stratkit routes
  (:func:`.ownership.routes_files`: one ``make_strategy`` built, on one process
  or N workers; :func:`stratkit.strategy.side_effects.route_side_effects`): a
  store URL staged locally and uploaded on the worker that writes the run's
  files (one process: that process); callbacks whose files cannot be moved
  are refused. On the non-chief workers of a multi-worker MWMS, those
  callbacks write to private temporary directories and the progress bar is
  off unless the call passes ``verbose=``; the workers check they resume a
  ``BackupAndRestore`` at the same epoch; and ``fit`` returns on every worker only once every worker's
  callbacks have finished (one scalar collective after Keras's ``fit``), so
  the chief's checkpoint files are complete when any worker reads them;
  arrays and PyDataset batches ``fit`` shuffles take the chief's order on every worker (:mod:`.array_shuffle`).
* ``train_on_batch``/``test_on_batch``/``predict_on_batch`` on N > 1 replicas: each replica its share of
  the batch (:mod:`.on_batch`).
  Otherwise one process, or one worker, is left exactly as Keras does it; a model without a stratkit
  strategy too (plain Keras in the same process).

A second guard catches Keras metrics updated in a parameter-server step
(:mod:`.metric_guard`).

A library that wrapped ``keras.Model.fit`` before the guards were installed
(``mlflow.keras.autolog()`` / ``mlflow.tensorflow.autolog()`` called before
``make_strategy()``) calls the ``fit`` it found then, Keras's own: its wrapper is
guarded too, so the user's ``model.fit`` is guarded whichever came first.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
from typing import Any

from stratkit.errors import ConfigError
from stratkit.strategy import replica_check
from stratkit.strategy.collectives import chief_ints, leave_together, min_over_workers
from stratkit.strategy.keras_compat import (array_shuffle, batchnorm, global_gradient, metric_guard, on_batch,
                                            ownership, replica_state, synced_logs)
from stratkit.strategy.keras_compat.parameter_server import PS_FIX, is_parameter_server, parameter_server_refusal
from stratkit.strategy.keras_compat.trainer_patches import _is_chief, _is_multi_worker_collective, _trainer_module
from stratkit.strategy.keras_compat.versions import _PATCH_MARK, TESTED_KERAS_VERSIONS, _major

log = logging.getLogger(__name__)

_FIT_METHODS = ("fit", "evaluate", "predict")
_guards_lock = threading.Lock()
_guard_originals: dict[str, Any] = {}
_model_overrides: dict[str, Any] = {}  # another library's wrappers on keras.Model, guarded
_inside_guarded_call = threading.local()


def _num_replicas(strategy: Any) -> int:
    return int(getattr(strategy, "num_replicas_in_sync", 1) or 1)


def check_steps_per_execution(model: Any, strategy: Any) -> None:
    """Refuse ``steps_per_execution > 1`` with more than one replica.

    Keras 3 fails with Mirrored/MultiWorkerMirrored strategies and more than
    one replica when ``steps_per_execution > 1`` (keras-team/keras#19246).

    Decision: raise :class:`~stratkit.errors.ConfigError` rather than quietly
    resetting it to 1. ``steps_per_execution`` also decides how often
    batch-level callbacks run and was chosen for throughput; changing it
    behind the user's back changes behaviour they configured, and a compiled
    model may already hold a train function built for the old value. The
    message names the value and the one-line fix.
    """
    import tensorflow as tf

    spe = int(getattr(model, "steps_per_execution", 1) or 1)
    replicas = _num_replicas(strategy)
    mirrored = isinstance(
        strategy, (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy)
    )
    if mirrored and replicas > 1 and spe > 1:
        raise ConfigError(
            f"steps_per_execution={spe} does not work in Keras 3 with "
            f"{type(strategy).__name__} and {replicas} replicas (keras-team/keras#19246). "
            f"Fix: compile the model with steps_per_execution=1 "
            f"(model.compile(..., steps_per_execution=1))."
        )


def _is_multi_replica_mirrored(strategy: Any) -> bool:
    import tensorflow as tf

    mirrored = isinstance(strategy, (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy))
    return mirrored and _num_replicas(strategy) > 1


def _layers(layer: Any, seen: set[int] | None = None) -> Any:
    """`layer` and every layer inside it (nested models, wrappers such as Bidirectional), through public attributes."""
    seen = set() if seen is None else seen
    if id(layer) in seen:
        return
    seen.add(id(layer))
    yield layer
    children = list(getattr(layer, "layers", None) or [])
    children += [getattr(layer, name, None) for name in ("layer", "forward_layer", "backward_layer")]
    for child in children:
        if child is not None and hasattr(child, "name"):
            yield from _layers(child, seen)


def check_stateful_rnn(model: Any, strategy: Any) -> None:
    """Refuse a stateful RNN layer with more than one Mirrored/MWMS replica.

    Keras fails inside the first step when the global batch reaches the layer
    (``ValueError ... If an RNN is stateful, the batch size ... must be the
    same``). Giving the layer the per-replica batch makes that error go away,
    but the layer's state is then one mirrored variable for every replica's
    stream of sequences, whose carried state stratkit has not verified, so
    the decision is to refuse before step 1 rather than train something
    that may be wrong.
    """
    if not _is_multi_replica_mirrored(strategy):
        return
    for layer in _layers(model):
        if layer is not model and getattr(layer, "stateful", False) is True:
            raise ConfigError(
                f"layer {layer.name!r} ({type(layer).__name__}) has stateful=True, which Keras cannot train on "
                f"{_num_replicas(strategy)} replicas of {type(strategy).__name__}: its state holds one batch "
                f"of sequences, while each replica sees its own part of the global batch. Fix: train the stateful "
                f"model on one replica (stratkit.make_strategy('one_device'), or one worker), or build the layer "
                f"with stateful=False")


def check_jit_compile(model: Any, strategy: Any) -> None:
    """Refuse ``jit_compile=True`` with several Mirrored/MWMS replicas on CPUs only.

    XLA compiles the step with its cross-replica all-reduce inside; on CPU
    devices XLA has no collectives for it. Measured (TF 2.21, Keras 3.15.1):
    a TensorFlow error after ``Epoch 1/`` on 2 logical CPUs, and SIGABRT on 2
    MWMS workers. Decision: refuse before step 1 wherever no GPU/TPU device is
    in the strategy. Reads the resolved ``model.jit_compile`` (Keras's default
    ``"auto"`` is already False on CPU). Strategies with GPUs are left as
    they are (not tested here).
    """
    if not _is_multi_replica_mirrored(strategy) or getattr(model, "jit_compile", False) is not True:
        return
    try:
        devices = list(strategy.extended.worker_devices)
    except Exception:  # noqa: BLE001 - cannot tell: leave it to Keras
        return
    if devices and all("CPU" in device.upper().rsplit("/", 1)[-1] for device in devices):
        raise ConfigError(
            f"jit_compile=True cannot run on {_num_replicas(strategy)} CPU replicas of {type(strategy).__name__}: "
            f"XLA has no cross-replica collectives on CPU devices (TensorFlow fails in the first step, "
            f"and multi-worker processes abort). Fix: compile with jit_compile=False "
            f"(model.compile(..., jit_compile=False), or leave Keras's default)")


_said_batchnorm = False
#: how many BatchNormalization layers the notice names (a ResNet has dozens)
_NAMED = 8


def _say_batchnorm_once(model: Any, strategy: Any) -> None:
    global _said_batchnorm
    names = batchnorm.training_layer_names(model)
    if _said_batchnorm or not names:
        return
    _said_batchnorm = True
    shown = ", ".join(names[:_NAMED]) + (f" and {len(names) - _NAMED} more" if len(names) > _NAMED else "")
    log.warning("BatchNormalization on %d replicas: %d layer(s) train with each replica's own rows' moments (as "
                "Keras and PyTorch DDP do): %s. stratkit averages their moving statistics over the replicas at "
                "each epoch's end and before every evaluation, so every worker holds the same model. For one "
                "process's math set %s=1 (the global batch's moments; costs a collective per layer and step), or, "
                "fine-tuning, freeze those layers themselves (layer.trainable = False: a base called with "
                "training=False still trains its BatchNormalization while the base is trainable).",
                global_gradient.replicas_of(strategy), len(names), shown, batchnorm.ENV_VAR)


def _one_order(strategy: Any) -> Any:
    """Every worker shuffles fit's arrays and PyDataset batches in the chief's order (:mod:`.array_shuffle`);
    nothing on one worker."""
    if not _is_multi_worker_collective(strategy):
        return contextlib.nullcontext()
    is_chief = _is_chief(strategy)
    return array_shuffle.agreed_order(
        lambda value: min_over_workers(strategy, value if is_chief else array_shuffle.UNSET),
        lambda values: array_shuffle.unless_chief(is_chief, chief_ints(strategy, values)))


def _guarded(name: str, original: Any, like: Any = None) -> Any:
    """Wrap one of ``fit``/``evaluate``/``predict`` with the checks above (arguments read as ``like``'s)."""
    signature = inspect.signature(like if like is not None else original)

    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_inside_guarded_call, "active", False):
            # fit's own evaluate() for validation data: the outer call already decided.
            return original(self, *args, **kwargs)
        strategy = self.distribute_strategy
        if is_parameter_server(strategy):
            raise parameter_server_refusal(f"model.{name}")
        check_steps_per_execution(self, strategy)
        check_stateful_rnn(self, strategy)
        check_jit_compile(self, strategy)
        temps: list[str] = []
        if ownership.routes_files(strategy):   # one process or N workers: the same rule
            from stratkit.strategy import side_effects  # imports Keras: not before a routed call

            is_chief = _is_chief(strategy)
            bound = signature.bind(self, *args, **kwargs)
            given = bound.arguments.get("callbacks")
            if isinstance(given, (list, tuple)):
                bound.arguments["callbacks"], temps = side_effects.route_side_effects(
                    given, is_chief=is_chief, multi_worker=_is_multi_worker_collective(strategy))
            if "verbose" not in bound.arguments and not is_chief:  # an explicit verbose= wins
                bound.arguments["verbose"] = side_effects.default_verbose(is_chief=False)
            args, kwargs = bound.args[1:], bound.kwargs
        front = []     # first: ModelCheckpoint & co. at an epoch's end see averaged statistics and a checked model
        if global_gradient.replicas_of(strategy) and global_gradient.installed():
            if batchnorm.has_per_replica_statistics(self):
                front.append(batchnorm.averaging_callback(self, strategy))
                if name == "fit":
                    _say_batchnorm_once(self, strategy)
            if name == "fit" and replica_check.mode() != "off":
                front.append(replica_check.callback(self, strategy))
        if front:
            bound = signature.bind(self, *args, **kwargs)
            given = bound.arguments.get("callbacks")
            if given is None or isinstance(given, (list, tuple)):
                bound.arguments["callbacks"] = [*front, *(given or [])]
                args, kwargs = bound.args[1:], bound.kwargs
        _inside_guarded_call.active = True
        exact = global_gradient.replicas_of(strategy) and name in ("fit", "evaluate") and \
            global_gradient.installed()
        if exact:
            replica_state.register(self)
            synced_logs.wrap_steps(self)
        try:
            with global_gradient.fit_mode() if exact else contextlib.nullcontext(), \
                    _one_order(strategy) if name == "fit" else contextlib.nullcontext():
                result = original(self, *args, **kwargs)
            if name == "fit" and _is_multi_worker_collective(strategy):
                # Every worker leaves fit together, after every worker's callbacks (the chief's checkpoint
                # and TensorBoard files are complete): scripts that then read the chief's checkpoint on every
                # worker, as TF's tutorials do, otherwise race the chief's write (h5py "unable to lock file").
                # In two rounds, so no worker leaves while a peer still reads its part (`leave_together`).
                leave_together(strategy)
            return result
        finally:
            _inside_guarded_call.active = False
            if temps:
                from stratkit.strategy import side_effects

                side_effects.remove_dirs(temps)   # the user's callbacks name their own files (or URLs) again

    setattr(method, _PATCH_MARK, True)
    return method


def install(version: str, mode: str) -> bool:
    """``keras_compat.install_fit_guards`` for a known Keras ``version`` and gate ``mode``."""
    with _guards_lock:
        if mode == "off" or _major(version) < 3:
            return False
        import keras

        if keras.backend.backend() != "tensorflow":
            return False
        cls = _trainer_module().TensorFlowTrainer
        for name in _FIT_METHODS:
            current = cls.__dict__[name]
            if not getattr(current, _PATCH_MARK, False):
                _guard_originals[name] = current
                setattr(cls, name, _guarded(name, current))
        for name in _FIT_METHODS:
            # A wrapper another library set on keras.Model before us (MLflow's autolog) calls the fit it found
            # then, Keras's unguarded one: guarded too, or every model.fit would skip the guard. (A wrapper set
            # after us calls ours.) Its arguments are read as Keras's: a wrapper may take *args, **kwargs.
            current = keras.Model.__dict__.get(name)
            if callable(current) and not getattr(current, _PATCH_MARK, False):
                _model_overrides[name] = current
                setattr(keras.Model, name, _guarded(name, current, like=_guard_originals.get(name)))
        for name in on_batch.METHODS:     # each replica its share of the batch (checks nothing: no guard)
            current = cls.__dict__[name]
            if not getattr(current, _PATCH_MARK, False):
                _guard_originals[name] = current
                setattr(cls, name, on_batch.wrap(name, current))
        array_shuffle.install()  # wraps Keras's own method only while a multi-worker fit runs
        if version in TESTED_KERAS_VERSIONS or mode == "force":
            metric_guard.install()
        else:
            log.warning("Keras %s is untested: Keras metrics updated in parameter-server steps are not "
                        "checked (their updates are not atomic); %s.", version, PS_FIX)
        return True


def revert_fit_guards() -> None:
    """Remove what :func:`install` installed (for tests)."""
    with _guards_lock:
        if _guard_originals:
            cls = _trainer_module().TensorFlowTrainer
            for name in (*_FIT_METHODS, *on_batch.METHODS):
                if name in _guard_originals:
                    setattr(cls, name, _guard_originals.pop(name))
        import keras

        for name, override in list(_model_overrides.items()):
            if getattr(keras.Model.__dict__.get(name), _PATCH_MARK, False):  # (its library may have removed it)
                setattr(keras.Model, name, override)
            del _model_overrides[name]
        metric_guard.revert()
        array_shuffle.revert()
