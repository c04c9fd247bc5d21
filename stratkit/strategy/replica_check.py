"""The replica check: every replica and worker holds the same model, or the run stops before it is saved.

Synchronous data parallelism keeps one copy of every variable per replica and
relies on every update reaching every copy alike. When one does not (state a
layer assigns with ``aggregation="none"``, a custom loop that updates weights
per replica), the copies drift apart with no error, and the saved model depends
on which worker happened to be the chief. PyTorch DDP checks its parameters
once, at construction; this check runs where a model leaves training:

* at the start of ``fit``, before its first step, once every callback's
  ``on_train_begin`` and ``on_epoch_begin`` ran (a backup resumed by stratkit's
  ``Backup`` or Keras's ``BackupAndRestore`` has loaded): weights loaded on one
  worker only (``if is_chief: model.load_weights(...)``) stop the run before it
  trains an epoch on different models (one ``all_gather``, measured in
  ``docs/performance.md``);
* at the end of every epoch and at the end of ``fit`` (a callback the fit guards
  put right after BatchNormalization's averaging, so before ``ModelCheckpoint``
  and stratkit's backup write anything);
* before ``Trainer.save`` and before every backup stratkit writes;
* whenever a custom loop calls :func:`check_replicas`.

How: each replica reduces every variable it holds to two 64-bit integer
fingerprints of its bits (their sum, and a position-weighted sum: integer sums
come out the same in any order, so equal copies give equal fingerprints on any
device), and one ``all_gather`` brings every replica's fingerprints to every
replica: one collective of 16 bytes per variable per replica. Only when they
differ does a second step measure, for those variables, the largest difference
of any replica's copy from replica 0's. Every worker sees the same gathered
numbers, so every worker decides alike (no worker waits for one that raised).

Sync-on-read variables (metrics' state) and a custom loop's gradient
accumulators differ per replica by design and are not compared.

``STRATKIT_REPLICA_CHECK``: ``error`` (the default) raises
:class:`~stratkit.errors.ReplicaDivergenceError`, ``warn`` logs the same text
and goes on, ``off`` skips the check.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from stratkit.errors import ConfigError, ReplicaDivergenceError
from stratkit.strategy.keras_compat import internals, replica_state
from stratkit.strategy.keras_compat.replicas import replicas_of

log = logging.getLogger(__name__)

ENV_VAR = "STRATKIT_REPLICA_CHECK"
_MODES = ("error", "warn", "off")
#: the compiled fingerprint steps, per model: {variables' ids: tf.function}
_CACHE = "_stratkit_replica_check"
#: how many diverged variables a message lists
_LISTED = 8


def mode() -> str:
    """``error`` (default), ``warn`` or ``off``, from :data:`ENV_VAR`.

    Raises:
        ConfigError: any other value.
    """
    value = os.environ.get(ENV_VAR, "error").strip().lower() or "error"
    if value not in _MODES:
        raise ConfigError(f"{ENV_VAR}={os.environ.get(ENV_VAR)!r} is not one of {', '.join(_MODES)}. Fix: unset it "
                          f"(error: a difference between the replicas' copies stops the run before a save), or set "
                          f"{ENV_VAR}=warn (log it and go on) or {ENV_VAR}=off (no check)")
    return value


@dataclass
class Divergence:
    """One variable whose copies differ: its path, its layer, how, and the largest difference from replica 0."""

    path: str
    layer: str
    trainable: bool
    aggregation: str
    optimizer: bool
    largest: float
    replica: int


def _variables(model: Any, optimizer: Any = None) -> list[Any]:
    """What must be equal on every replica: the model's variables and its optimizer's (Keras variables)."""
    optimizers = [o for o in (getattr(model, "optimizer", None), optimizer) if o is not None]
    skipped = {id(v) for o in optimizers for v in internals.per_replica_optimizer_variables(o)}
    found: dict[int, tuple[Any, bool]] = {}
    for variable in getattr(model, "variables", ()):
        found.setdefault(id(variable), (variable, False))
    for opt in optimizers:
        if getattr(opt, "built", False):
            for variable in opt.variables:
                found.setdefault(id(variable), (variable, True))
    return [(v, is_opt) for key, (v, is_opt) in found.items()
            if key not in skipped and getattr(v, "synchronization", None) != "on_read"]


def _bits(value: Any) -> Any:
    """`value`'s elements as int64: the bits of a float, the value of an integer or bool."""
    import tensorflow as tf

    flat = tf.reshape(value, [-1])
    width = {tf.float16: tf.int16, tf.bfloat16: tf.int16, tf.float32: tf.int32, tf.float64: tf.int64}
    if flat.dtype in width:
        flat = tf.bitcast(flat, width[flat.dtype])
    elif flat.dtype.is_complex:
        flat = tf.bitcast(flat, tf.int64 if flat.dtype == tf.complex128 else tf.int32)
        flat = tf.reshape(flat, [-1])
    return tf.cast(flat, tf.int64)


def _fingerprint(value: Any) -> Any:
    """Two int64 numbers that equal copies share: the sum of the bits, and their sum weighted by position."""
    import tensorflow as tf

    bits = _bits(value)
    weights = tf.range(tf.size(bits, out_type=tf.int64), dtype=tf.int64) % 8191 + 1
    return tf.stack([tf.reduce_sum(bits), tf.reduce_sum(bits * weights)])


def _tf_value(variable: Any) -> Any:
    return getattr(variable, "value", variable)


def _gather_step(strategy: Any, variables: list[Any]) -> Any:
    import tensorflow as tf

    tf_variables = [_tf_value(v) for v, _ in variables]

    def replica() -> Any:
        prints = tf.stack([_fingerprint(tf.identity(v)) for v in tf_variables])     # [V, 2], this replica's
        return tf.distribute.get_replica_context().all_gather(prints[None], axis=0)  # [N, V, 2]

    return tf.function(lambda: strategy.run(replica))


def _difference_step(strategy: Any, variables: list[Any]) -> Any:
    import tensorflow as tf

    tf_variables = [_tf_value(v) for v, _ in variables]

    def replica() -> Any:
        context = tf.distribute.get_replica_context()
        first = tf.equal(context.replica_id_in_sync_group, 0)
        gaps = []
        for variable in tf_variables:
            mine = tf.cast(tf.identity(variable), tf.float64)
            theirs = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.where(first, mine, tf.zeros_like(mine)))
            gaps.append(tf.reduce_max(tf.concat([tf.reshape(tf.abs(mine - theirs), [-1]), [0.0]], axis=0)))
        return context.all_gather(tf.stack(gaps)[None], axis=0)      # [N, k]

    return tf.function(lambda: strategy.run(replica))


def _first_local(strategy: Any, value: Any) -> Any:
    return strategy.experimental_local_results(value)[0].numpy()


def _steps(model: Any, strategy: Any, variables: list[Any]) -> Any:
    key = tuple(id(v) for v, _ in variables)
    cache = getattr(model, _CACHE, None)
    if cache is None or cache[0] != key:
        cache = (key, _gather_step(strategy, variables))
        object.__setattr__(model, _CACHE, cache)
    return cache[1]


def find_divergences(model: Any, strategy: Any, optimizer: Any = None) -> list[Divergence]:
    """The variables whose copies differ between replicas (empty: every replica holds the same values).

    Call it in the cross-replica context, on every worker at the same point (it runs collectives).
    """
    import numpy as np

    variables = _variables(model, optimizer)
    if not variables:
        return []
    prints = _first_local(strategy, _steps(model, strategy, variables)())        # [N, V, 2]
    differs = np.nonzero((prints != prints[:1]).any(axis=(0, 2)))[0]
    if not len(differs):
        return []
    diverged = [variables[int(i)] for i in differs]
    gaps = _first_local(strategy, _difference_step(strategy, diverged)())        # [N, k]
    found = []
    for column, (variable, is_optimizer) in enumerate(diverged):
        path = str(getattr(variable, "path", None) or variable.name)
        found.append(Divergence(path=path, layer=path.rsplit("/", 1)[0] if "/" in path else "",
                                trainable=bool(getattr(variable, "trainable", False)),
                                aggregation=str(getattr(variable, "aggregation", "")), optimizer=is_optimizer,
                                largest=float(gaps[:, column].max()), replica=int(gaps[:, column].argmax())))
    return found


#: What differs before a fit's first step was not made by training: a load or an assignment on some copies only.
AT_START = ("the weights were loaded or set on some workers (or devices) only before fit, e.g. `if is_chief: "
            "model.load_weights(path)`, a variable was assigned on one device by hand, or the workers resumed from "
            "copies of a backup that differ. Fix: load (or set) the "
            "weights on every worker, each from a path it can read (the same file), after building the model in "
            "the strategy's scope")


def _likely_cause(found: list[Divergence]) -> str:
    if any(not d.trainable and not d.optimizer and d.aggregation == "none" for d in found):
        return ("state a layer assigns in a replica context with aggregation='none' keeps each replica's own value "
                f"(in fit stratkit averages such assignments unless {replica_state.ENV_VAR}=keep; in a custom loop "
                "nothing does). Fix: create the variable with aggregation='mean' (or 'sum' for a sum over rows, "
                "updated with variable.value.assign_add), or unset " + replica_state.ENV_VAR)
    if any(d.trainable or d.optimizer for d in found):
        return ("an update that reached the replicas differently: a custom loop or train_step that assigns weights "
                "per replica, or applies gradients that were not all-reduced (e.g. outside the optimizer, or "
                "with an optimizer made outside strategy.scope()). Fix: update weights through optimizer.apply / "
                "apply_gradients inside strategy.run, with the optimizer and the model made in strategy.scope()")
    return "a variable updated per replica without an aggregation that combines the replicas' values"


def describe(found: list[Divergence], when: str, replicas: int, replicas_per_worker: int,
             stopping: bool = True, cause: str | None = None) -> str:
    """The message for `found`: the variables, their layers, the largest difference, the likely cause and the fix."""
    lines = []
    for d in sorted(found, key=lambda d: -d.largest)[:_LISTED]:
        where = f"replica {d.replica}" + (f" (worker {d.replica // replicas_per_worker})" if replicas_per_worker
                                          and replicas != replicas_per_worker else "")
        kind = "optimizer variable" if d.optimizer else f"layer {d.layer!r}"
        lines.append(f"{d.path!r} ({kind}, trainable={d.trainable}, aggregation={d.aggregation!r}): largest "
                     f"difference {d.largest:.3g} between replica 0 and {where}")
    more = f" and {len(found) - _LISTED} more" if len(found) > _LISTED else ""
    return (f"the {replicas} replicas no longer hold the same model {when}: {len(found)} variable(s) differ: "
            f"{'; '.join(lines)}{more}. "
            + ("Nothing was saved at this point (each worker would save a different model). " if stopping else
               f"Training goes on ({ENV_VAR}=warn): what the chief saves is its own copy. ")
            + f"Likely cause: {cause or _likely_cause(found)}. {ENV_VAR}=warn only warns; {ENV_VAR}=off skips "
            "this check")


def _replicas_per_worker(strategy: Any) -> int:
    try:
        return max(len(strategy.extended.worker_devices), 1)
    except Exception:  # noqa: BLE001 - an exotic strategy: one replica per worker
        return 1


def check(model: Any, strategy: Any = None, *, when: str = "", optimizer: Any = None,
          cause: str | None = None) -> list[Divergence]:
    """Run the replica check on `model` (and `optimizer`) under `strategy`, as :data:`ENV_VAR` says.

    Nothing on one replica or off Mirrored/MultiWorkerMirrored strategies. Returns what differed (in ``warn``
    mode, after logging it).

    Raises:
        ReplicaDivergenceError: in ``error`` mode, when any copy differs.
    """
    if strategy is None:
        strategy = getattr(model, "distribute_strategy", None)
    replicas = replicas_of(strategy)
    if not replicas or mode() == "off":
        return []
    started = time.perf_counter()
    found = find_divergences(model, strategy, optimizer)
    log.debug("replica check %s: %d variable(s) differ (%.3f s)", when, len(found), time.perf_counter() - started)
    if not found:
        return []
    message = describe(found, when or "now", replicas, _replicas_per_worker(strategy), stopping=mode() == "error",
                       cause=cause)
    if mode() == "warn":
        log.warning("%s", message)
        return found
    raise ReplicaDivergenceError(message)


def check_replicas(model: Any, optimizer: Any = None, *, strategy: Any = None) -> None:
    """Stop if the replicas' copies of `model` (or of `optimizer`'s state) differ; for custom training loops.

    Call it outside ``strategy.run``, on every worker at the same point (it is a collective), e.g. after each
    epoch of a custom loop and before saving. ``fit`` and ``Trainer`` run it themselves at every epoch's end,
    at the end of fit, before ``Trainer.save`` and before each backup.

    Args:
        model: a Keras model built in the strategy's scope.
        optimizer: the loop's optimizer, when it is not ``model.optimizer``.
        strategy: the strategy (default: the model's ``distribute_strategy``).

    Raises:
        ReplicaDivergenceError: naming the variables, their layers, the largest difference and the likely cause
            (unless ``STRATKIT_REPLICA_CHECK`` is ``warn`` or ``off``).
    """
    check(model, strategy, when="at check_replicas()", optimizer=optimizer)


def callback(model: Any, strategy: Any) -> Any:
    """A Keras callback that checks before the first step, at every epoch's end and at the end of training."""
    import keras

    class ReplicaCheck(keras.callbacks.Callback):
        started = False

        def on_train_begin(self, logs: dict | None = None) -> None:
            self.started = False

        def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
            if not self.started:    # after every on_train_begin / on_epoch_begin: a resume has loaded
                self.started = True
                check(model, strategy, when="at the start of fit, before its first step", cause=AT_START)

        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            check(model, strategy, when=f"at the end of epoch {epoch + 1}")

        def on_train_end(self, logs: dict | None = None) -> None:
            check(model, strategy, when="at the end of fit")

    return ReplicaCheck()
