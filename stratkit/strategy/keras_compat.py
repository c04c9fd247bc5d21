"""Version-gated fixes that let Keras 3 train under multi-worker tf.distribute.

Why this exists
---------------
Keras 3's TensorFlow trainer (``keras/src/backend/tensorflow/trainer.py``) has
two bugs that stop ``fit``/``evaluate`` under ``MultiWorkerMirroredStrategy``
(MWMS) with two or more workers:

1. ``TensorFlowTrainer._maybe_symbolic_build`` builds the model from the first
   batch after *averaging that batch across replicas* with
   ``strategy.reduce("MEAN", batch, axis=None)``. Under multi-worker MWMS this
   raises ``ValueError: Attempt to convert a value (PerReplica:{...}) ... to a
   Tensor`` (keras-team/keras#20585). The batch is only needed for its shapes
   and dtypes, so we build from the first *local* replica's batch
   (``strategy.experimental_local_results(v)[0]``): no cross-worker traffic,
   same shapes.
2. The module function ``reduce_per_replica`` reduces the step's logs under
   multi-worker with ``strategy.reduce("MEAN", v, axis=0)``. Logs are scalars
   (rank 0), so this raises ``Invalid reduction dimension 0 for input with 0
   dimensions`` (tensorflow/tensorflow#72388). We reduce rank-0 values with
   ``axis=None`` (mean across replicas only) and leave every other case to the
   original function.

Both fixes replace private Keras functions, so they are applied only to Keras
versions they were verified on (:data:`TESTED_KERAS_VERSIONS`, proved by the
compat suite ``make compat`` / ``tools/compat.py`` on real worker processes).
Below :data:`KERAS_FLOOR` every strategy is refused, even when forced (forcing
is measured to train wrong there). On any other Keras 3 version :func:`apply`
runs a cheap in-process probe of the installed functions; if it cannot prove
both bugs are gone it raises :class:`~stratkit.errors.KerasCompatError` instead
of letting training fail later or, worse, silently do something else. The
parameter-server loop sits behind the same gate (:func:`check_parameter_server`).

This module imports neither TensorFlow nor Keras at import time: ``import
stratkit`` must stay TensorFlow-free. Everything heavy is imported inside the
functions.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from stratkit.errors import ConfigError, KerasCompatError

__all__ = [
    "ENV_VAR",
    "PS_FIX",
    "ParameterServerMetricError",
    "KERAS_FLOOR",
    "TESTED_KERAS_VERSIONS",
    "TESTED_TENSORFLOW_VERSIONS",
    "apply",
    "check_parameter_server",
    "check_supported",
    "check_steps_per_execution",
    "install_fit_guards",
    "installed_keras_version",
    "is_parameter_server",
    "parameter_server_refusal",
    "revert",
    "resume_epoch",
    "revert_fit_guards",
    "supported_range",
    "upstream_bugs_present",
    "version_tuple",
]

log = logging.getLogger(__name__)

#: Exact Keras versions the compat suite (``make compat``, ``tools/compat.py``)
#: proved: 2-worker MWMS weights equal to one process, Mirrored, parameter-server
#: training with an evaluator, backup resume, plain ``model.fit`` (see
#: ``benchmarks/results/compat.json``; a test keeps this set equal to its passing rows).
TESTED_KERAS_VERSIONS: frozenset[str] = frozenset({"3.11.3", "3.12.4", "3.13.2", "3.14.1", "3.15.1"})

#: The oldest Keras stratkit supports. Older releases are refused in every mode,
#: ``force`` included, because forcing them is known to go wrong: 3.8-3.10 pass
#: ``(step, iterator)`` pairs to ``_maybe_symbolic_build`` (the patch crashes; a
#: tolerant patch gives right weights but wrong history metrics), 3.3 fails with
#: ``KeyError`` and a scalar-only fix lets workers diverge silently.
KERAS_FLOOR = "3.11.0"

#: TensorFlow versions the compat suite ran (each with every tested Keras).
TESTED_TENSORFLOW_VERSIONS: frozenset[str] = frozenset({"2.16.2", "2.21.0"})

#: The command that proves another (TF, Keras) pair, named in refusals.
COMPAT_COMMAND = "make compat KERAS={keras}"

#: Environment variable overriding the version gate: ``force`` patches any
#: Keras 3 version (at the user's own risk), ``off`` never patches,
#: ``auto`` (or unset) is the default gate.
ENV_VAR = "STRATKIT_KERAS_COMPAT"

#: Names of the upstream bugs this module fixes, as reported by
#: :func:`upstream_bugs_present`.
BUG_SYMBOLIC_BUILD = "keras-team/keras#20585 (_maybe_symbolic_build reduces the first batch)"
BUG_SCALAR_REDUCE = "tensorflow/tensorflow#72388 (reduce_per_replica reduces scalars with axis=0)"

_TRAINER_MODULE = "keras.src.backend.tensorflow.trainer"
_PATCH_MARK = "__stratkit_keras_compat__"

_lock = threading.Lock()
_status: str | None = None
_originals: dict[str, Any] = {}


# --------------------------------------------------------------------------
# Version detection
# --------------------------------------------------------------------------


def _legacy_keras_requested() -> bool:
    """True when TensorFlow routes ``tf.keras`` to tf-keras (Keras 2).

    Uses the exact test TensorFlow itself applies to ``TF_USE_LEGACY_KERAS``.
    """
    return os.environ.get("TF_USE_LEGACY_KERAS") in ("true", "True", "1")


def installed_keras_version() -> str:
    """The version of the Keras that training will use, e.g. ``"3.15.1"``.

    With ``TF_USE_LEGACY_KERAS=1`` that is tf-keras (a ``2.x`` version) when it
    is installed; otherwise the ``keras`` package. This is the *only* place the
    version gate reads the version, so tests can monkeypatch it.
    """
    if _legacy_keras_requested():
        try:
            import tf_keras  # type: ignore[import-not-found]

            return str(tf_keras.__version__)
        except ImportError:
            pass  # TF will complain itself; report the Keras that is importable.
    import keras

    return str(keras.__version__)


def _major(version: str) -> int:
    """Major version number of ``version`` (``"3.15.1"`` -> 3)."""
    try:
        return int(version.split(".", 1)[0])
    except ValueError as exc:
        raise KerasCompatError(f"Cannot parse the Keras version {version!r}.") from exc


def _mode() -> str:
    """The value of :data:`ENV_VAR`, validated (``auto``, ``force`` or ``off``)."""
    raw = os.environ.get(ENV_VAR, "").strip().lower()
    if raw in ("", "auto"):
        return "auto"
    if raw in ("force", "off"):
        return raw
    raise ConfigError(
        f"{ENV_VAR}={os.environ.get(ENV_VAR)!r} is not understood. "
        f"Use {ENV_VAR}=auto (default: patch tested Keras versions only), "
        f"{ENV_VAR}=force (patch any Keras 3 version at your own risk) or "
        f"{ENV_VAR}=off (never patch)."
    )


# --------------------------------------------------------------------------
# The replacement functions
# --------------------------------------------------------------------------


def _first_local_value(strategy: Any, value: Any) -> Any:
    """``value`` itself, or the first local replica's component of a distributed value."""
    import tensorflow as tf

    if isinstance(value, tf.distribute.DistributedValues):
        return strategy.experimental_local_results(value)[0]
    return value


def _maybe_symbolic_build(self: Any, iterator: Any = None, data_batch: Any = None) -> None:
    """Replacement for ``TensorFlowTrainer._maybe_symbolic_build``.

    Upstream averages the first distributed batch across replicas with
    ``strategy.reduce("MEAN", batch, axis=None)`` only to learn its shapes;
    under multi-worker MWMS that reduce fails (keras-team/keras#20585). The
    first local replica's batch has the same per-replica shapes and dtypes and
    needs no cross-worker communication, so we build from it. (The same MEAN
    is what makes MirroredStrategy crash with ``AddN must have the same size
    and shape`` on an uneven first batch; building from one replica's batch
    avoids that too.) Everything else (the early return without a strategy,
    consuming one batch from the first epoch iterator, building inside
    ``strategy.scope()``) is unchanged.
    """
    from keras.src import tree

    if self._distribute_strategy is None:
        # Without an explicit strategy Keras defers building to tracing time.
        return
    strategy = self.distribute_strategy
    if iterator is not None:
        for _, _, it in iterator:
            batch = next(it)
            data_batch = tree.map_structure(lambda v: _first_local_value(strategy, v), batch)
            break
    with strategy.scope():
        self._symbolic_build(data_batch=data_batch)


def _static_rank(strategy: Any, value: Any) -> int | None:
    """Static rank of a tensor or of a distributed value's local component, if known."""
    local = _first_local_value(strategy, value)
    shape = getattr(local, "shape", None)
    if shape is None:
        return None
    return getattr(shape, "rank", len(shape) if isinstance(shape, tuple) else None)


def _is_multi_worker_collective(strategy: Any) -> bool:
    """True for an MWMS whose cluster has more than one worker (where bug 2 bites)."""
    import tensorflow as tf

    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and bool(
        strategy.extended._in_multi_worker_mode()
    )


def _reduce_per_replica(values: Any, strategy: Any, reduction: str) -> Any:
    """Replacement for the module function ``reduce_per_replica``.

    Upstream, under multi-worker MWMS, ``"mean"`` (what ``"auto"`` means off
    TPU) calls ``strategy.reduce("MEAN", v, axis=0)`` for every value. For the
    scalar logs every train/test step returns that fails with ``Invalid
    reduction dimension 0 for input with 0 dimensions``
    (tensorflow/tensorflow#72388). A rank-0 value has no axis to average
    within a replica, so ``axis=None`` (average across replicas only) is the
    intended meaning. Values of rank >= 1 keep ``axis=0`` and every other
    reduction and strategy goes to the original function unchanged, so the
    patch changes nothing but the failing case.
    """
    original = _originals["reduce_per_replica"]
    if reduction not in ("auto", "mean") or not _is_multi_worker_collective(strategy):
        return original(values, strategy, reduction)

    from keras.src import tree

    def _mean(v: Any) -> Any:
        axis = None if _static_rank(strategy, v) == 0 else 0
        return strategy.reduce("MEAN", v, axis=axis)

    return tree.map_structure(_mean, values)


setattr(_maybe_symbolic_build, _PATCH_MARK, True)
setattr(_reduce_per_replica, _PATCH_MARK, True)


def _trainer_module() -> Any:
    """The Keras module holding the two patched functions (imported lazily)."""
    import importlib

    return importlib.import_module(_TRAINER_MODULE)


def _install() -> None:
    """Swap the two Keras functions for ours; a second call is a no-op."""
    m = _trainer_module()
    cls = m.TensorFlowTrainer
    if not getattr(cls.__dict__.get("_maybe_symbolic_build"), _PATCH_MARK, False):
        _originals["_maybe_symbolic_build"] = cls.__dict__["_maybe_symbolic_build"]
        cls._maybe_symbolic_build = _maybe_symbolic_build
    if not getattr(m.reduce_per_replica, _PATCH_MARK, False):
        _originals["reduce_per_replica"] = m.reduce_per_replica
        m.reduce_per_replica = _reduce_per_replica


def revert() -> None:
    """Restore the original Keras functions and forget the cached :func:`apply` result.

    For tests and for callers who need upstream behaviour back in this process.
    """
    global _status
    revert_fit_guards()
    with _lock:
        if _originals:
            m = _trainer_module()
            if "_maybe_symbolic_build" in _originals:
                m.TensorFlowTrainer._maybe_symbolic_build = _originals.pop("_maybe_symbolic_build")
            if "reduce_per_replica" in _originals:
                m.reduce_per_replica = _originals.pop("reduce_per_replica")
        _status = None


# --------------------------------------------------------------------------
# Self-check for Keras versions we did not test
# --------------------------------------------------------------------------


def _probe_strategy_class() -> type:
    """A stand-in MWMS that claims multi-worker mode and records what Keras asks of it.

    It is an instance of ``tf.distribute.MultiWorkerMirroredStrategy`` (so
    Keras takes its multi-worker branches) but never touches a cluster. Its
    ``reduce`` fails exactly where the real one fails: on a value whose rank
    is too small for ``axis``, and on any cross-replica reduce of an input
    batch (which is what bug 1 does).
    """
    import contextlib

    import tensorflow as tf

    class _ProbeExtended:
        worker_devices = ("/job:worker/task:0/device:CPU:0",)

        def _in_multi_worker_mode(self) -> bool:
            return True

    class _ProbeStrategy(tf.distribute.MultiWorkerMirroredStrategy):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:  # deliberately no super().__init__: no cluster
            self._extended = _ProbeExtended()
            self.reduce_calls: list[tuple[str, Any]] = []
            self.batch_reduced = False

        @property
        def extended(self) -> Any:
            return self._extended

        @property
        def num_replicas_in_sync(self) -> int:
            return 2

        def scope(self) -> Any:
            return contextlib.nullcontext()

        def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
            if isinstance(value, tf.distribute.DistributedValues):
                return tuple(value.values)
            return (value,)

        def reduce(self, reduce_op: Any, value: Any, axis: Any = None) -> Any:
            self.reduce_calls.append((str(reduce_op), axis))
            if isinstance(value, (tuple, list, dict)):
                self.batch_reduced = True
                raise TypeError("probe: cross-replica reduce of an input batch")
            local = self.experimental_local_results(value)[0]
            rank = local.shape.rank
            if axis is not None and (rank is None or rank <= axis):
                raise ValueError(
                    f"probe: Invalid reduction dimension {axis} for input with {rank} dimensions"
                )
            return local

    return _ProbeStrategy


def upstream_bugs_present() -> list[str]:
    """Which of the two bugs the *currently installed* Keras functions still have.

    Runs both functions in-process against a stand-in multi-worker MWMS and
    symbolic tensors in a private ``tf.Graph``: no cluster, no eager op (so it
    is safe before the real MWMS is created), a few milliseconds. It fails
    closed: anything unexpected (a renamed function, a changed signature, a
    different call pattern) counts as "bug present".

    Returns an empty list only if both functions were seen to handle the
    failing inputs correctly.
    """
    try:
        import tensorflow as tf
        from tensorflow.python.distribute import values as tf_values

        m = _trainer_module()
        probe_cls = _probe_strategy_class()
    except Exception as exc:  # noqa: BLE001 - any failure means "cannot verify"
        log.debug("keras_compat self-check could not start: %r", exc)
        return [BUG_SYMBOLIC_BUILD, BUG_SCALAR_REDUCE]

    present: list[str] = []
    with tf.Graph().as_default():
        x = tf.zeros((8, 4), tf.float32)
        y = tf.zeros((8, 1), tf.float32)
        loss = tf.constant(1.0)

        # Bug 1: build from a distributed first batch without reducing it.
        try:
            strategy = probe_cls()
            built: list[Any] = []

            class _Model:
                _distribute_strategy = strategy
                distribute_strategy = strategy

                def _symbolic_build(self, data_batch: Any = None) -> None:
                    built.append(data_batch)

            batch = (tf_values.PerReplica((x,)), tf_values.PerReplica((y,)))
            m.TensorFlowTrainer._maybe_symbolic_build(_Model(), iterator=[(0, 0, iter([batch]))])
            ok = (
                not strategy.batch_reduced
                and len(built) == 1
                and isinstance(built[0], (tuple, list))
                and len(built[0]) == 2
                and all(isinstance(t, tf.Tensor) for t in built[0])
                and [t.shape.as_list() for t in built[0]] == [[8, 4], [8, 1]]
            )
        except Exception as exc:  # noqa: BLE001
            log.debug("keras_compat self-check, symbolic build: %r", exc)
            ok = False
        if not ok:
            present.append(BUG_SYMBOLIC_BUILD)

        # Bug 2: reduce scalar logs across workers.
        try:
            strategy = probe_cls()
            logs = {"loss": tf_values.PerReplica((loss,))}
            out = m.reduce_per_replica(logs, strategy, reduction="auto")
            ok = (
                isinstance(out, dict)
                and isinstance(out.get("loss"), tf.Tensor)
                and out["loss"].shape.rank == 0
                and len(strategy.reduce_calls) == 1
                and strategy.reduce_calls[0][0].upper().endswith("MEAN")
            )
        except Exception as exc:  # noqa: BLE001
            log.debug("keras_compat self-check, scalar reduce: %r", exc)
            ok = False
        if not ok:
            present.append(BUG_SCALAR_REDUCE)
    return present


# --------------------------------------------------------------------------
# The gate
# --------------------------------------------------------------------------


def _refusal(version: str, bugs: list[str]) -> KerasCompatError:
    """The error raised for an untested Keras version (at or above the floor) that still has a bug."""
    return KerasCompatError(
        f"Keras {version} is installed, but stratkit's multi-worker fixes for Keras 3 "
        f"were only proved on {supported_range()}, and a self-check of Keras {version} "
        f"could not show these upstream bugs are fixed: {'; '.join(bugs)}. "
        f"Fix: install a tested version (pip install keras=={_newest_tested()}); or prove this one "
        f"with `{COMPAT_COMMAND.format(keras=version)}` in a stratkit checkout and add it to "
        f"TESTED_KERAS_VERSIONS; or set {ENV_VAR}=force to apply the patches to Keras {version} "
        f"at your own risk, or {ENV_VAR}=off to run Keras {version} unpatched."
    )


def apply(strategy: Any = None) -> str:
    """Make Keras 3 work under MWMS / MirroredStrategy; safe to call many times.

    Patches once per process and caches the outcome (a refusal is not cached,
    so a fixed environment can retry). Returns:

    * ``"patched"``: Keras is a tested version; the fixes are installed.
    * ``"forced"``: Keras is untested and still buggy, but
      ``STRATKIT_KERAS_COMPAT=force``; the fixes are installed anyway.
    * ``"not_needed"``: legacy Keras 2 / tf-keras (``TF_USE_LEGACY_KERAS=1``),
      a non-TensorFlow Keras backend, or an untested Keras 3 whose self-check
      shows both bugs fixed upstream. Nothing is changed.
    * ``"disabled"``: ``STRATKIT_KERAS_COMPAT=off``. Nothing is changed.

    Raises:
        KerasCompatError: an untested Keras 3 version that still has a bug (or
            cannot be checked), and no override is set.
        ConfigError: ``STRATKIT_KERAS_COMPAT`` has an unknown value.

    ``strategy`` is optional and only used for a log line: the fixes act on
    Keras classes, so they cover every strategy in the process and change
    nothing for strategies that never hit the buggy code (they delegate to
    the original code, or build from identical shapes). Calling this before or
    after creating the strategy both work: no TensorFlow op is run.
    """
    global _status
    with _lock:
        if _status is not None:
            return _status
        mode = _mode()
        if mode == "off":
            log.info("%s=off: Keras 3 multi-worker fixes not applied.", ENV_VAR)
            _status = "disabled"
            return _status
        version = installed_keras_version()
        major = _major(version)
        if major < 3:
            _status = "not_needed"  # Keras 2 / tf-keras has neither bug.
            return _status
        check_supported(version)  # below the floor: refused, force or not
        import keras

        if keras.backend.backend() != "tensorflow":
            _status = "not_needed"  # tf.distribute is irrelevant to jax/torch.
            return _status
        if version in TESTED_KERAS_VERSIONS:
            _install()
            _status = "patched"
        else:
            bugs = upstream_bugs_present()
            if not bugs:
                log.info("Keras %s: self-check shows the bugs fixed upstream; not patching.", version)
                _status = "not_needed"
            elif mode == "force":
                log.warning(
                    "Keras %s is not among the tested versions %s; %s=force: "
                    "applying stratkit's Keras fixes at your own risk.",
                    version,
                    sorted(TESTED_KERAS_VERSIONS),
                    ENV_VAR,
                )
                _install()
                _status = "forced"
            else:
                raise _refusal(version, bugs)
        install_fit_guards()
        log.debug(
            "keras_compat.apply: %s (Keras %s, strategy %s)",
            _status,
            version,
            type(strategy).__name__ if strategy is not None else None,
        )
        return _status


# --------------------------------------------------------------------------
# Configuration guards
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# Parameter-server steps: the model's extra losses inside a StatelessScope
# --------------------------------------------------------------------------


def model_losses_override(model: Any, losses: list[Any]) -> Any:
    """A context in which `model.losses` returns `losses`.

    The parameter-server step computes its loss and metric updates inside a
    `keras.StatelessScope` (so no Keras metric variable is written, see
    `stratkit.training.ps._Metrics`). Inside one, Keras 3.15 reads the
    `add_loss` losses from the scope (empty: the forward pass ran outside it)
    and each regularized weight from the scope's state mapping (absent: it
    crashes with `'NoneType' object has no attribute 'dtype'`). Keras' own
    stateless (JAX) trainer hands the forward pass's losses to `compute_loss`
    through the private `Layer._losses_override`; this does the same with
    `model.losses` read outside the scope, so the losses and their gradients
    are exactly those of `model.fit`.
    """
    import contextlib

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


# --------------------------------------------------------------------------
# tf.data: the batch size of an already-batched dataset
# --------------------------------------------------------------------------

#: Transformations after which a dataset's elements are still batches if they were before
#: (TensorFlow 2.21 class names, leading underscores removed).
_KEEP_BATCHES = frozenset({"PrefetchDataset", "OptionsDataset", "CacheDataset", "RepeatDataset", "TakeDataset",
                           "SkipDataset", "ShuffleDataset", "FilterDataset", "MapDataset", "ParallelMapDataset",
                           "ShardDataset", "AssertCardinalityDataset", "IgnoreErrorsDataset"})


def dataset_batch_size(dataset: Any) -> int | None:
    """The batch size of a `tf.data.Dataset` whose elements are batches, else None (-1: batched, size unknown).

    `ds.batch(64).prefetch(...)` is how Keras users write input pipelines, so
    the batch is looked for upstream through transformations that keep
    elements whole (`_KEEP_BATCHES`), stopping at `unbatch`. tf.data has no
    public way to ask this: it walks the private `_input_dataset` links and
    reads `_batch_size` (`_batch_sizes` for `rebatch`). An unknown class ends
    the walk: the dataset is then taken as unbatched, as before.
    """
    node = dataset
    for _ in range(64):  # pipelines are short; never loop on a strange graph
        name = type(node).__name__.lstrip("_")
        if name == "UnbatchDataset":
            return None
        if name.endswith("BatchDataset"):  # Batch, ParallelBatch, PaddedBatch, Rebatch, MapAndBatch
            size = getattr(node, "_batch_size", getattr(node, "_batch_sizes", None))
            try:
                return int(size)
            except (TypeError, ValueError):
                return -1
        if name not in _KEEP_BATCHES:
            return None
        node = getattr(node, "_input_dataset", None)
        if node is None:
            return None
    return None


# --------------------------------------------------------------------------
# Guards for the user's own model.fit / evaluate / predict
# --------------------------------------------------------------------------
#
# Users who take only the strategy from stratkit (``make_strategy()``) and keep
# calling Keras's ``model.fit`` get the checks ``Trainer`` makes, at the one
# place every such call passes: the Keras 3 TensorFlow trainer's ``fit``,
# ``evaluate`` and ``predict``. The wrappers read only the public surface of
# those calls (their ``callbacks`` and ``verbose`` arguments, the model's
# ``distribute_strategy``). Installed by :func:`apply` (and by ``make_strategy``
# for parameter-server strategies):
#
# * ParameterServerStrategy: Keras 3 has no coordinator path, so refuse up front
#   instead of failing deep inside Keras.
# * ``steps_per_execution > 1`` with several Mirrored/MWMS replicas: refuse
#   (:func:`check_steps_per_execution`), as ``Trainer.build`` does.
# * Multi-worker MWMS (:func:`stratkit.training.callbacks.route_side_effects`):
#   on non-chief workers, file-writing Keras callbacks write to private
#   temporary directories and the progress bar is off unless the call passes
#   ``verbose=``; on every worker, callbacks whose files cannot be moved are
#   refused, and the workers check they resume a ``BackupAndRestore`` at the
#   same epoch. One process, or one worker, is left exactly as Keras does it.
#
# A second guard catches Keras metrics updated in a parameter-server step
# (``Variable.assign_add`` is ``assign(self + v)`` in Keras 3: not atomic under
# asynchronous workers, measured: accuracy 1.156).

#: What to use instead of Keras's own loops for parameter-server training.
PS_FIX = ("use stratkit.Trainer(...).fit (or the coordinator API: ClusterCoordinator.schedule with raw "
          "tf.Variable counters, see the README section 'Using make_strategy() with your own model.fit') "
          "for parameter-server training")

_FIT_METHODS = ("fit", "evaluate", "predict")
_PS_METRIC_MARK = "_stratkit_parameter_server_metric"
_guards_lock = threading.Lock()
_guard_originals: dict[str, Any] = {}
_inside_guarded_call = threading.local()


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


def _is_chief(strategy: Any) -> bool:
    """Whether this task writes the run's files (``StrategyExtended.should_checkpoint``)."""
    try:
        return bool(strategy.extended.should_checkpoint)
    except Exception:  # noqa: BLE001 - an exotic strategy: behave as the single-process default
        return True


def _guarded(name: str, original: Any) -> Any:
    """Wrap one of ``fit``/``evaluate``/``predict`` with the checks above."""
    import functools
    import inspect

    signature = inspect.signature(original)

    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_inside_guarded_call, "active", False):
            # fit's own evaluate() for validation data: the outer call already decided.
            return original(self, *args, **kwargs)
        strategy = self.distribute_strategy
        if is_parameter_server(strategy):
            raise parameter_server_refusal(f"model.{name}")
        check_steps_per_execution(self, strategy)
        temps: list[str] = []
        if _is_multi_worker_collective(strategy):
            from stratkit.training import callbacks as cb

            is_chief = _is_chief(strategy)
            bound = signature.bind(self, *args, **kwargs)
            given = bound.arguments.get("callbacks")
            if isinstance(given, (list, tuple)):
                bound.arguments["callbacks"], temps = cb.route_side_effects(given, is_chief=is_chief,
                                                                            multi_worker=True)
            if "verbose" not in bound.arguments and not is_chief:  # an explicit verbose= wins
                bound.arguments["verbose"] = cb.default_verbose(is_chief=False)
            args, kwargs = bound.args[1:], bound.kwargs
        _inside_guarded_call.active = True
        try:
            return original(self, *args, **kwargs)
        finally:
            _inside_guarded_call.active = False
            if temps:
                from stratkit.training.callbacks import remove_dirs

                remove_dirs(temps)

    setattr(method, _PATCH_MARK, True)
    return method


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


def _install_ps_metric_guard() -> None:
    """Mark metric variables created under a PS scope; refuse their in-step updates.

    Private Keras use (``Variable._direct_assign``, reached only outside a
    ``StatelessScope``): stratkit's own PS loop updates metrics statelessly and
    accumulates deltas in raw atomic ``tf.Variable`` counters, so it never gets here.
    """
    import tensorflow as tf
    from keras.src.backend.tensorflow import core
    from keras.src.metrics import metric

    add_variable = metric.Metric.__dict__["add_variable"]
    if not getattr(add_variable, _PATCH_MARK, False):
        def guarded_add_variable(self: Any, *args: Any, **kwargs: Any) -> Any:
            variable = add_variable(self, *args, **kwargs)
            if tf.distribute.has_strategy() and is_parameter_server(tf.distribute.get_strategy()):
                setattr(variable, _PS_METRIC_MARK, type(self).__name__)
            return variable

        setattr(guarded_add_variable, _PATCH_MARK, True)
        _guard_originals["Metric.add_variable"] = add_variable
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
        _guard_originals["Variable._direct_assign"] = direct_assign
        core.Variable._direct_assign = guarded_direct_assign


def install_fit_guards() -> bool:
    """Install the guards on Keras's ``fit``/``evaluate``/``predict`` (idempotent).

    Called by :func:`apply` and by ``make_strategy`` for parameter-server
    strategies. Nothing is installed with ``STRATKIT_KERAS_COMPAT=off``, on
    Keras 2 (tf-keras) or on a non-TensorFlow Keras backend. The metric guard
    touches private Keras code, so it is installed only on tested Keras
    versions (or with ``STRATKIT_KERAS_COMPAT=force``).

    Returns:
        True when the guards are in place.
    """
    with _guards_lock:
        mode = _mode()
        version = installed_keras_version()
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
        if version in TESTED_KERAS_VERSIONS or mode == "force":
            _install_ps_metric_guard()
        else:
            log.warning("Keras %s is untested: Keras metrics updated in parameter-server steps are not "
                        "checked (their updates are not atomic); %s.", version, PS_FIX)
        return True


def revert_fit_guards() -> None:
    """Remove what :func:`install_fit_guards` installed (for tests)."""
    with _guards_lock:
        if not _guard_originals:
            return
        cls = _trainer_module().TensorFlowTrainer
        for name in _FIT_METHODS:
            if name in _guard_originals:
                setattr(cls, name, _guard_originals.pop(name))
        if "Metric.add_variable" in _guard_originals:
            from keras.src.metrics import metric

            metric.Metric.add_variable = _guard_originals.pop("Metric.add_variable")
        if "Variable._direct_assign" in _guard_originals:
            from keras.src.backend.tensorflow import core

            core.Variable._direct_assign = _guard_originals.pop("Variable._direct_assign")


def resume_epoch(model: Any) -> int:
    """The epoch a `fit` about to start resumes at (set by Keras's BackupAndRestore; 0 for none).

    Private Keras use: ``BackupAndRestore`` hands the epoch to ``fit`` through
    the model's ``_initial_epoch``.
    """
    return int(getattr(model, "_initial_epoch", None) or 0)


# --------------------------------------------------------------------------
# Supported versions: the floor, the tested set, the parameter-server check
# --------------------------------------------------------------------------


def version_tuple(version: str) -> tuple[int, ...]:
    """The leading numeric parts of a version: ``"3.16.0.dev2025"`` -> ``(3, 16, 0)``."""
    parts: list[int] = []
    for piece in version.split("."):
        digits = ""
        for char in piece:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):
            break
    if not parts:
        raise KerasCompatError(f"Cannot parse the Keras version {version!r}.")
    return tuple(parts)


def _newest_tested() -> str:
    return max(TESTED_KERAS_VERSIONS, key=version_tuple)


def supported_range() -> str:
    """One phrase naming what works, for error messages and ``stratkit info``."""
    tested = ", ".join(sorted(TESTED_KERAS_VERSIONS, key=version_tuple))
    tf = ", ".join(sorted(TESTED_TENSORFLOW_VERSIONS, key=version_tuple))
    return f"Keras >= {KERAS_FLOOR} (tested: Keras {tested}; TensorFlow {tf})"


def check_supported(version: str | None = None) -> None:
    """Refuse a Keras 3 release below :data:`KERAS_FLOOR`, whatever :data:`ENV_VAR` says.

    ``make_strategy`` calls it for every strategy (``off`` skips :func:`apply`, not this).

    Keras 2 / tf-keras (major version < 3) passes: it needs no fixes. The
    refusal is not subject to ``force`` because forcing these releases is known
    to crash inside the patches or train wrong without an error.

    Raises:
        KerasCompatError: naming the installed version, the supported range and the fix.
    """
    version = installed_keras_version() if version is None else version
    if _major(version) != 3 or version_tuple(version) >= version_tuple(KERAS_FLOOR):
        return
    raise KerasCompatError(
        f"Keras {version} is installed, but stratkit supports {supported_range()}. "
        f"Keras {version} is refused even with {ENV_VAR}=force: its trainer differs from the code "
        f"stratkit's fixes replace, and forcing them is known to crash or train wrong "
        f"(Keras 3.8-3.10: wrong history metrics; 3.3: workers diverge). "
        f"Fix: pip install 'keras>={KERAS_FLOOR}' (newest tested: pip install keras=={_newest_tested()})."
    )


#: What the parameter-server loop (stratkit/training/ps.py) uses of Keras'
#: trainer, checked before training starts: class attributes, then attributes
#: Keras sets on each compiled model.
_PS_MODEL_ATTRIBUTES = ("_symbolic_build", "_compute_loss", "compute_metrics", "get_metrics_result",
                        "metrics_variables", "reset_metrics")
_PS_INSTANCE_ATTRIBUTES = ("_loss_tracker", "_call_has_training_arg")


def parameter_server_internals_missing(model: Any = None) -> list[str]:
    """The Keras internals the parameter-server loop needs that this Keras lacks (empty: all there).

    Fails closed: anything that cannot be imported or inspected counts as missing.
    ``model`` (a compiled Keras model) lets the instance attributes be checked too.
    """
    import inspect

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


def check_parameter_server(model: Any = None) -> None:
    """Refuse parameter-server training up front on a Keras it was not proved on.

    The PS loop runs on Keras internals (``_compute_loss``, ``_symbolic_build``,
    ``_loss_tracker``, ...), so it sits behind the same gate as the sync patches:
    below :data:`KERAS_FLOOR` refused in every mode; an untested version refused
    unless ``STRATKIT_KERAS_COMPAT=force`` (``off`` means "do not patch", and the PS
    loop patches nothing, so it is treated like ``auto``); and in every case the
    internals it needs must be there (:func:`parameter_server_internals_missing`),
    so an incompatible Keras fails here rather than with an ``AttributeError``
    deep inside the first scheduled step.

    Raises:
        KerasCompatError: naming the version, what is missing and the fix.
    """
    mode = _mode()
    version = installed_keras_version()
    if _major(version) != 3:
        raise KerasCompatError(
            f"Keras {version} is in use, but parameter-server training needs Keras 3 "
            f"({supported_range()}). Fix: unset TF_USE_LEGACY_KERAS and pip install keras=={_newest_tested()}."
        )
    check_supported(version)
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
