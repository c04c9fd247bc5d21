"""``model.save``/``save_weights``/``export`` of a model under a stratkit strategy: whole files, store URLs.

Measured (TF 2.21, Keras 3.15.1, 2 MWMS workers, one shared directory): the
chief crashed in MergeV2Checkpoints in 3 of 6 runs, h5py could not lock the
file, once a SavedModel did not load. TF's own advice is that every worker
calls save (a save can read synchronised variables), so each still writes, but:

every worker writes the path it was given, atomically: a file through
``files.write_with`` (a private temporary, fsync, rename), an export directory
through ``files.replace_dir_with``. Workers that share a path replace it whole,
one after the other (their models are the same). A non-chief worker is not
redirected: TensorFlow's tutorials have it save to its own temporary path and
load that back.

For every model whose strategy stratkit routes (:func:`.ownership.routes_files`:
one ``make_strategy`` built, on one process as on N workers; one process is its
own chief), and only for a path (not ``overwrite=False``, not a sharded or
unzipped save: Keras's own method). A model without a stratkit strategy (plain
Keras in the same process) gets Keras's own method, untouched.

A store URL (``s3://``, ``gs://``, ``az://``, ...; `stratkit.strategy.store_paths`
decides) never becomes a local directory named after its scheme, and never
reaches ``tf.io.gfile`` (which knows no ``s3://``): the chief saves to a local
temporary and uploads it whole through `stratkit.storage` (after a probe: a
missing bucket or refused credentials are a `ConfigError` before anything is
written); the other workers save to a private directory that is removed, so
nothing of theirs reaches the store. A URL that only ``tf.io.gfile`` reaches
(``gs://`` without gcsfs) is Keras's own save, on every worker, as plain Keras
does it.
What Keras prints while it writes (``export``'s "Saved artifact at '...'")
named the private temporary a user then looked for; it is held back while
Keras writes, and printed once the path is in place, naming the path the user
gave (:func:`_said_after`; Keras's ``io_utils.print_msg``, swapped for the
writing thread while it writes).
Wraps the public methods of ``keras.Model``; installed by ``keras_compat.apply`` and ``apply_one_device``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
import threading
from typing import Any

from stratkit.strategy.keras_compat import ownership
from stratkit.strategy.keras_compat.trainer_patches import _is_chief
from stratkit.strategy.keras_compat.versions import _PATCH_MARK

_METHODS = ("save", "save_weights", "export")
_lock = threading.Lock()
_originals: dict[str, Any] = {}
_inside = threading.local()


@contextlib.contextmanager
def own_path() -> Iterator[None]:
    """Saves inside this block write where they are told: stratkit's own per-worker files (backups, a
    Trainer.save that already chose chief-or-private) are not the users' shared path."""
    before = getattr(_inside, "active", False)
    _inside.active = True
    try:
        yield
    finally:
        _inside.active = before


def _atomic(name: str, path: str, kwargs: dict[str, Any]) -> bool:
    """Whether the chief's write of `path` can go through a temp sibling (one file or one export directory)."""
    if kwargs.get("overwrite", True) is False:
        return False  # Keras asks the user first: leave it to Keras
    if name == "export":
        return True
    if name == "save_weights":
        return path.endswith(".weights.h5") and kwargs.get("max_shard_size") is None
    return (path.endswith(".keras") and kwargs.get("zipped", None) is not False) or path.endswith(".h5")


def _guarded(name: str, original: Any) -> Any:
    @functools.wraps(original)
    def method(self: Any, filepath: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_inside, "active", False) or not isinstance(filepath, (str, os.PathLike)):
            return original(self, filepath, *args, **kwargs)
        strategy = getattr(self, "distribute_strategy", None)
        if not ownership.routes_files(strategy):     # plain Keras: Keras's own save
            return original(self, filepath, *args, **kwargs)
        from stratkit.strategy import store_paths

        path = os.fspath(filepath)
        how = store_paths.route(path, f"model.{name}")   # a URL nothing can open: ConfigError, nothing written
        if how == store_paths.KERAS:
            return original(self, filepath, *args, **kwargs)   # gs:// without gcsfs: tf.io.gfile, as plain Keras
        _inside.active = True  # save_weights inside save, export's own saves: decided once, here
        try:
            if how == store_paths.STORE:
                return _to_store(name, original, self, path, strategy, args, kwargs)
            path = store_paths.local(path, f"model.{name}")
            # Every worker writes the path it was given (TF's tutorials have each non-chief worker save to its
            # own temporary path and load it back), always through a private temporary and a rename: workers
            # that share a path replace it whole, one after the other, never a mix or a half-written file.
            if not _atomic(name, path, kwargs):
                return original(self, path, *args, **kwargs)
            from stratkit import files

            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            write = files.replace_dir_with if name == "export" else files.write_with
            return _written(write, path, lambda tmp: original(self, tmp, *args, **kwargs))
        finally:
            _inside.active = False

    setattr(method, _PATCH_MARK, True)
    return method


def _written(write: Any, path: str, save: Any) -> Any:
    """`write(path, into)` with Keras's `save(tmp)` as the writer; what Keras said names `path`, not `tmp`."""
    result: list[Any] = []
    temporary: list[str] = []

    def into(tmp: str) -> None:
        temporary.append(tmp)
        result.append(save(tmp))

    with _said_after(lambda message: message.replace(temporary[0], path) if temporary else message):
        write(path, into)
    return result[0] if result else None


def _to_store(name: str, original: Any, model: Any, url: str, strategy: Any, args: tuple, kwargs: dict) -> Any:
    """A save to a store URL: the chief (one process: itself) uploads it whole, the other workers save privately.

    Every worker still saves (a save may read synchronised variables); only the
    chief's file reaches the store, as one object (a SavedModel or a sharded
    save: its files, the index last), after a probe that turns a missing bucket
    or refused credentials into a `ConfigError` before Keras writes anything.
    """
    from stratkit import storage
    from stratkit.strategy import scratch

    parent, base = url.rsplit("/", 1)
    if kwargs.get("overwrite", True) is False and storage.open_store(parent).exists(base) and \
            not _io_utils().ask_to_proceed_with_overwrite(url):   # what Keras asks before replacing a file
        return None
    if not _is_chief(strategy):
        private = scratch.make("stratkit-save-worker-")
        try:
            return original(model, os.path.join(private, storage.basename(url)), *args, **kwargs)
        finally:
            scratch.remove([private])
    storage.check_store(parent, f"model.{name}")
    write = storage.replace_dir_with if name == "export" else storage.write_with
    return _written(lambda path, into: write(path, into, f"model.{name}"), url,
                    lambda tmp: original(model, tmp, *args, **kwargs))


def _io_utils() -> Any:
    from keras.src.utils import io_utils

    return io_utils


@contextlib.contextmanager
def _said_after(rename: Any) -> Iterator[None]:
    """What Keras prints in this thread inside the block is printed at its end, through `rename`, if it succeeds."""
    io_utils = _io_utils()
    say = io_utils.print_msg
    owner = threading.get_ident()
    held: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def hold(message: Any, *args: Any, **kwargs: Any) -> None:
        if threading.get_ident() != owner:
            return say(message, *args, **kwargs)
        held.append(((str(message), *args), kwargs))
        return None

    io_utils.print_msg = hold
    try:
        yield
    finally:
        io_utils.print_msg = say
    for (message, *args), kwargs in held:  # only after the write succeeded: the path now holds it
        say(rename(message), *args, **kwargs)


#: staging path -> the URL it stands in for, in what Keras prints (`name_in_messages`).
_names: dict[str, str] = {}
_plain_say: list[Any] = []


def name_in_messages(local: str, url: str | None) -> None:
    """What Keras prints (``ModelCheckpoint``'s "saving model to ...") names `url` where it would name the
    staging path `local` (`stratkit.strategy.store_callbacks`); `url=None` forgets `local`."""
    io_utils = _io_utils()
    with _lock:
        if url is None:
            _names.pop(local, None)
        else:
            _names[local] = url
        if _names and not _plain_say:
            say = io_utils.print_msg
            _plain_say.append(say)

            def renamed(message: Any, *args: Any, **kwargs: Any) -> Any:
                text = str(message)
                for staged, shown in list(_names.items()):
                    text = text.replace(staged, shown)
                return say(text, *args, **kwargs)

            io_utils.print_msg = renamed
        elif not _names and _plain_say:
            io_utils.print_msg = _plain_say.pop()


def install() -> None:
    """Wrap ``keras.Model.save``/``save_weights``/``export`` (idempotent)."""
    import keras

    with _lock:
        for name in _METHODS:
            current = getattr(keras.Model, name)
            if not getattr(current, _PATCH_MARK, False):
                _originals[name] = keras.Model.__dict__.get(name)
                setattr(keras.Model, name, _guarded(name, current))


def revert() -> None:
    """Give ``keras.Model`` its own methods back (for tests)."""
    import keras

    with _lock:
        for name, original in list(_originals.items()):
            if original is None:
                delattr(keras.Model, name)
            else:
                setattr(keras.Model, name, original)
            del _originals[name]
