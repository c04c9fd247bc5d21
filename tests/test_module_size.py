"""No stratkit module grows past ~400 lines without saying why at its top (issue 13's rule for newcomers),
and none grows past 500 lines at all (issue 22: split it by job instead)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "stratkit"
LIMIT = 400
HARD_LIMIT = 500


def _sizes() -> list[tuple[Path, str, int]]:
    """(path, source, lines) of every stratkit module."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        source = path.read_text()
        out.append((path, source, source.count("\n")))
    return out


def test_every_module_over_the_limit_states_its_reason_in_its_docstring():
    unexplained = []
    for path, source, lines in _sizes():
        if lines <= LIMIT:
            continue
        doc = ast.get_docstring(ast.parse(source)) or ""
        if "Size:" not in doc:
            unexplained.append(f"{path.relative_to(ROOT.parent)} ({lines} lines)")
    assert not unexplained, ("modules over %d lines without a 'Size: ...' reason in their docstring (split them, "
                             "or say why they stay whole): %s" % (LIMIT, ", ".join(unexplained)))


def test_no_module_is_over_the_hard_limit():
    too_long = [f"{path.relative_to(ROOT.parent)} ({lines} lines)" for path, _, lines in _sizes()
                if lines > HARD_LIMIT]
    assert not too_long, ("modules over %d lines (a 'Size:' reason does not cover these: split them by job): %s"
                          % (HARD_LIMIT, ", ".join(too_long)))
