"""Deferred imports of the standby's preload (`stratkit.spark.preload.defer`), on small modules written here.

Each test imports its own uniquely named modules from tmp_path, so nothing leaks into other tests.
"""

from __future__ import annotations

import importlib
import sys
import threading
import time
import uuid

import pytest

from stratkit.spark import preload


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """Write modules under a unique package on sys.path; return (package name, writer)."""
    package = "deferred_" + uuid.uuid4().hex[:10]
    root = tmp_path / package
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "counter.py").write_text("runs = []\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, body: str) -> str:
        root.joinpath(*name.split(".")).with_suffix(".py").write_text(body)
        return f"{package}.{name}"

    yield package, write
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        del sys.modules[name]


def test_an_import_statement_gives_a_placeholder_whose_code_runs_on_first_attribute_access(modules):
    package, write = modules
    slow = write("slow", f"from {package} import counter\ncounter.runs.append('slow')\nVALUE = 42\n")
    with preload.defer([slow]):
        importlib.import_module(slow)
        module = sys.modules[slow]
        importlib.import_module(slow)  # a second import statement does not load it either
    counter = importlib.import_module(f"{package}.counter")
    assert preload.is_deferred(module) and counter.runs == []
    assert module.VALUE == 42 and counter.runs == ["slow"] and not preload.is_deferred(module)
    assert module.VALUE == 42 and counter.runs == ["slow"]  # once


def test_scanning_sys_modules_for_files_does_not_load_it(modules):
    """`inspect.getmodule` (TensorFlow's autograph calls it) walks sys.modules reading __name__ and __file__."""
    import inspect

    package, write = modules
    slow = write("slow", f"from {package} import counter\ncounter.runs.append('slow')\n")
    with preload.defer([slow]):
        module = importlib.import_module(slow)
    code = compile("pass", "/nowhere/not-a-module.py", "exec")
    assert inspect.getmodule(code) is None
    assert preload.is_deferred(module) and module.__file__.endswith("slow.py")
    assert importlib.import_module(f"{package}.counter").runs == []


def test_from_import_of_a_name_loads_it_and_other_modules_import_normally(modules):
    package, write = modules
    slow = write("slow", f"from {package} import counter\ncounter.runs.append('slow')\nVALUE = 7\n")
    other = write("other", f"from {package} import counter\ncounter.runs.append('other')\n")
    with preload.defer([slow]):
        importlib.import_module(other)  # not deferred: runs at once
        namespace: dict = {}
        exec(f"from {slow} import VALUE", namespace)
    counter = importlib.import_module(f"{package}.counter")
    assert namespace["VALUE"] == 7 and counter.runs == ["other", "slow"]


def test_threads_touching_it_at_once_run_its_code_once_and_all_see_it_complete(modules):
    package, write = modules
    slow = write("slow", f"import time\nfrom {package} import counter\ncounter.runs.append('slow')\n"
                         "time.sleep(0.3)\nVALUE = 'done'\n")
    with preload.defer([slow]):
        module = importlib.import_module(slow)
    seen, start = [], threading.Barrier(4)

    def touch():
        start.wait()
        seen.append(module.VALUE)  # AttributeError here if a thread saw the module half-run

    threads = [threading.Thread(target=touch) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert seen == ["done"] * 4 and importlib.import_module(f"{package}.counter").runs == ["slow"]


def test_a_module_that_fails_raises_its_own_error_and_a_later_import_tries_again(modules):
    package, write = modules
    broken = write("broken", "raise RuntimeError('broken at import')\n")
    with preload.defer([broken]):
        module = importlib.import_module(broken)
    with pytest.raises(RuntimeError, match="broken at import"):
        module.anything  # noqa: B018
    assert broken not in sys.modules and not hasattr(sys.modules[package], "broken")
    write("broken", "VALUE = 'fixed'\n")
    importlib.invalidate_caches()
    assert importlib.import_module(broken).VALUE == "fixed"


def test_a_module_that_is_not_installed_still_raises_import_error():
    name = "no_such_module_" + uuid.uuid4().hex[:8]
    with preload.defer([name]), pytest.raises(ImportError):
        importlib.import_module(name)


def test_the_finder_is_gone_after_the_block(modules):
    package, write = modules
    slow = write("slow", "VALUE = 1\n")
    with preload.defer([slow]):
        pass
    assert not preload.is_deferred(importlib.import_module(slow))
    assert not any(type(f).__name__ == "_DeferringFinder" for f in sys.meta_path)


@pytest.mark.slow
def test_the_standby_preload_leaves_scikit_learn_and_pyplot_for_first_use_and_both_then_work(tmp_path):
    """The real preload (TensorFlow, Keras 3) in a new interpreter, as the standby runs it."""
    import os
    import subprocess

    code = (
        "import sys, time\n"
        "from stratkit.spark import preload\n"
        "preload.preload()\n"
        "assert 'tensorflow' in sys.modules and 'keras' in sys.modules and 'pyspark.taskcontext' in sys.modules\n"
        "assert 'sklearn' not in sys.modules, 'scikit-learn was imported by the preload'\n"
        "assert 'matplotlib.figure' not in sys.modules, 'pyplot ran in the preload'\n"
        "import keras, sklearn.base\n"
        "assert issubclass(keras.wrappers.SKLearnClassifier, sklearn.base.BaseEstimator)\n"
        "import numpy as np, matplotlib\n"
        "matplotlib.use('Agg')\n"
        "figure = keras.visualization.plot_image_gallery(np.zeros((2, 8, 8, 3)), rows=1, cols=2)\n"
        "import matplotlib.pyplot as plt\n"
        "assert plt.get_backend().lower() == 'agg', plt.get_backend()\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.stdout[-2000:], done.stderr[-3000:])
