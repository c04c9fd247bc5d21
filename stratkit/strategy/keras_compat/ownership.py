"""Whose files stratkit routes: the one rule, for every world size.

stratkit routes a user's paths (the file-writing callbacks of ``fit``, in
`stratkit.strategy.side_effects`; ``model.save``/``save_weights``/``export``, in
:mod:`.save_guards`) for a model whose strategy is one ``make_strategy`` built
(``Trainer`` builds its strategy with it): one device, Mirrored over one or
several local devices, MultiWorkerMirrored on one or N workers alike. So a
store URL (``s3://``, ``az://``, ...) works at N = 1 as it does on N workers,
and the script a user develops on one process scales out unchanged.

Also routed: a MultiWorkerMirroredStrategy of several workers that stratkit
did not build, once its patches are installed (``keras_compat.apply()`` called
by hand): there, every worker saving one path races, and routing is what
keeps the files whole.

Never routed: a model without a strategy, or under a strategy the user built
on one process. Plain Keras in the same process keeps Keras's own behaviour,
although the guards wrap Keras's classes.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from stratkit.strategy.keras_compat.trainer_patches import _is_multi_worker_collective

_lock = threading.Lock()
#: the strategies `make_strategy` built (weak: a strategy the user dropped is not kept alive)
_MADE: weakref.WeakSet[Any] = weakref.WeakSet()


def adopt(strategy: Any) -> Any:
    """Mark `strategy` as built by stratkit (``make_strategy`` calls it); returns `strategy`."""
    with _lock:
        _MADE.add(strategy)
    return strategy


def routes_files(strategy: Any) -> bool:
    """Whether stratkit routes the paths of a model trained or saved under `strategy` (see the module docstring).

    Args:
        strategy: the model's ``distribute_strategy`` (None: no strategy).

    Returns:
        True for a strategy ``make_strategy`` built, at any world size, and for a multi-worker
        MultiWorkerMirroredStrategy; False otherwise (TensorFlow's default strategy included).
    """
    if strategy is None:
        return False
    try:
        with _lock:
            if strategy in _MADE:
                return True
    except TypeError:      # an object that cannot be hashed is no strategy make_strategy built
        pass
    return _is_multi_worker_collective(strategy)


__all__ = ["adopt", "routes_files"]
