"""The parameter-server loop's private Keras/TensorFlow uses: all in `strategy/keras_ps.py`, all gated.

The loop drives Keras' trainer internals; each use is one function in
`keras_ps`, checked before training starts (`keras_ps.check`) and failing
closed with a `KerasCompatError` when Keras moved it. The training code
itself touches no private Keras or TensorFlow name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from stratkit.errors import KerasCompatError
from stratkit.strategy import keras_ps

ROOT = Path(__file__).resolve().parents[2] / "stratkit"
# The training modules this rule covers (backup.py and callbacks.py move theirs through the gate separately).
TRAINING = [*sorted((ROOT / "training" / "ps").glob("*.py")), *sorted((ROOT / "training" / "inputs").glob("*.py")),
            ROOT / "training" / "trainer.py", ROOT / "training" / "data.py"]


def private_uses(path: Path) -> list[str]:
    """`keras.src` imports and `obj._name` accesses (not `self._x`/`cls._x`, not dunders) in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("keras.src", "tensorflow.python")):
            found.append(f"{path.name}:{node.lineno} from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [f"{path.name}:{node.lineno} import {a.name}" for a in node.names
                      if a.name.startswith(("keras.src", "tensorflow.python"))]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "setattr") \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                and str(node.args[1].value).startswith("_"):
            found.append(f"{path.name}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    return found


def test_the_training_code_touches_no_private_keras_or_tensorflow_name():
    assert len(TRAINING) > 10
    assert [use for path in TRAINING for use in private_uses(path)] == []


def test_the_scan_sees_private_uses(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from keras.src.losses.loss import x\nmodel._compute_loss()\nself._ok = getattr(m, '_x')\n")
    assert sorted(private_uses(sample)) == ["sample.py:1 from keras.src.losses.loss import ...",
                                            "sample.py:2 ._compute_loss", "sample.py:3 getattr(..., '_x')"]


def test_the_gate_passes_on_the_installed_tested_keras():
    pytest.importorskip("keras")
    assert keras_ps.internals_missing() == []
    keras_ps.check()


def test_the_gate_refuses_a_model_without_the_internals_the_loop_uses():
    pytest.importorskip("keras")
    with pytest.raises(KerasCompatError, match="model._loss_tracker"):
        keras_ps.check(model=object())


@pytest.mark.parametrize(("call", "missing"), [
    (lambda: keras_ps.call_model(object(), None, training=True), "_call_has_training_arg"),
    (lambda: keras_ps.compute_loss(object(), None, None, None, None, training=True), "Model._compute_loss"),
    (lambda: keras_ps.dataset_graph(object()), "_variant_tensor"),
])
def test_each_private_use_fails_closed_naming_what_is_missing(call, missing):
    pytest.importorskip("keras")
    with pytest.raises(KerasCompatError, match=rf"{missing}.*Fix: install a version stratkit was tested on"):
        call()
