"""`fork_child`: a forked function runs in its own process group, writes to the caller's pipe, and dies with us."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from stratkit.process.children import fork_child
from procs import alive as _alive  # noqa: E402


def test_a_forked_function_leads_its_own_group_writes_to_the_pipe_and_exits_with_its_return_value():
    read, write = os.pipe()

    def run() -> int:
        print("hello", os.getpgid(0) == os.getpid(), flush=True)
        print("to stderr", file=sys.stderr, flush=True)
        return 3

    pid = fork_child(run, output_fd=write)
    os.close(write)
    with os.fdopen(read) as output:
        text = output.read()
    _, status = os.waitpid(pid, 0)
    assert text == "hello True\nto stderr\n"
    assert os.waitstatus_to_exitcode(status) == 3
    assert os.getpgid(os.getpid()) != pid


def test_an_exception_in_the_forked_function_is_printed_and_exits_1():
    read, write = os.pipe()

    def run() -> int:
        raise ValueError("bad run")

    pid = fork_child(run, output_fd=write)
    os.close(write)
    with os.fdopen(read) as output:
        text = output.read()
    _, status = os.waitpid(pid, 0)
    assert "ValueError: bad run" in text and os.waitstatus_to_exitcode(status) == 1


def test_the_forked_child_dies_with_its_parent_even_when_the_parent_is_sigkilled():
    parent = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\n"
        "from stratkit.process.children import fork_child\n"
        "pid = fork_child(lambda: time.sleep(60) or 0, output_fd=os.dup(1))\n"
        "print(pid, flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the forked child outlived its SIGKILLed parent"
    finally:
        parent.kill()
        parent.stdout.close()
