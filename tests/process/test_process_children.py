"""`stratkit.process.children` and `.reaper`: no child outlives its parent, however the parent ends.

Real processes: a "parent" script starts its children with the process layer and
prints their pids; the test then kills the parent (SIGKILL: no Python cleanup
runs) and checks, by pid, what is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from procs import child_env

from stratkit.process.children import die_with_parent, start_child, stop_groups
from stratkit.process.reaper import reap
from procs import alive as _alive  # noqa: E402

pytestmark = pytest.mark.slow

SLEEPER = [sys.executable, "-c", "import time; time.sleep(300)"]
# A task that ignores SIGTERM and starts a grandchild in its own process group, then prints both pids.
STUBBORN = [sys.executable, "-c", textwrap.dedent("""
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    print(grandchild.pid, flush=True)
    time.sleep(300)
""")]


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids still alive after `seconds` (then SIGKILLed, so no test leaks them)."""
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [p for p in pids if _alive(p)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    return alive


def _parent(body: str) -> subprocess.Popen[str]:
    """A parent process running `body` (with the process layer importable); it prints pids, one per line."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(body)], env=child_env(), stdout=subprocess.PIPE,
                            text=True, start_new_session=True)


def _read_pids(proc: subprocess.Popen[str], count: int) -> list[int]:
    assert proc.stdout is not None
    return [int(proc.stdout.readline()) for _ in range(count)]


def test_a_child_dies_with_its_parent_and_the_reaper_takes_its_group_when_the_parent_is_sigkilled():
    parent = _parent(f"""
        import subprocess, time
        from stratkit.process.children import start_child
        from stratkit.process.reaper import Reaper
        reaper = Reaper()
        listed = start_child({STUBBORN!r}, {{"PATH": "/usr/bin:/bin"}}, stdout=subprocess.PIPE, stderr=None)
        reaper.add(listed.pid)
        forgotten = start_child({STUBBORN!r}, {{"PATH": "/usr/bin:/bin"}}, stdout=subprocess.PIPE, stderr=None)
        reaper.add(forgotten.pid)
        reaper.remove(forgotten.pid)
        for proc in (listed, forgotten):
            print(proc.pid, proc.stdout.readline().decode().strip(), sep="\\n", flush=True)
        print(reaper.pid, flush=True)
        time.sleep(300)
    """)
    pids: list[int] = []
    try:
        pids = _read_pids(parent, 5)
        listed, listed_grandchild, forgotten, forgotten_grandchild, reaper = pids
        assert all(_alive(p) for p in (listed, listed_grandchild, forgotten, forgotten_grandchild, reaper))
        parent.kill()
        parent.wait()
        # PDEATHSIG ends both children; the reaper ends the grandchild of the group it was told about, then itself.
        assert _gone_within([listed, forgotten, listed_grandchild, reaper], 10) == []
        assert _alive(forgotten_grandchild)  # removed from the reaper's list: it was the parent's to stop
    finally:
        parent.kill()
        parent.wait()
        _gone_within(pids, 0)


def test_a_child_whose_parent_is_already_gone_kills_itself():
    code = f"from stratkit.process.children import die_with_parent; die_with_parent({os.getpid()} + 10**6)"
    result = subprocess.run([sys.executable, "-c", code], env=child_env(), timeout=60, check=False)
    assert result.returncode == -signal.SIGKILL
    die_with_parent(os.getppid())  # our own parent is alive: nothing happens


def test_stop_groups_sends_sigterm_then_sigkill_after_the_grace_to_the_whole_group():
    polite = start_child(SLEEPER, child_env(), stdout=None, stderr=None)
    stubborn = start_child(STUBBORN, child_env(), stderr=None)
    assert stubborn.stdout is not None
    grandchild = int(stubborn.stdout.readline())
    started = time.monotonic()
    stop_groups([polite, stubborn], grace=1.0)
    assert polite.returncode == -signal.SIGTERM
    assert stubborn.returncode == -signal.SIGKILL and time.monotonic() - started >= 1.0
    assert _gone_within([grandchild], 5) == []  # it was in the stubborn task's group
    stubborn.stdout.close()


def test_a_second_signal_cuts_the_grace_short():
    stubborn = start_child(STUBBORN, child_env(), stderr=None)
    assert stubborn.stdout is not None
    stubborn.stdout.readline()
    started = time.monotonic()
    stop_groups([stubborn], grace=60.0, hurry=lambda: time.monotonic() - started > 0.5)
    assert stubborn.returncode == -signal.SIGKILL and time.monotonic() - started < 10
    stubborn.stdout.close()


def test_reap_kills_the_groups_still_listed_at_the_end_of_its_input():
    kept = subprocess.Popen(SLEEPER, start_new_session=True)
    dropped = subprocess.Popen(SLEEPER, start_new_session=True)
    try:
        assert reap([f"+{kept.pid}\n", f"+{dropped.pid}\n", f"-{dropped.pid}\n"]) == {kept.pid}
        assert kept.wait(timeout=10) == -signal.SIGKILL
        assert dropped.poll() is None
    finally:
        dropped.kill()
        kept.kill()
        dropped.wait()
        kept.wait()


def test_the_reaper_runs_as_a_module_and_kills_its_groups_when_its_input_closes():
    task = subprocess.Popen(SLEEPER, start_new_session=True)
    try:
        reaper = subprocess.run([sys.executable, "-m", "stratkit.process.reaper"], input=f"+{task.pid}\n",
                                text=True, env=child_env(), timeout=60, check=False)
        assert reaper.returncode == 0
        assert task.wait(timeout=10) == -signal.SIGKILL
    finally:
        task.kill()
        task.wait()


def test_the_spark_task_shape_one_merged_stream_pumped_in_the_calling_thread_and_reported():
    """What a Spark barrier task does: one child, stdout+stderr merged, every line to a log client."""
    from stratkit.process.pump import OutputPump
    from stratkit.process.report import TaskFailure, describe_returncode, format_failure_report

    script = "import sys\nfor i in range(80): print('step', i)\nraise ValueError('bad shard')\n"
    child = start_child([sys.executable, "-c", script], child_env(), stderr=subprocess.STDOUT)
    assert child.stdout is not None
    sent: list[str] = []
    pump = OutputPump({"output": child.stdout}, lambda line: sent.append(line.text))
    pump.run()  # returns when the child (and its group) closed the pipe
    code = child.wait()
    assert code == 1 and sent[0] == "step 0" and sent[-1] == "ValueError: bad shard"
    failure = TaskFailure("worker:1", code, pump.tail.lines(), pid=child.pid, exception=pump.scanner.exception)
    report = format_failure_report(failure, ["worker:0: stopped"], attempts=2, title="stratkit spark")
    assert "stratkit spark: root cause (first observed failure)" in report
    assert f"failure: {describe_returncode(1)}" in report and "exception: ValueError: bad shard" in report
    assert "last 50 line(s) of worker:1:" in report and "step 29" not in report


def test_a_child_can_be_handed_its_work_on_stdin_after_it_started():
    child = start_child([sys.executable, "-c", "import sys; print(sys.stdin.readline().upper(), end='')"],
                        child_env(), stdin=subprocess.PIPE, stderr=None)
    out, _ = child.communicate(b"the run\n", timeout=60)
    assert out == b"THE RUN\n" and child.returncode == 0


# A parent that waits for its child (as a Spark task waits for its training process) while passing notices on.
PASSING_ON = textwrap.dedent("""
    import signal, sys
    from stratkit.process.children import passing_on_notices, start_child
    before = signal.getsignal(signal.SIGHUP)  # SIG_DFL, or SIG_IGN under nohup
    child = start_child([sys.executable, "-c", "import signal, sys, time\\n"
                         "signal.signal(signal.SIGTERM, lambda s, f: sys.exit(75))\\n"
                         "print('ready', flush=True); time.sleep(300)"], dict(__import__('os').environ),
                        stderr=None)
    with passing_on_notices(lambda: child.pid, (signal.SIGTERM, signal.SIGHUP)) as notices:
        print(child.stdout.readline().decode().strip(), flush=True)
        code = child.wait()
    print(f"child exited {code} after {[signal.Signals(s).name for s in notices]}", flush=True)
    sys.exit(0 if signal.getsignal(signal.SIGHUP) == before else 1)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_waiting_parent_passes_a_notice_on_to_its_child_in_its_own_session_as_sigterm(sig):
    parent = subprocess.Popen([sys.executable, "-c", PASSING_ON], env=child_env(None), stdout=subprocess.PIPE,
                              text=True)
    try:
        assert parent.stdout.readline().strip() == "ready"
        parent.send_signal(sig)  # the child is in its own session: only the parent's handler can reach it
        out, _ = parent.communicate(timeout=60)
    finally:
        parent.kill()
    assert parent.returncode == 0, out  # the parent lived on, waited, and put its own handlers back
    assert out.strip() == f"child exited 75 after ['{sig.name}']", out


POOL_OF = [sys.executable, "-c", "import os, pyarrow as pa; print(pa.default_memory_pool().backend_name, "
           "os.environ.get('ARROW_DEFAULT_MEMORY_POOL'))"]


@pytest.mark.parametrize("asked, expected", [(None, "jemalloc"), ("system", "system"), ("mimalloc", "mimalloc")])
def test_a_child_decodes_arrow_in_jemalloc_unless_its_environment_names_a_pool(asked, expected):
    # pyarrow's default mimalloc keeps what the table reader's threads freed: a worker grew 40-49 MiB on the
    # memory bench's 24 MiB budget, 24-33 MiB with jemalloc (stratkit/process/children.py). A user's choice stays.
    proc = start_child(POOL_OF, child_env(None, {"ARROW_DEFAULT_MEMORY_POOL": asked}))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.decode().split() == [expected, asked or "jemalloc"]


def test_the_workers_of_stratkit_launch_get_the_pool_too(tmp_path):
    script = tmp_path / "pool.py"            # `python script.py`, as a user starts their tasks
    script.write_text(POOL_OF[2])
    out = subprocess.run([sys.executable, "-m", "stratkit.cli", "launch", "--workers", "2", "--", sys.executable,
                          str(script)],
                         env=child_env(None, {"ARROW_DEFAULT_MEMORY_POOL": None}), capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    pools = sorted(line.split()[-2:] for line in out.stdout.splitlines() if "jemalloc" in line or "mimalloc" in line)
    assert pools == [["jemalloc", "jemalloc"]] * 2, out.stdout
