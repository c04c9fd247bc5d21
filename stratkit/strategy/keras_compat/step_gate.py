"""A train or test step whose batch never arrives changes nothing: Keras's step starts only once its batch is there.

Cause (Keras 3.11-3.15.1, TF 2.21): with ``steps_per_execution=1`` Keras's
TensorFlow trainer traces ``one_step_on_data(iterator.get_next())``: a
``tf.function`` called inside another. TensorFlow inlines the inner call, and an
inlined body waits only for the call's *control* inputs (none here), not for its
data inputs: an op of the step with no path from the batch may run as soon as
the outer step starts. When an input of unknown length runs out (``filter()``,
``from_generator``, no ``steps_per_epoch``), Keras learns it from the step whose
``get_next`` fails, once an epoch, and that step's data-free ops race the abort:
the optimizer's ``iterations`` increment (the first replica's copy + 1, assigned
on each device in the update's ``merge_call``), a ``SeedGenerator``'s state.
Measured with round 5's script (``benchmarks/tasks/unknown_length_task.py``):

* one process (Keras alone, no strategy): ``iterations`` 36 after 33 steps, one
  per epoch for a step that never trained (Adam's bias correction and every
  learning-rate schedule a step ahead; Keras's own ``steps_per_execution=2``
  path, which asks ``get_next_as_optional`` first, counts 33);
* Mirrored over 2 logical CPUs, two CPU-bound processes beside it (load
  11-29): one device's copy moved and the other's did not, and the replica check
  stopped the run (``'adam/iteration' ... largest difference 1``) in 10 of 10
  runs of 12 epochs. Keras alone moved both copies in each of 80 such steps (8
  runs of 10 epochs): the same graph, other timing;
* 2 MultiWorkerMirrored workers: both counted the extra steps, 10 of 10 runs
  (they agree on the end of the data by a collective before the step fails).

Fix: the inner call gets one control input, a ``NoOp`` that waits for every
tensor of the batch. TensorFlow's inliner hands a call's control inputs to every
op of the body that has no input of its own and to the body's inputs (the batch
and the captured variables), so nothing of the step runs before its batch is
there, on any device or worker: a step whose ``get_next`` fails runs nothing,
and ``iterations`` counts the steps that trained. One ``NoOp`` added to the
traced step; nothing inside the step changes (a control dependency inside it
would also reach the initial values of variables a step creates, which
``jit_compile`` cannot then lift: Keras's ``swap_ema_weights_test`` failed so).
Installed with the trainer fixes (:mod:`.trainer_patches`), on one device too
(``apply_one_device``): the same script counts the same steps on one device and
on N replicas.

How: Keras's ``_make_function`` keeps the inner call in a local its closures
share (``one_step_on_data``, in every tested Keras); the replacement runs
Keras's own, then puts the gated call into that shared cell, which the step
reads when it is first traced. The control edge is added to the call op once it
exists (``Operation._add_control_input``): ``tf.control_dependencies`` around the
call drops it, since the call captures the model's variables inside the block and
TensorFlow then takes the call as depending on the block already.
:func:`self_check` says whether the installed Keras still has that shape (else
nothing is installed, with a warning).
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any

from stratkit.strategy.keras_compat.versions import _PATCH_MARK

log = logging.getLogger(__name__)

_TRAINER_MODULE = "keras.src.backend.tensorflow.trainer"
#: the local of ``TensorFlowTrainer._make_function`` holding the inner call, shared by its closures
_CALL = "one_step_on_data"
_originals: dict[str, Any] = {}
#: the ops a call of a tf.function makes in the calling graph
_CALL_OPS = ("StatefulPartitionedCall", "PartitionedCall")


def batch_tensors(data: Any) -> list[Any]:
    """The graph tensors of a step's batch (tensors, composites, Optionals, None); [] in eager code."""
    import tensorflow as tf

    if tf.executing_eagerly():
        return []
    return [t for t in tf.nest.flatten(data, expand_composites=True) if isinstance(t, tf.Tensor)]


def gated(call: Any) -> Any:
    """`call` (the step on one batch), whose call op waits for the whole batch in a traced graph."""
    def call_once_the_batch_is_there(data: Any) -> Any:
        tensors = batch_tensors(data)
        if not tensors:
            return call(data)
        import tensorflow as tf

        with tf.control_dependencies(tensors):
            arrived = tf.no_op(name="batch_arrived")
        graph = tf.compat.v1.get_default_graph()
        before = len(graph.get_operations())
        outputs = call(data)
        for op in graph.get_operations()[before:]:
            if op.type in _CALL_OPS:      # the step's call (and Keras's Optional conversion makes no other op)
                op._add_control_input(arrived)
        return outputs

    setattr(call_once_the_batch_is_there, _PATCH_MARK, True)
    return call_once_the_batch_is_there


def _make_function(self: Any, step_function: Any) -> Any:
    """Replacement for ``TensorFlowTrainer._make_function``: Keras's own, its inner call gated on the batch."""
    function = _originals["_make_function"](self, step_function)
    cells = dict(zip(function.__code__.co_freevars, function.__closure__ or ()))
    cell = cells[_CALL]
    if not getattr(cell.cell_contents, _PATCH_MARK, False):
        cell.cell_contents = gated(cell.cell_contents)
    return function


setattr(_make_function, _PATCH_MARK, True)


def self_check(make_function: Any = None) -> list[str]:
    """What stops the gate from working on the installed Keras (empty: nothing). Fails closed."""
    try:
        if make_function is None:
            make_function = importlib.import_module(_TRAINER_MODULE).TensorFlowTrainer.__dict__["_make_function"]
        source = inspect.getsource(make_function)
        if _CALL not in make_function.__code__.co_cellvars or f"{_CALL}(iterator.get_next())" not in source:
            return [f"TensorFlowTrainer._make_function no longer calls {_CALL}(iterator.get_next()) through a "
                    f"local its closures share"]
        if "\n        def function(iterator)" not in source or f"outputs = {_CALL}(data)" not in source:
            return ["TensorFlowTrainer._make_function no longer returns a function that holds the step's call"]
    except Exception as exc:  # noqa: BLE001 - anything unexpected means "cannot verify"
        return [f"self-check failed: {exc!r}"]
    return []


def install() -> bool:
    """Gate Keras's step on its batch (idempotent); False, with a warning, on a Keras it cannot gate.

    Keras's ``train_function``/``test_function`` made before stay as they were (``make_train_function(force=True)``
    makes new ones).
    """
    cls = importlib.import_module(_TRAINER_MODULE).TensorFlowTrainer
    current = cls.__dict__.get("_make_function")
    if getattr(current, _PATCH_MARK, False):
        return True
    problems = self_check(current)
    if problems:
        log.warning("stratkit cannot make Keras's step wait for its batch on this Keras (%s): with an input of "
                    "unknown length, the step that meets its end may still move the optimizer's step counter",
                    "; ".join(problems))
        return False
    _originals["_make_function"] = current
    cls._make_function = _make_function
    return True


def uninstall() -> None:
    """Put Keras's ``_make_function`` back (nothing to do when ours was never installed)."""
    if "_make_function" in _originals:
        importlib.import_module(_TRAINER_MODULE).TensorFlowTrainer._make_function = _originals.pop("_make_function")
