"""`tools/keras_tests.py` (what `make test-keras` runs) tells a regression from a test that fails anyway.

The harness is run for real on a small throwaway test file, in its two real pytest passes (plain, and with
stratkit's patches installed by its plugin): a test that sees Keras's own loss reduction passes plain and
fails once the patches replace it; one that ends the process when patched crashes and leaves the next test
unrun. Only these are regressions; a test failing in both passes is listed, not counted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from procs import REPO_ROOT, child_env

pytestmark = pytest.mark.slow

THROWAWAY = textwrap.dedent('''
    import os

    import pytest
    from keras.src.losses import loss as keras_loss


    def _patched():
        # stratkit's patches replace this module function (global_gradient.py); plain Keras has its own
        return keras_loss.reduce_weighted_values.__module__ != keras_loss.__name__


    def test_passes_in_both():
        assert keras_loss.reduce_weighted_values is not None


    def test_sees_keras_own_loss_reduction():
        assert not _patched(), "reduce_weighted_values is not Keras's own"


    def test_fails_in_both():
        assert 1 == 2, "this one always fails"


    def test_skipped_in_both():
        pytest.skip("always skipped")


    def test_ends_the_process_when_patched():
        if _patched():
            os._exit(7)


    def test_after_the_end():
        pass
''')


def _harness(tmp_path: Path, *select: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    (tmp_path / "throwaway_test.py").write_text(THROWAWAY)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "keras_tests.py"), "--root", str(tmp_path), "--out", str(out),
         "--select", *select], env=child_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    return proc, json.loads((out / "result.json").read_text())


def test_a_test_passing_plain_and_failing_or_crashing_patched_is_a_regression_and_fails_the_run(tmp_path):
    proc, result = _harness(tmp_path, "throwaway_test.py")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    name = "throwaway_test.py::"
    assert {(r["nodeid"], r["plain"], r["patched"]) for r in result["regressions"]} == {
        (name + "test_sees_keras_own_loss_reduction", "passed", "failed"),
        (name + "test_ends_the_process_when_patched", "passed", "crashed"),
        (name + "test_after_the_end", "passed", "not run"),
    }
    assert [(r["nodeid"], r["plain"], r["patched"]) for r in result["failing_plain"]] == [
        (name + "test_fails_in_both", "failed", "failed")]
    assert result["tests"][name + "test_passes_in_both"] == {"plain": "passed", "patched": "passed"}
    assert result["tests"][name + "test_skipped_in_both"] == {"plain": "skipped", "patched": "skipped"}
    assert result["errors"] == []
    assert result["groups"]["select"]["patches"]["status"] == "patched"
    counts = {"tests": 6, "passed_plain": 4, "passed_patched": 1, "failing_plain": 1, "regressions": 3}
    assert {key: result["files"]["throwaway_test.py"][key] for key in counts} == counts
    # each regression is named with the first lines of what happened
    regression = next(r for r in result["regressions"] if r["patched"] == "failed")
    assert "reduce_weighted_values is not Keras's own" in regression["message"]
    assert "REGRESSIONS: 3 test(s)" in proc.stdout
    assert f"{name}test_sees_keras_own_loss_reduction: failed" in proc.stdout
    assert "exit status 7" in next(r for r in result["regressions"] if r["patched"] == "crashed")["message"]


def test_a_test_failing_in_both_passes_is_reported_and_not_counted(tmp_path):
    proc, result = _harness(tmp_path, "throwaway_test.py::test_passes_in_both", "throwaway_test.py::test_fails_in_both")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert result["regressions"] == []
    assert [r["nodeid"] for r in result["failing_plain"]] == ["throwaway_test.py::test_fails_in_both"]
    assert "failing plain (not counted): 1" in proc.stdout
    assert "[keras-tests] OK: 0 regression(s)" in proc.stdout
