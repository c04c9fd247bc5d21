"""`model.fit`'s arguments in `Trainer.fit`: each honoured as Keras does, or refused with the alternative.

Users port `model.fit(x, y, batch_size=..., validation_split=..., class_weight=...)`
calls; `Trainer.fit(model, data, ...)` takes every argument of Keras 3's `fit`:

* `x` is `data`; `y=` and `sample_weight=` join array data as `(x, y, sample_weight)`;
* `batch_size` is the global batch (what it means in `model.fit` under a
  strategy), the same as `global_batch_size`;
* `validation_split` holds out the last fraction of the arrays, before any
  shuffling (Keras's rule: `floor(n * (1 - split))` rows train);
* `class_weight`, `initial_epoch`, `validation_freq`, `validation_batch_size`
  are passed on to Keras's `fit` (synchronous strategies);
* anything else is a `ConfigError` naming the accepted arguments (not
  Python's bare "unexpected keyword argument").

Imports no TensorFlow.
"""

from __future__ import annotations

import math
from typing import Any

from stratkit.errors import ConfigError

#: Trainer.fit's own keywords and model.fit's, for the message about an unknown one.
ACCEPTED = ("epochs", "steps_per_epoch", "validation_data", "global_batch_size", "per_replica_batch_size",
            "batch_size", "backup_dir", "callbacks", "scale_learning_rate", "warmup_epochs", "verbose",
            "validation_steps", "shuffle", "validation_split", "class_weight", "sample_weight", "y",
            "initial_epoch", "validation_freq", "validation_batch_size")


def refuse_unknown(others: dict[str, Any]) -> None:
    """A `ConfigError` for keywords `Trainer.fit` does not take (none: nothing happens)."""
    if not others:
        return
    if "x" in others:
        raise ConfigError("Trainer.fit takes x as data, its second argument, not as x=. Fix: "
                          "trainer.fit(model, (x, y), ...) or trainer.fit(model, x, y=y, ...)")
    name = sorted(others)[0]
    raise ConfigError(f"Trainer.fit got an unexpected keyword argument {name!r}. Fix: one of "
                      f"{', '.join(ACCEPTED)}")


def check_epochs(epochs: Any) -> None:
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        if hasattr(epochs, "shape") and hasattr(epochs, "dtype"):
            raise ConfigError("epochs must be a positive integer: got an array (trainer.fit(model, x, y) puts y "
                              "in epochs). Fix: pass (x, y) as data: trainer.fit(model, (x, y), ...), or y=y")
        raise ConfigError(f"epochs must be a positive integer: got {epochs!r}. Fix: e.g. epochs=3")


def merge_batch_size(batch_size: int | None, global_batch_size: int | None) -> int | None:
    """model.fit's `batch_size` (the global batch under a strategy) as `global_batch_size`."""
    if batch_size is None:
        return global_batch_size
    if global_batch_size is not None and global_batch_size != batch_size:
        raise ConfigError(f"batch_size={batch_size!r} and global_batch_size={global_batch_size!r} disagree "
                          "(batch_size is model.fit's name for the global batch). Fix: give one of them")
    return batch_size


def _is_arrays(data: Any) -> bool:
    """Array data as Trainer takes it: an array (or dict of arrays), or a tuple of them."""
    parts = data if isinstance(data, (tuple, list)) else (data,)
    for part in parts:
        leaves = list(part.values()) if isinstance(part, dict) else [part]
        if not leaves or not all(hasattr(leaf, "shape") and hasattr(leaf, "dtype") for leaf in leaves):
            return False
    return True


def join_arrays(data: Any, y: Any, sample_weight: Any) -> Any:
    """`data` with model.fit's `y=` and `sample_weight=` joined: `(x, y, sample_weight)`."""
    if y is None and sample_weight is None:
        return data
    kind = type(data).__name__
    if not _is_arrays(data):
        given = "y" if y is not None else "sample_weight"
        raise ConfigError(f"{given} is given with data of type {kind}: it joins array data only (as in "
                          "model.fit). Fix: put the targets and sample weights in the dataset's elements: "
                          "(x, y) or (x, y, sample_weight)")
    parts = list(data) if isinstance(data, (tuple, list)) else [data]
    if y is not None:
        if len(parts) > 1:
            raise ConfigError("y is given, and data already holds y (data is a tuple (x, y, ...)). Fix: give them "
                              "once: trainer.fit(model, (x, y), ...) or trainer.fit(model, x, y=y, ...)")
        parts.append(y)
    if sample_weight is not None:
        if len(parts) == 3:
            raise ConfigError("sample_weight is given, and data already holds sample weights (data is "
                              "(x, y, sample_weight)). Fix: give them once")
        if len(parts) != 2:
            raise ConfigError("sample_weight is given without targets. Fix: pass (x, y) as data, or y=y")
        parts.append(sample_weight)
    return tuple(parts)


def check_class_weight(class_weight: Any, data: Any) -> None:
    if class_weight is None:
        return
    if not isinstance(class_weight, dict):
        raise ConfigError(f"class_weight must be a dict {{class index: weight}}: got {type(class_weight).__name__}. "
                          "Fix: e.g. class_weight={0: 1.0, 1: 3.0}")
    if isinstance(data, (tuple, list)) and len(data) == 3:
        raise ConfigError("class_weight and sample weights were both given (data is (x, y, sample_weight)); "
                          "Keras applies one of them. Fix: fold the class weights into the sample weights, or "
                          "drop one")


def split_validation(data: Any, validation_split: Any, validation_data: Any) -> tuple[Any, Any]:
    """(train, validation) after model.fit's `validation_split`: the last fraction of the arrays, unshuffled."""
    if not validation_split:
        return data, validation_data
    if isinstance(validation_split, bool) or not isinstance(validation_split, (int, float)) \
            or not 0 <= validation_split < 1:
        raise ConfigError(f"validation_split must be a number in [0, 1): got {validation_split!r}. "
                          "Fix: e.g. validation_split=0.2 (the last 20% of the arrays)")
    if validation_data is not None:
        raise ConfigError(f"both validation_split={validation_split} and validation_data were given (model.fit "
                          "would ignore validation_split). Fix: give one of them")
    if not _is_arrays(data):
        held_out = ("TableInput(<a held-out table>) instead (another directory or table, or a filter= on a "
                    "partition column: Table.parquet(path, filter=[(\"split\", \"=\", \"val\")]))"
                    if type(data).__name__ == "TableInput" else
                    "<a held-out dataset> instead (e.g. dataset.take(n) / dataset.skip(n))")
        raise ConfigError(f"validation_split={validation_split} splits arrays only (as in model.fit), but data is "
                          f"{_kind(data)}. Fix: pass validation_data={held_out}")
    parts = tuple(data) if isinstance(data, (tuple, list)) else (data,)
    first = parts[0]
    rows = len(next(iter(first.values())) if isinstance(first, dict) else first)
    split_at = int(math.floor(rows * (1.0 - validation_split)))
    if split_at in (0, rows):
        raise ConfigError(f"validation_split={validation_split} of {rows} examples leaves "
                          f"{'no training' if split_at == 0 else 'no validation'} example. Fix: pass more data, or "
                          "another validation_split")

    def cut(start: int, end: int) -> tuple:
        return tuple({k: v[start:end] for k, v in p.items()} if isinstance(p, dict) else p[start:end] for p in parts)

    train, held_out = cut(0, split_at), cut(split_at, rows)
    return (train if len(train) > 1 else train[0]), held_out


def _kind(data: Any) -> str:
    name = type(data).__name__
    if name.endswith("Dataset") or "DatasetV" in name:
        return "a tf.data.Dataset"
    return f"a {name}"


def refuse_on_parameter_servers(*, class_weight: Any, initial_epoch: int, validation_freq: Any,
                                validation_batch_size: Any) -> None:
    """The `model.fit` arguments the parameter-server loop does not take, each with its alternative."""
    if class_weight is not None:
        raise ConfigError("class_weight is not supported by parameter-server training. Fix: pass sample weights "
                          "as data: (x, y, sample_weight) with sample_weight = the class weight of each row")
    if initial_epoch:
        raise ConfigError(f"initial_epoch={initial_epoch} is not supported by parameter-server training. Fix: pass "
                          "backup_dir=...: a restarted run resumes at the epoch it reached")
    if validation_freq != 1:
        raise ConfigError(f"validation_freq={validation_freq!r} is not supported by parameter-server training "
                          "(the chief validates after every epoch). Fix: drop validation_freq")
    if validation_batch_size is not None:
        raise ConfigError(f"validation_batch_size={validation_batch_size!r} is not supported by parameter-server "
                          "training (validation uses the global batch). Fix: drop validation_batch_size, or pass "
                          "validation_data as a dataset batched as you want it")


def check_elastic(environ: Any, global_batch_size: int | None, per_replica_batch_size: int | None,
                  num_replicas: int, num_workers: int, scale_learning_rate: bool = False) -> None:
    """Under `stratkit launch --nnodes MIN:MAX` (STRATKIT_ELASTIC="MIN:MAX" workers): the global batch is kept.

    The per-replica batch is global / replicas in each round, so the math is
    one process's with that global batch at every world size. Refused, before
    step 1 of the round that would break it: a per-replica batch alone (the
    global batch would move with the world size, as under torchrun or Horovod
    Elastic), scale_learning_rate (it multiplies the rate by the replica
    count), and a global batch this round's replicas do not divide.
    """
    from stratkit.cluster.environments.tf_config import ELASTIC_VAR

    text = (environ.get(ELASTIC_VAR) or "").strip()
    low, _, high = text.partition(":")
    if not (low.isdigit() and high.isdigit()):
        return
    per_worker = max(num_replicas // max(num_workers, 1), 1)
    sizes = [w * per_worker for w in range(int(low), int(high) + 1)]
    fit = math.lcm(*sizes)
    if per_replica_batch_size is not None and global_batch_size is None:
        now = per_replica_batch_size * num_replicas
        raise ConfigError(f"per_replica_batch_size={per_replica_batch_size} under an elastic launch (--nnodes "
                          f"MIN:MAX, {low} to {high} workers): the global batch would change with the world size, and "
                          f"the run would not be the one you would have had. Fix: pass global_batch_size=N instead, "
                          f"with N divisible by every replica count {sizes} (a multiple of {fit}), e.g. "
                          f"global_batch_size={now - now % fit or fit}")
    if scale_learning_rate:
        raise ConfigError(f"scale_learning_rate=True multiplies the learning rate by the replica count, which changes "
                          f"with the world size of an elastic launch (--nnodes MIN:MAX, {low} to {high} workers), while "
                          "the global batch stays the same. Fix: drop scale_learning_rate and compile the model with "
                          "the learning rate for your global batch")
    if global_batch_size is not None and global_batch_size % num_replicas:
        lower = global_batch_size - global_batch_size % fit
        raise ConfigError(f"global_batch_size={global_batch_size} does not split over the {num_replicas} replicas "
                          f"of this round of the elastic launch (--nnodes MIN:MAX: {low} to {high} workers; the world "
                          f"size changed). Refused before its first step: backup_dir still holds the last epoch. Fix: "
                          f"a global batch divisible by every replica count {sizes}: {lower or fit} or {lower + fit}, "
                          "and start again (the backup resumes)")
