"""`Trainer.save`: which worker writes, where (a local path or a store URL), and that it lands whole.

Every worker calls `Trainer.save` (a save may read synchronised variables).
The chief writes the user's path through `stratkit.storage.write_with`: a local
path through a private temporary and a rename, a store URL (``s3://``,
``gs://``, ``az://``, ...) through a local temporary uploaded as one object; the
other workers write into a private directory that is removed. A URL's store is
probed first, by the chief, and every worker learns the outcome (one small
collective), so a missing bucket or refused credentials stop every worker with
a `ConfigError` before the replica check and before anything is written.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from stratkit import storage
from stratkit.errors import ConfigError
from stratkit.strategy import scratch, store_paths

WHAT = "trainer.save"


def save(model: Any, path: str | os.PathLike[str], *, strategy: Any, is_chief: bool, check: bool,
         agree: Callable[[int], int]) -> str | None:
    """`Trainer.save`'s body (see its docstring).

    Args:
        model: the model.
        path: a `.keras` or `.weights.h5` path or URL.
        strategy: the trainer's strategy (for the replica check).
        is_chief: whether this task writes the user's file.
        check: run the replica check first (not on parameter-server training).
        agree: MIN of an int over every worker (identity on one).

    Returns:
        `path` on the chief, None on other workers.
    """
    path = os.fspath(path)
    if not path.endswith((".keras", ".weights.h5")):
        raise ConfigError(f"save path {storage.redact(path)!r} must end in .keras (whole model) or .weights.h5 "
                          "(weights). Fix: e.g. trainer.save(model, 'out/model.keras')")
    how = store_paths.route(path, WHAT)
    if how == store_paths.STORE:
        _check_store(path, is_chief, agree)
    suffix = ".weights.h5" if path.endswith(".weights.h5") else ".keras"
    if check:
        from stratkit.strategy import replica_check

        # every worker is here (see above): the same copies everywhere, or no file at all
        replica_check.check(model, strategy, when=f"before trainer.save({storage.redact(path)!r})")
    if is_chief:
        if how == store_paths.KERAS:     # gs:// without gcsfs: Keras's own tf.io.gfile, as plain Keras
            _write(model, path)
        else:                            # the user's file is never half-written, local or in a store
            storage.write_with(path, lambda tmp: _write(model, tmp), WHAT)
        return path
    private = scratch.make("stratkit-save-worker-")  # removed even if this worker is killed mid-save
    try:
        _write(model, os.path.join(private, "model" + suffix))
    finally:
        scratch.remove([private])
    return None


def _check_store(url: str, is_chief: bool, agree: Callable[[int], int]) -> None:
    """The chief probes the store `url` goes to; every worker raises if it failed (one collective)."""
    failure: ConfigError | None = None
    if is_chief:
        try:
            storage.check_store(url.rsplit("/", 1)[0], WHAT)
        except ConfigError as exc:
            failure = exc
    if agree(0 if failure is not None else 1) == 1:
        return
    if failure is not None:
        raise failure
    raise ConfigError(f"trainer.save({storage.redact(url)!r}): the chief could not write to this store (its "
                      "ConfigError says why), so no worker saves. Fix: see the chief's error")


def _write(model: Any, path: str) -> None:
    from stratkit.strategy.keras_compat import save_guards

    with save_guards.own_path():     # save() already chose the chief's path or a private one
        if path.endswith(".weights.h5"):
            model.save_weights(path, overwrite=True)
        else:
            model.save(path, overwrite=True)
