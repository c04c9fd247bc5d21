"""Status lines keep today's console in processes where absl configured logging by itself.

absl's `logging.info` calls `logging.basicConfig()` when the root logger has
no handler (TensorFlow's ClusterCoordinator watchdog logs through absl on
every parameter-server chief). That bare default handler is not the user
choosing a console: stratkit's lines stay `[stratkit] ...` on stdout, once.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("absl")

CHILD = textwrap.dedent("""
    import logging, sys
    from absl import logging as absl_logging
    from stratkit import status

    log = status.logger("stratkit.training.ps.coordinator")
    absl_logging.info("Starting watchdog thread")   # what TensorFlow's coordinator does
    if "--user" in sys.argv:
        logging.getLogger().handlers[0].setFormatter(logging.Formatter("USER %(name)s %(message)s"))
    log.info("epoch 1/3: 10 steps")
    log.warning("a warning")
""")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=60)


def test_absl_configuring_logging_by_itself_keeps_the_status_lines_on_stdout_once():
    result = _run()
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[stratkit] epoch 1/3: 10 steps"]
    assert "[stratkit] warning: a warning" in result.stderr
    assert "stratkit.training.ps.coordinator" not in result.stderr, result.stderr


def test_a_console_handler_the_user_configured_still_gets_the_lines_instead():
    result = _run("--user")
    assert result.returncode == 0, result.stderr
    assert "[stratkit]" not in result.stdout + result.stderr
    assert "USER stratkit.training.ps.coordinator epoch 1/3: 10 steps" in result.stderr
