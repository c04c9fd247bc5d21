"""What the launch tests share: the machine's own launch settings kept out, and the check of a refused flag.

No developer's TF_CONFIG or STRATKIT_* / SLURM_* setting may change a launch
under test, so every test in tests/launch starts from an os.environ without
them; a test that needs one sets it with `monkeypatch`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import pytest

from stratkit.cli import main


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name == "TF_CONFIG" or name.startswith(("STRATKIT_", "SLURM_")):
            monkeypatch.delenv(name, raising=False)


@pytest.fixture
def refused_launch(capsys: pytest.CaptureFixture[str]) -> Callable[[list[str], list[str]], None]:
    """`refused_launch(argv, words)`: `stratkit launch ARGV -- python -c pass` exits 2 before anything starts, its
    stderr naming every one of `words` and the fix (the flag tests of test_elastic.py and test_nnodes.py)."""
    def check(argv: list[str], words: list[str]) -> None:
        assert main(["launch", *argv, "--", sys.executable, "-c", "pass"]) == 2
        err = capsys.readouterr().err
        for word in words:
            assert word in err, err
        assert "Fix:" in err
    return check
