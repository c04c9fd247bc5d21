"""How a replica's loss becomes the global gradient: the one place, for every sync strategy with N > 1 replicas.

One process sees one global batch: it divides the loss sum by the batch's
count (rows, unmasked entries or weight sum), then clips, checks for overflow,
accumulates and updates. Keras 3 under ``MirroredStrategy`` and
``MultiWorkerMirroredStrategy`` does each of these per replica, on that
replica's own counts and gradient, *before* the all-reduce: an uneven last
batch, a padded sequence or ``mean_with_sample_weight`` weighs rows
differently, ``clipnorm`` lets N times the norm through, ``clipvalue`` clips
the N parts, and a loss-scale optimizer whose replicas disagree on overflow
hangs. Here, in a replica context of such a strategy:

1. **Loss** (``keras.src.losses.loss.reduce_weighted_values``): a replica's
   share is its loss *sum* divided by the *global* count, one small all-reduce
   of (count, rows) per loss term; summing the shares (what the gradient
   all-reduce does) gives one process's loss. A loss function that returned
   one scalar (its own batch mean) gets the share 1/N. ``sum`` needs no count.
2. **Gradient** (``BaseOptimizer.apply`` / ``LossScaleOptimizer.apply``): the
   gradients are all-reduced first (through Keras's own
   ``_all_reduce_sum_gradients``, so gradient compression still applies), then
   clipping, the loss scale's finiteness test and the update run on the
   global gradient, identically on every replica; the later all-reduce inside
   ``_backend_update_step`` is skipped. A None gradient (a variable the
   forward pass did not use) and a variable's new value (float8's scales and
   amax histories: their elementwise maximum over the replicas, :mod:`.float8`)
   are not summed; accumulation: :mod:`.accumulation`.
3. **Inside ``fit``/``evaluate``** (see :func:`fit_mode`) a loss reads as one
   process's: each replica's loss is N x its share (exactly one process's loss
   when the split is even; their mean is one process's loss always), the losses
   Keras adds to the compiled one (``add_loss``, regularizers) weigh N x the
   replica's share of the step's rows instead of Keras's 1/N (a replica
   without rows adds none), and the optimizer *averages* the
   all-reduced gradients. So code written for one process is exact as it is: a
   custom ``train_step`` that logs its loss, a ``compute_loss`` override that
   returns ``ops.mean(...)``, a loss function returning its batch mean. Keras's
   own loss tracker is weighted by the global row count
   (``unscale_loss_for_distribution``, which needs the step's global rows: a
   ``sum`` loss all-reduces them too, as a mean loss does); a multi-output
   model's ``<output>_loss`` trackers, which Keras weighs per replica and not
   by rows, get the value itself (its mean over the replicas is one process's).
   Outside ``fit`` (a custom training loop) Keras's convention stays: a loss is
   the replica's share, gradients are summed.
4. **Loss scaling** (``optimizer.scale_loss``, in fit): N x its share would
   make a replica's float16 backward pass run at N times one process's per-row
   magnitude and overflow at an N times lower loss scale. The loss scale
   (``LossScaleOptimizer``'s dynamic scale, ``loss_scale_factor``) is divided
   by N instead, and the optimizer then sums the all-reduced gradients rather
   than averaging them: each row's float16 gradient has one process's size
   (scale / N times N x share), the scale variable and what ``fit`` logs are
   unchanged, and a float32 run without loss scaling does not pass here (a float8
   model's does: :mod:`.float8`, 2.).

Size: over 400 lines because the four parts are one convention (a loss in fit is N x its share, the
optimizer undoes the N): splitting them would put the two halves of it in different modules.

Metric logs are synchronised by :mod:`.synced_logs`, BatchNorm's moments by
:mod:`.batchnorm`. Installed by the gate (``keras_compat.apply``) on tested
Keras versions only; :func:`self_check` says whether an untested Keras still
has what this needs.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import threading
from collections.abc import Iterator
from typing import Any

from stratkit.strategy.keras_compat import accumulation, float8
from stratkit.strategy.keras_compat.optimizer_build import build_outside_replicas
from stratkit.strategy.keras_compat.replicas import sync_replicas
from stratkit.strategy.keras_compat.versions import _PATCH_MARK

_LOSS_MODULE = "keras.src.losses.loss"
_COMPILE_UTILS_MODULE = "keras.src.trainers.compile_utils"
_TF_OPTIMIZER_MODULE = "keras.src.backend.tensorflow.optimizer"
_BASE_OPTIMIZER_MODULE = "keras.src.optimizers.base_optimizer"
_LSO_MODULE = "keras.src.optimizers.loss_scale_optimizer"
#: An optimizer wrapped by a LossScaleOptimizer: the outer one already all-reduced its gradients.
_INNER_MARK = "_stratkit_gradients_reduced_by_outer"

_lock = threading.Lock()
_originals: dict[str, Any] = {}
_local = threading.local()     # per replica thread: the all-reduce already done, the step's row counts,
                               # inside Keras's CompileLoss, optimizers whose loss scale was divided by N
_fit_depth = 0                 # > 0 while a guarded fit/evaluate runs (process-wide: replicas run in threads)


@contextlib.contextmanager
def fit_mode() -> Iterator[None]:
    """While Keras's fit/evaluate runs: loss values read as one process's (gradients unchanged)."""
    global _fit_depth
    with _lock:
        _fit_depth += 1
    try:
        yield
    finally:
        with _lock:
            _fit_depth -= 1


# ---------------------------------------------------------------------------------------------
# 1. the loss: a share of the global count
# ---------------------------------------------------------------------------------------------
def _graph() -> Any:
    import tensorflow as tf

    return tf.compat.v1.get_default_graph()


def _sum_across_replicas(count: Any, rows: Any) -> tuple[Any, Any]:
    """(global count, global rows), one all-reduce; no gradient flows through counts."""
    import tensorflow as tf

    dtype = tf.float64 if count.dtype == tf.float64 else tf.float32
    local = tf.stop_gradient(tf.stack([tf.cast(count, dtype), tf.cast(rows, dtype)]))
    total = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, local)
    _local.rows = (_graph(), total[1], tf.cast(rows, dtype))
    return total[0], total[1]


def _as_loss_value(share: Any, replicas: int) -> Any:
    """In fit: N x share, what one process computes when the split is even (gradients are averaged over
    the replicas there, see :func:`_reduced_apply`). Elsewhere the share itself (Keras's convention)."""
    return share * replicas if _fit_depth else share


def reduce_weighted_values(values: Any, sample_weight: Any = None, mask: Any = None,
                           reduction: str = "sum_over_batch_size", dtype: Any = None) -> Any:
    """Replacement for ``keras.src.losses.loss.reduce_weighted_values`` (see the module docstring, 1)."""
    original = _originals["reduce_weighted_values"]
    replicas = sync_replicas()
    if not replicas:
        return original(values, sample_weight=sample_weight, mask=mask, reduction=reduction, dtype=dtype)
    from keras.src import ops

    loss_module = importlib.import_module(_LOSS_MODULE)
    reduction = loss_module.standardize_reduction(reduction)
    values = ops.convert_to_tensor(values, dtype=dtype)
    if sample_weight is not None:
        sample_weight = ops.convert_to_tensor(sample_weight, dtype=dtype)
    valid = None
    if mask is not None:
        mask = ops.convert_to_tensor(mask, dtype=dtype)
        if reduction in ("mean", "sum_over_batch_size"):
            valid = ops.sum(ops.cast(mask, dtype=values.dtype))   # what one process divides by
        # a plain 0/1 mask: Keras's rescaling by total/valid would bake in the local count
        sample_weight = loss_module.apply_mask(sample_weight, mask, dtype=values.dtype, reduction="sum")
    if sample_weight is not None:
        sample_weight = ops.cast(sample_weight, values.dtype)
        values, sample_weight = loss_module.squeeze_or_expand_to_same_rank(values, sample_weight)
        values = values * sample_weight

    if reduction in (None, "none") or tuple(values.shape) == (0,):
        return values
    if tuple(values.shape) == ():
        # the loss function reduced its own batch already (e.g. tf.reduce_mean): Keras would leave it
        # whole on every replica, so the summed gradient would be N times one process's. Its share is 1/N
        # (in fit, where gradients are averaged, the value itself).
        return values if _fit_depth else values / replicas
    total = ops.sum(values)
    if reduction == "sum":
        if _fit_depth:      # no count to divide by, but Keras's loss tracker needs the step's global rows
            _sum_across_replicas(ops.zeros((), dtype="int32"), ops.shape(values)[0])
        return _as_loss_value(total, replicas)
    if reduction == "mean_with_sample_weight" and sample_weight is not None:
        count = ops.sum(sample_weight)
    elif valid is not None:
        count = valid
    else:
        count = ops.prod(ops.convert_to_tensor(ops.shape(values), dtype="int32"))
    global_count, _ = _sum_across_replicas(count, ops.shape(values)[0])
    share = ops.divide_no_nan(total, ops.cast(global_count, total.dtype))
    return _as_loss_value(share, replicas)


def scale_loss_for_distribution(value: Any) -> Any:
    """Replacement for Keras's, which in fit weighs only the losses Keras adds to the compiled one
    (``_aggregate_additional_loss``: ``add_loss``, activity and weight regularizers).

    In fit each is weighed by this replica's share of the step's rows, N x rows / global rows (gradients are
    averaged over the replicas): over the replicas that is the row-weighted mean of their values, which is one
    process's value both for a batch mean (a replica's own mean over its rows) and for a loss that does not
    depend on the rows (a weight regularizer: the shares sum to 1). A replica without rows adds nothing (its
    mean over no rows is NaN). Without the step's rows (no compiled loss counted them) the value stays whole:
    exact when the batch splits evenly."""
    replicas = sync_replicas()
    if not (_fit_depth and replicas):
        return _originals["scale_loss_for_distribution"](value)
    stash = getattr(_local, "rows", None)
    if stash is None or stash[0] is not _graph():
        return value
    from keras.src import ops

    _, global_rows, rows = stash
    weight = ops.cast(ops.divide_no_nan(rows * replicas, global_rows), value.dtype)
    return ops.where(ops.greater(rows, 0), value * weight, ops.zeros_like(value))


def unscale_loss_for_distribution(value: Any) -> Any:
    """Replacement for Keras's: in fit the value already reads as one process's; Keras weighs it by this
    replica's rows, so it is rescaled to count the step's global rows (exact on an uneven last batch)."""
    replicas = sync_replicas()
    if not replicas or not _fit_depth:
        return _originals["unscale_loss_for_distribution"](value)
    if getattr(_local, "in_compile_loss", 0):
        # an <output>_loss tracker: Keras weighs each replica's value alike (the batch's static size, or 1),
        # so N x share, whose mean over the replicas is one process's value, is already what it must add
        return value
    stash = getattr(_local, "rows", None)
    if stash is None or stash[0] is not _graph():
        return value
    from keras.src import ops

    _, global_rows, rows = stash
    factor = ops.divide_no_nan(global_rows, rows * replicas)
    # A replica with no rows (the last batch has fewer rows than replicas) is weighed 0 by Keras, and with
    # it the losses that do not depend on rows (weight regularizers): its part goes in unweighted (below).
    share = ops.where(ops.equal(rows, 0), ops.cast(value, global_rows.dtype) * global_rows / replicas, 0.0)
    _local.unweighted = (_graph(), share)
    return value * ops.cast(factor, value.dtype)


def _marking_compile_loss(original: Any) -> Any:
    """``CompileLoss.call`` marked on this replica thread: its unscale calls feed the per-output trackers."""
    @functools.wraps(original)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        _local.in_compile_loss = getattr(_local, "in_compile_loss", 0) + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _local.in_compile_loss -= 1

    setattr(call, _PATCH_MARK, True)
    return call


def take_unweighted_loss() -> Any:
    """What this replica's loss adds to the loss tracker's total on its own, once per step: its loss x the
    step's global rows / N where it had no rows (Keras weighs its loss by its rows, 0), else 0. None where
    :func:`unscale_loss_for_distribution` did not run in this step's graph (a custom ``train_step``)."""
    stash = getattr(_local, "unweighted", None)
    _local.unweighted = None
    if stash is None or stash[0] is not _graph():
        return None
    return stash[1]


# ---------------------------------------------------------------------------------------------
# 2. the gradient: all-reduced before clipping, loss-scale checks and the update
# ---------------------------------------------------------------------------------------------
def _scaled(grad: Any, factor: float) -> Any:
    import tensorflow as tf

    if grad is None or factor == 1.0:
        return grad
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * factor, grad.indices, grad.dense_shape)
    return grad * factor


@contextlib.contextmanager
def _gradients_reduced() -> Iterator[None]:
    """This replica thread's gradients are all-reduced already: the optimizer's later all-reduce is skipped.

    A per-thread count, never a mark on the optimizer: replica threads interleave at every ``merge_call``,
    so a flag one thread sets on a shared object and restores afterwards is another thread's flag too
    (a save-and-restore around ``merge_call`` left it set for good from the second step)."""
    _local.reduced = getattr(_local, "reduced", 0) + 1
    try:
        yield
    finally:
        _local.reduced -= 1


def _reduced_apply(original: Any) -> Any:
    @functools.wraps(original)
    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        if trainable_variables is not None and not self.built:
            trainable_variables = list(trainable_variables)       # may be a one-pass iterator
            build_outside_replicas(self, trainable_variables)      # a custom loop's first apply: see its module
        if not sync_replicas() or getattr(_local, "reduced", 0) or getattr(self, _INNER_MARK, False):
            return original(self, grads, trainable_variables)
        grads = list(grads)
        variables = list(trainable_variables) if trainable_variables is not None else (
            list(self._trainable_variables) if self.built else [None] * len(grads))
        grads = float8.agreed(grads, variables)        # float8's new scales and histories: one process's
        if self.gradient_accumulation_steps and not _fit_depth:
            # a custom loop's accumulation all-reduces at the update, as Keras does (_backend_apply_gradients)
            return original(self, float8.rounded(grads, variables), trainable_variables)
        inner = getattr(self, "inner_optimizer", None)
        if inner is not None:
            object.__setattr__(inner, _INNER_MARK, True)
        # a None gradient (a variable the forward pass did not use) stays None for the optimizer's own filter
        indices = [i for i, (g, v) in enumerate(zip(grads, variables)) if g is not None and not float8.is_overwritten(v)]
        pairs = self._all_reduce_sum_gradients([(grads[i], variables[i]) for i in indices]) if indices else []
        reduced = list(grads)
        for i, (g, _) in zip(indices, pairs):
            reduced[i] = g
        reduced = float8.rounded(reduced, variables)
        # in fit a loss value reads as one process's: the gradient is the replicas' mean, unless the loss
        # scale was divided by N already (4.)
        if _fit_depth and not _take_divided_scale(self):
            refused = float8.unscaled_refusal(self, grads, variables, sync_replicas())
            if refused is not None:
                raise refused
            for i in indices:
                reduced[i] = _scaled(reduced[i], 1.0 / sync_replicas())
        with _gradients_reduced():
            return original(self, reduced, trainable_variables)

    setattr(apply, _PATCH_MARK, True)
    return apply


def _divided_scale(original: Any) -> Any:
    """``scale_loss`` in fit on N replicas: the loss scale divided by N (see the module docstring, 4)."""
    @functools.wraps(original)
    def scale_loss(self: Any, loss: Any) -> Any:
        scaled = original(self, loss)
        replicas = sync_replicas()
        if not (_fit_depth and replicas) or (scaled is loss and not float8.present(self)):
            return scaled       # nothing scaled and no float8 state (see .float8): fit's averaging stays
        divided = getattr(_local, "divided_scale", None)
        if divided is None or divided[0] is not _graph():
            divided = _local.divided_scale = (_graph(), set())
        divided[1].add(id(self))
        return scaled / replicas

    setattr(scale_loss, _PATCH_MARK, True)
    return scale_loss


def _take_divided_scale(optimizer: Any) -> bool:
    """True once per step where ``optimizer.scale_loss`` divided its scale by N in this step's graph."""
    divided = getattr(_local, "divided_scale", None)
    if divided is None or divided[0] is not _graph() or id(optimizer) not in divided[1]:
        return False
    divided[1].discard(id(optimizer))
    return True


def _backend_update_step(self: Any, grads: Any, trainable_variables: Any, learning_rate: Any) -> Any:
    """Replacement for ``TFOptimizer._backend_update_step``: no second all-reduce of reduced gradients."""
    if not (getattr(_local, "reduced", 0) or getattr(self, _INNER_MARK, False)) or not sync_replicas():
        return _originals["_backend_update_step"](self, grads, trainable_variables, learning_rate)
    import tensorflow as tf
    from keras.src import backend

    variables = [v.value if isinstance(v, backend.Variable) else v for v in trainable_variables]
    tf.__internal__.distribute.interim.maybe_merge_call(
        self._distributed_tf_update_step, self._distribution_strategy, list(zip(grads, variables)), learning_rate)


def _backend_apply_gradients(self: Any, grads: Any, trainable_variables: Any) -> Any:
    """``TFOptimizer._backend_apply_gradients`` (Keras has only the base class's): gradient accumulation on
    N replicas, chosen in the cross-replica context (:mod:`.accumulation`)."""
    base = _originals["BaseOptimizer._backend_apply_gradients"]
    if not self.gradient_accumulation_steps or not sync_replicas():
        return base(self, grads, trainable_variables)
    arrived_reduced = bool(getattr(_local, "reduced", 0) or getattr(self, _INNER_MARK, False))
    accumulation.apply_on_replicas(self, grads, trainable_variables, arrived_reduced, _gradients_reduced)


setattr(_backend_update_step, _PATCH_MARK, True)
setattr(_backend_apply_gradients, _PATCH_MARK, True)
for _function in (reduce_weighted_values, scale_loss_for_distribution, unscale_loss_for_distribution):
    setattr(_function, _PATCH_MARK, True)


# ---------------------------------------------------------------------------------------------
# install / revert / self-check
# ---------------------------------------------------------------------------------------------
def _targets() -> list[tuple[Any, str, str, Any]]:
    """(owner, attribute, key in _originals, replacement factory or function)."""
    loss = importlib.import_module(_LOSS_MODULE)
    tf_optimizer = importlib.import_module(_TF_OPTIMIZER_MODULE).TFOptimizer
    base = importlib.import_module(_BASE_OPTIMIZER_MODULE).BaseOptimizer
    lso = importlib.import_module(_LSO_MODULE).LossScaleOptimizer
    compile_loss = importlib.import_module(_COMPILE_UTILS_MODULE).CompileLoss
    return [
        (loss, "reduce_weighted_values", "reduce_weighted_values", reduce_weighted_values),
        (loss, "scale_loss_for_distribution", "scale_loss_for_distribution", scale_loss_for_distribution),
        (loss, "unscale_loss_for_distribution", "unscale_loss_for_distribution", unscale_loss_for_distribution),
        (tf_optimizer, "_backend_update_step", "_backend_update_step", _backend_update_step),
        (tf_optimizer, "_backend_apply_gradients", "BaseOptimizer._backend_apply_gradients", _backend_apply_gradients),
        (base, "apply", "BaseOptimizer.apply", _reduced_apply),
        (lso, "apply", "LossScaleOptimizer.apply", _reduced_apply),
        (base, "scale_loss", "BaseOptimizer.scale_loss", _divided_scale),
        (lso, "scale_loss", "LossScaleOptimizer.scale_loss", _divided_scale),
        (compile_loss, "call", "CompileLoss.call", _marking_compile_loss),
        *float8.targets(),
    ]


_FACTORIES = (_reduced_apply, _divided_scale, _marking_compile_loss, float8.float8_call)


def installed() -> bool:
    """True while the replacements are in place in this process."""
    return bool(_originals)


def install() -> None:
    """Install the replacements (idempotent)."""
    with _lock:
        for owner, name, key, replacement in _targets():
            current = owner.__dict__.get(name) or getattr(owner, name)   # an inherited method: the base's
            if getattr(current, _PATCH_MARK, False):
                continue
            _originals[key] = current
            new = replacement(current) if replacement in _FACTORIES else replacement
            setattr(owner, name, new)


def uninstall() -> None:
    """Put Keras's functions back (for tests)."""
    with _lock:
        if not _originals:
            return
        for owner, name, key, _ in _targets():
            if key not in _originals:
                continue
            original = _originals.pop(key)
            if key.startswith("BaseOptimizer.") and owner.__name__ == "TFOptimizer":
                delattr(owner, name)                        # TFOptimizer had none of its own
            else:
                setattr(owner, name, original)


def self_check() -> list[str]:
    """What stops these replacements from being right on the installed Keras (empty: nothing). Fails closed."""
    problems: list[str] = []
    try:
        loss = importlib.import_module(_LOSS_MODULE)
        for name in ("reduce_values", "apply_mask", "squeeze_or_expand_to_same_rank", "standardize_reduction"):
            if not callable(getattr(loss, name, None)):
                problems.append(f"{_LOSS_MODULE}.{name} is missing")
        weighted = _originals.get("reduce_weighted_values", loss.__dict__.get("reduce_weighted_values"))
        if "reduce_weighted_values(" not in inspect.getsource(loss.Loss.__call__):
            problems.append("Loss.__call__ no longer calls reduce_weighted_values")
        if list(inspect.signature(weighted).parameters) != ["values", "sample_weight", "mask", "reduction",
                                                            "dtype"]:
            problems.append(f"reduce_weighted_values has the signature {inspect.signature(weighted)}")
        update = _originals.get("_backend_update_step",
                                importlib.import_module(_TF_OPTIMIZER_MODULE).TFOptimizer.__dict__.get(
                                    "_backend_update_step"))
        source = inspect.getsource(update)
        if "_all_reduce_sum_gradients(" not in source or "_distributed_tf_update_step" not in source:
            problems.append("TFOptimizer._backend_update_step no longer all-reduces then merges the update")
        compile_loss = importlib.import_module(_COMPILE_UTILS_MODULE).CompileLoss
        call = _originals.get("CompileLoss.call", compile_loss.__dict__.get("call"))
        if "unscale_loss_for_distribution(" not in inspect.getsource(call):
            problems.append("CompileLoss.call no longer feeds its per-output trackers through "
                            "unscale_loss_for_distribution")
    except Exception as exc:  # noqa: BLE001 - anything unexpected means "cannot verify"
        problems.append(f"self-check failed: {exc!r}")
    return problems + float8.self_check()
