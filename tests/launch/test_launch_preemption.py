"""`stratkit launch` and preemption: a task's exit 75 restarts without counting, the launcher's own notice ends in 75.

The tasks are small Python scripts (no TensorFlow) that behave as a training process with a backup does: on
SIGTERM they exit 75 (`stratkit.status.EXIT_PREEMPTED`). Real launcher processes, real signals.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from procs import child_env

from stratkit.process.report import describe_returncode
from stratkit.status import EXIT_PREEMPTED, parse_signal, preemption_signals
from stratkit.errors import ConfigError


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name == "TF_CONFIG" or name.startswith(("STRATKIT_", "SLURM_")):
            monkeypatch.delenv(name, raising=False)


def _argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "stratkit.cli", "launch", *args]


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "task.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


#: A task that says it is ready, then, on SIGTERM (or its wait running out), exits 75 as a preempted trainer does.
SAVES_ON_SIGTERM = """
    import json, os, signal, sys, time
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
    print(f"ready {task['type']}:{task['index']} signal={os.environ.get('STRATKIT_PREEMPTION_SIGNAL', '')}",
          flush=True)
    time.sleep(120)
"""


def test_exit_75_is_worded_as_preempted():
    assert EXIT_PREEMPTED == 75
    assert "preempted" in describe_returncode(75) and "backup" in describe_returncode(75)
    assert preemption_signals({"STRATKIT_PREEMPTION_SIGNAL": "usr1"}) == (signal.SIGTERM, signal.SIGUSR1)
    assert preemption_signals({}) == (signal.SIGTERM,)
    for bad in ("KILL", "SIGSTOP", "NOPE", "999"):
        with pytest.raises(ConfigError, match="STRATKIT_PREEMPTION_SIGNAL=.*not a signal a process can catch"):
            parse_signal(bad)


def test_a_preempted_attempt_restarts_without_counting_against_max_restarts(tmp_path):
    script = _script(tmp_path, """
        import os, sys
        attempt = int(os.environ["STRATKIT_RESTART_COUNT"])
        print(f"attempt {attempt}", flush=True)
        sys.exit(75 if attempt < 2 else 0)   # preempted twice, then done
    """)
    logs = tmp_path / "logs"
    result = subprocess.run(_argv("--workers", "2", "--max-restarts", "0", "--log-dir", str(logs), "--",
                                  sys.executable, script), env=child_env(None, None), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("was preempted: worker:") == 2
    assert "not counted against --max-restarts: 0 of 0 restart(s) left" in result.stderr
    events = [json.loads(line) for line in (logs / "events.jsonl").read_text().splitlines()]
    assert [e["outcome"] for e in events if e["event"] == "attempt_end"] == ["preempted", "preempted", "succeeded"]


def test_a_failure_after_a_preemption_still_counts(tmp_path):
    script = _script(tmp_path, """
        import os, sys
        sys.exit({0: 75, 1: 3}.get(int(os.environ["STRATKIT_RESTART_COUNT"]), 0))
    """)
    result = subprocess.run(_argv("--workers", "1", "--max-restarts", "0", "--", sys.executable, script),
                            env=child_env(None, None), capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr[-3000:]  # the crash had no restart left
    assert "was preempted" in result.stderr and "exited with code 3" in result.stderr


class _Launcher:
    def __init__(self, args: list[str], tasks: int = 2) -> None:
        self.proc = subprocess.Popen(_argv(*args), env=child_env(None, None), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.tasks = tasks

    def wait_ready(self) -> list[str]:
        seen: list[str] = []
        deadline = time.monotonic() + 60
        assert self.proc.stdout is not None
        while len([s for s in seen if "ready" in s]) < self.tasks and time.monotonic() < deadline:
            seen.append(self.proc.stdout.readline())
        return seen


@pytest.mark.parametrize("flag, sig", [((), signal.SIGTERM), (("--preemption-signal", "USR1"), signal.SIGUSR1)])
def test_a_notice_to_the_launcher_reaches_every_task_and_ends_in_75(tmp_path, flag, sig):
    launcher = _Launcher(["--workers", "2", "--max-restarts", "2", *flag, "--", sys.executable,
                          _script(tmp_path, SAVES_ON_SIGTERM)])
    ready = launcher.wait_ready()
    if flag:  # the tasks know the signal too
        assert all("signal=SIGUSR1" in line for line in ready if "ready" in line), ready
    sent = time.monotonic()
    launcher.proc.send_signal(sig)
    out, err = launcher.proc.communicate(timeout=60)
    assert launcher.proc.returncode == 75, err[-3000:]
    assert time.monotonic() - sent < 5
    assert "every task stopped at the same step, wrote its backup and exited 75" in err
    assert "attempt 2" not in err  # no restart: the platform is taking the machine


def test_tasks_that_do_not_save_end_the_launcher_as_before(tmp_path):
    launcher = _Launcher(["--workers", "1", "--", sys.executable, _script(tmp_path, """
        import time
        print("ready", flush=True)
        time.sleep(120)
    """)], tasks=1)
    launcher.wait_ready()
    launcher.proc.send_signal(signal.SIGTERM)
    _, err = launcher.proc.communicate(timeout=60)
    assert launcher.proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped every task after SIGTERM" in err


def test_a_bad_preemption_signal_is_a_usage_error_naming_the_flag(tmp_path):
    result = subprocess.run(_argv("--preemption-signal", "KILL", "--", sys.executable, "-c", "pass"),
                            env=child_env(None, None), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--preemption-signal" in result.stderr, result.stderr
