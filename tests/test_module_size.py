"""No stratkit module grows past ~400 lines without saying why at its top (issue 13's rule for newcomers)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "stratkit"
LIMIT = 400


def test_every_module_over_the_limit_states_its_reason_in_its_docstring():
    unexplained = []
    for path in sorted(ROOT.rglob("*.py")):
        source = path.read_text()
        lines = source.count("\n")
        if lines <= LIMIT:
            continue
        doc = ast.get_docstring(ast.parse(source)) or ""
        if "Size:" not in doc:
            unexplained.append(f"{path.relative_to(ROOT.parent)} ({lines} lines)")
    assert not unexplained, ("modules over %d lines without a 'Size: ...' reason in their docstring (split them, "
                             "or say why they stay whole): %s" % (LIMIT, ", ".join(unexplained)))
