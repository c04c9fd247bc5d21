"""The version gate: which Keras releases stratkit supports, and how it refuses the others.

Keras releases below the floor are real installs (``pip install --target`` into
a cache shared with the compat suite, put first on ``PYTHONPATH`` of a child
process); versions above it are stand-ins (``installed_keras_version``
monkeypatched), because the gate's decision depends only on the version and on
the installed functions.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import REPO_ROOT, child_env

from stratkit.errors import KerasCompatError
from stratkit.strategy import keras_compat
from tools import compat

#: Below the floor, each for a different reason: 3.10 passes (step, iterator)
#: pairs to _maybe_symbolic_build; 3.3 has no _maybe_symbolic_build at all.
BELOW_FLOOR = ("3.10.0", "3.3.3")


@pytest.fixture(scope="session", params=BELOW_FLOOR)
def old_keras(request: pytest.FixtureRequest) -> Iterator[tuple[str, Path]]:
    """(version, directory holding only that Keras), installed once into the compat cache."""
    version = request.param
    target = compat.DEFAULT_CACHE / f"keras-{version}"
    if not (target / "keras" / "__init__.py").exists():   # tests install nothing (they reach only loopback)
        reason = (f"keras=={version} is not in {compat.DEFAULT_CACHE}: `make test` installs it "
                  f"(python tools/compat.py overlay)")
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    yield version, target


def _run_with(old_keras: tuple[str, Path], code: str, env: dict[str, str | None] | None = None) -> dict:
    """Run `code` in a child whose Keras is `old_keras`; return the JSON it printed last."""
    version, target = old_keras
    base = child_env(env={keras_compat.ENV_VAR: None, "TF_USE_LEGACY_KERAS": None, **(env or {})})
    base["PYTHONPATH"] = f"{target}:{base['PYTHONPATH']}"
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=base, capture_output=True,
                          text=True, timeout=240, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# One child per Keras version: TensorFlow starts once for every override and check.
GATE_CHILD = """
    import json, os
    import keras, stratkit
    from stratkit.cluster import ClusterSpec
    from stratkit.training.ps import fit_parameter_server
    from types import SimpleNamespace
    import numpy as np

    def outcome(fn):
        try:
            fn()
            return {"error": None}
        except Exception as exc:
            return {"error": type(exc).__name__, "message": str(exc)}

    # Parameter-server training as the chief of chief + 2 workers + ps would start it.
    spec = ClusterSpec(strategy="parameter_server", task_type="chief", task_index=0, num_workers=2,
                       cluster={"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"],
                                "ps": ["127.0.0.1:4"]}, is_chief=True)
    trainer = SimpleNamespace(spec=spec, strategy=None)
    data = (np.zeros((16, 4), "float32"), np.zeros((16, 1), "float32"))

    out = {"keras": keras.__version__}
    for mode in ("auto", "force", "off"):
        os.environ["STRATKIT_KERAS_COMPAT"] = mode
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        out[mode] = {
            "multi_worker": outcome(lambda: stratkit.make_strategy(strategy="multi_worker_mirrored")),
            "mirrored": outcome(lambda: stratkit.make_strategy(strategy="mirrored")),
            "one_device": outcome(lambda: stratkit.make_strategy()),  # the default on a CPU host
            "parameter_server": outcome(lambda: fit_parameter_server(trainer, model, data, epochs=1,
                                                                     steps_per_epoch=2, global_batch_size=8)),
        }
    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def gate_outcomes(old_keras: tuple[str, Path]) -> tuple[str, dict]:
    return old_keras[0], _run_with(old_keras, GATE_CHILD)


def _assert_names_the_supported_range(outcome: dict, version: str) -> None:
    assert outcome["error"] == "KerasCompatError", outcome
    message = outcome["message"]
    assert f"Keras {version} is installed" in message
    assert f">= {keras_compat.KERAS_FLOOR}" in message
    assert "3.15.1" in message  # a tested version to install
    assert "Fix:" in message


@pytest.mark.slow
def test_import_stratkit_works_on_keras_below_the_floor(gate_outcomes):
    version, out = gate_outcomes
    assert out["keras"] == version  # the child imported stratkit and ran on that Keras


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["auto", "force", "off"])
@pytest.mark.parametrize("strategy", ["multi_worker", "mirrored", "one_device"])
def test_make_strategy_refuses_keras_below_the_floor_whatever_the_override(gate_outcomes, mode, strategy):
    version, out = gate_outcomes
    _assert_names_the_supported_range(out[mode][strategy], version)
    assert "refused even with STRATKIT_KERAS_COMPAT=force" in out[mode][strategy]["message"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["auto", "force", "off"])
def test_parameter_server_training_on_a_refused_keras_fails_up_front(gate_outcomes, mode):
    version, out = gate_outcomes
    _assert_names_the_supported_range(out[mode]["parameter_server"], version)


# -------------------------------------------------------------------------------------------
# In-process: versions at or above the floor (stand-ins), the tables and their sources
# -------------------------------------------------------------------------------------------


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No override variables, no cached apply() result; Keras unpatched afterwards."""
    pytest.importorskip("keras")
    for name in (keras_compat.ENV_VAR, "TF_USE_LEGACY_KERAS"):
        monkeypatch.delenv(name, raising=False)
    keras_compat.revert()
    yield
    keras_compat.revert()


@pytest.mark.parametrize("version", ["3.10.0", "3.3.3", "3.0.0"])
def test_floor_is_not_overridable(fresh, monkeypatch, version):
    monkeypatch.setattr(keras_compat, "installed_keras_version", lambda: version)
    monkeypatch.setenv(keras_compat.ENV_VAR, "force")
    with pytest.raises(KerasCompatError, match=rf"Keras {re.escape(version)} is refused even with"):
        keras_compat.apply()
    assert keras_compat._originals == {}  # nothing patched


def test_untested_version_above_the_floor_names_the_command_that_proves_it(fresh, monkeypatch):
    monkeypatch.setattr(keras_compat, "installed_keras_version", lambda: "3.16.0")
    with pytest.raises(KerasCompatError) as info:
        keras_compat.apply()
    assert "make compat KERAS=3.16.0" in str(info.value)
    assert f">= {keras_compat.KERAS_FLOOR}" in str(info.value)


def test_parameter_server_check_passes_on_the_installed_tested_keras(fresh):
    assert keras_compat.installed_keras_version() in keras_compat.TESTED_KERAS_VERSIONS
    assert keras_compat.parameter_server_internals_missing() == []
    keras_compat.check_parameter_server()


def test_parameter_server_check_refuses_an_untested_keras_unless_forced(fresh, monkeypatch, caplog):
    monkeypatch.setattr(keras_compat, "installed_keras_version", lambda: "3.16.0")
    with pytest.raises(KerasCompatError, match="make compat KERAS=3.16.0"):
        keras_compat.check_parameter_server()
    monkeypatch.setenv(keras_compat.ENV_VAR, "force")
    keras_compat.check_parameter_server()  # the internals it needs are there
    assert "at your own risk" in caplog.text


def test_parameter_server_check_refuses_a_model_without_the_internals_it_uses(fresh):
    with pytest.raises(KerasCompatError, match="model._loss_tracker"):
        keras_compat.check_parameter_server(model=object())


def test_parameter_server_needs_keras_3(fresh, monkeypatch):
    monkeypatch.setattr(keras_compat, "installed_keras_version", lambda: "2.21.0")
    with pytest.raises(KerasCompatError, match="needs Keras 3"):
        keras_compat.check_parameter_server()


def _compat_rows() -> list[dict]:
    return json.loads(compat.DEFAULT_JSON.read_text())["rows"]


def test_tested_versions_are_exactly_the_pairs_the_compat_suite_proved():
    proved = {(r["tensorflow"], r["keras"]) for r in _compat_rows()
              if r["status"] == "pass" and r.get("gate") == "as shipped"}
    assert {k for _, k in proved} == set(keras_compat.TESTED_KERAS_VERSIONS)
    assert {t for t, _ in proved} == set(keras_compat.TESTED_TENSORFLOW_VERSIONS)
    for tf_version in keras_compat.TESTED_TENSORFLOW_VERSIONS:
        for keras_version in keras_compat.TESTED_KERAS_VERSIONS:
            assert (tf_version, keras_version) in proved, f"TF {tf_version} + Keras {keras_version} not proved"


def test_below_floor_rows_in_the_compat_table_were_refused():
    below = [r for r in _compat_rows() if r.get("kind") == "below floor"]
    assert below and all(r["status"] == "refused" for r in below)


def test_docs_supported_versions_table_is_rendered_from_the_compat_json():
    assert compat.main(["render", "--check"]) == 0


def test_dependency_bounds_match_the_gate():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    deps = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    bounds = {re.split(r"[<>=!~ ]", d, maxsplit=1)[0]: d for d in deps}
    assert bounds["keras"] == f"keras>={keras_compat.KERAS_FLOOR}"
    newest_tf = max(keras_compat.TESTED_TENSORFLOW_VERSIONS, key=keras_compat.version_tuple)
    major, minor = keras_compat.version_tuple(newest_tf)[:2]
    assert bounds["tensorflow"] == f"tensorflow>=2.16,<{major}.{minor + 1}"


def test_info_says_which_installed_versions_are_tested_without_tensorflow():
    code = ("import sys, stratkit.cli as c; rc = c.main(['info', '--json']); "
            "assert 'tensorflow' not in sys.modules, 'info imported TensorFlow'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=child_env())
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["tested"]["keras"] is (report["versions"]["keras"] in keras_compat.TESTED_KERAS_VERSIONS)
    assert set(report["tested"]) >= {"keras", "pyspark"}
    text = subprocess.run([sys.executable, "-m", "stratkit.cli", "info"], capture_output=True, text=True,
                          timeout=60, env=child_env()).stdout
    assert re.search(rf"keras\s+{re.escape(report['versions']['keras'])}\s+(tested|NOT tested)", text)
