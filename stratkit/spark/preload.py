"""What the standby imports before any run is known, and what it leaves for first use.

`preload()` imports TensorFlow, Keras, pyspark's task context and the
stratkit modules every run needs -- imports only: no TensorFlow context,
server or device, so each run's TF_CONFIG and CUDA_VISIBLE_DEVICES (set in
the forked child) still take effect.

Deferred modules. Importing Keras 3 also imports, when they are installed,
scikit-learn (for `keras.wrappers`' scikit-learn estimators) and
matplotlib's pyplot (for `keras.visualization`'s plots): 1.1 s of the
standby's 3.5 s import as `python -X importtime` counts it (TF 2.21, Keras
3.15); measured without it, the preload took 2.84 s with them and
2.12-2.25 s without, paid on the critical path of every cold run, for
features a training function rarely touches. During the preload these two
modules -- `keras.wrappers` and `matplotlib.pyplot` -- are created as
placeholders: the first attribute
access (`keras.wrappers.SKLearnClassifier`, `plt.plot`) runs the real
module, in whichever process touches it, once (other threads wait). Nothing
changes for code that uses them except when their import time is paid.
`import` statements naming them do not load them (they find the module in
`sys.modules`); a failed load raises the module's own error and leaves the
module unimported, so a later import tries again.

If a Keras version touches one of them while it is imported, the module
simply loads then: slower, never wrong.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

#: Imported by the standby before its first run.
PRELOAD = ("tensorflow", "keras", "cloudpickle", "pyspark.taskcontext", "stratkit", "stratkit.timeline",
           "stratkit.strategy.factory", "stratkit.strategy.keras_compat", "stratkit.strategy.compression",
           "stratkit.training.trainer", "stratkit.training.data", "stratkit.training.callbacks",
           "stratkit.spark.context", "stratkit.spark.data")

#: Imported during the preload only as placeholders, loaded on first use (see the module docstring).
DEFERRED = ("keras.wrappers", "matplotlib.pyplot")

#: Attributes the import system (and scans of sys.modules such as `inspect.getmodule`) read; set before the
#: module's code runs, so reading them does not load it.
_IMPORT_ATTRS = frozenset({"__class__", "__name__", "__spec__", "__loader__", "__package__", "__file__", "__cached__"})

_load_lock = threading.RLock()
_loading: dict[int, int] = {}  # id(placeholder) -> the thread running its code


def preload(deferred: Sequence[str] = DEFERRED) -> None:
    """Import `PRELOAD`, with the modules named in `deferred` left as placeholders."""
    with defer(deferred):
        for name in PRELOAD:
            try:
                __import__(name)
            except Exception:  # noqa: BLE001 - the run imports what it needs and reports its own errors
                pass


@contextmanager
def defer(names: Sequence[str]) -> Iterator[None]:
    """While inside, importing one of `names` (not yet imported) gives a placeholder loaded on first use."""
    finder = _DeferringFinder(names)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


def is_deferred(module: types.ModuleType) -> bool:
    """True while `module` is a placeholder whose code has not run yet."""
    return type(module) is _DeferredModule


class _DeferringFinder(importlib.abc.MetaPathFinder):
    def __init__(self, names: Sequence[str]) -> None:
        self.names = frozenset(names)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # not installed (the importer's ImportError stays), or a loader we cannot defer
        spec.loader = _DeferringLoader(spec.loader)
        return spec


class _DeferringLoader(importlib.abc.Loader):
    def __init__(self, real: importlib.abc.Loader) -> None:
        self.real = real

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = self.real
        module.__spec__.loader = self.real
        module.__class__ = _DeferredModule  # the code runs on the first attribute access


def _running_here(module: types.ModuleType) -> bool:
    return _loading.get(id(module)) == threading.get_ident()


class _DeferredModule(types.ModuleType):
    """A module whose code has not run; the first attribute access other than the import system's runs it."""

    def __getattribute__(self, name: str):
        if name in _IMPORT_ATTRS or _running_here(self):
            return object.__getattribute__(self, name)
        _load(self)
        return getattr(self, name)

    def __setattr__(self, name: str, value) -> None:
        if _running_here(self):  # the module's own code (or a submodule import) while it runs
            object.__setattr__(self, name, value)
            return
        _load(self)
        setattr(self, name, value)

    def __delattr__(self, name: str) -> None:
        if _running_here(self):
            object.__delattr__(self, name)
            return
        _load(self)
        delattr(self, name)

    def __dir__(self):
        _load(self)
        return dir(self)


def _load(module: types.ModuleType) -> None:
    """Run a placeholder's code once; other threads wait until it has run. On failure it stays unimported."""
    with _load_lock:
        if type(module) is not _DeferredModule or _running_here(module):
            return  # loaded meanwhile by another thread, or re-entered from the module's own code
        name = object.__getattribute__(module, "__name__")
        spec = object.__getattribute__(module, "__spec__")
        _loading[id(module)] = threading.get_ident()
        try:
            spec.loader.exec_module(module)
            object.__setattr__(module, "__class__", types.ModuleType)
        except BaseException:
            if sys.modules.get(name) is module:  # as a failed import: the next `import` tries again
                del sys.modules[name]
            parent, _, child = name.rpartition(".")
            if parent and sys.modules.get(parent) is not None and vars(sys.modules[parent]).get(child) is module:
                delattr(sys.modules[parent], child)
            raise
        finally:
            del _loading[id(module)]


__all__ = ["DEFERRED", "PRELOAD", "defer", "is_deferred", "preload"]
