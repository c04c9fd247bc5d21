"""The reaper: a tiny process that kills our children's process groups when we end, however we end.

PR_SET_PDEATHSIG (`stratkit.process.children`) only reaches a direct child;
a task's own children (a shell's program, a data loader's workers) would live
on after a SIGKILLed parent. So the parent starts this module once, in a
session of its own, and tells it each child's process group over its stdin
("+PGID" when started, "-PGID" when the parent has reaped it). When stdin closes -- the parent exited, crashed or
was SIGKILLed: the kernel closes the pipe in every case -- it SIGKILLs every
group still listed, and exits.

It ignores SIGINT and SIGTERM (a Ctrl-C for the parent's terminal, a
`kill` of the parent's process group): only the closed pipe ends it. It needs
no network, so it works the same when the children run in a private network
namespace (`stratkit.launch.isolation`): they share our pid namespace.

`Reaper` starts it as `python -I -S <this file>`: isolated from the user's
environment (PYTHONPATH, site-packages) and quick to start (~30 ms), since it
needs only the standard library. `python -m stratkit.process.reaper` runs the
same code, after importing the stratkit package (~0.3 s more).

Imports no TensorFlow, and nothing outside the standard library.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterable
from typing import IO


def reap(commands: Iterable[str]) -> set[int]:
    """Follow "+PGID"/"-PGID" lines until they end; SIGKILL the groups still listed; return them."""
    groups: set[int] = set()
    for line in commands:
        line = line.strip()
        if line[:1] == "+":
            groups.add(int(line[1:]))
        elif line[:1] == "-":
            groups.discard(int(line[1:]))
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except OSError:
            pass
    return groups


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    reap(sys.stdin)
    return 0


class Reaper:
    """The parent's handle on its reaper: `add(pgid)` after a start, `remove(pgid)` after a reap, `close()`.

    Best effort by design: if the reaper cannot be started or its pipe
    breaks, die-with-parent and the parent's own group kills still hold, so
    the methods never raise.
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        here = os.path.abspath(__file__)
        # Installed as a zip there is no file to run: then the slower way, through our environment.
        argv = [sys.executable, "-I", "-S", here]
        if not os.path.isfile(here):
            argv = [sys.executable, "-m", "stratkit.process.reaper"]
        try:
            self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True)
        except OSError:  # pragma: no cover
            self._proc = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _send(self, text: str) -> None:
        stdin: IO[bytes] | None = None if self._proc is None else self._proc.stdin
        if stdin is None:
            return
        try:
            stdin.write(text.encode())
            stdin.flush()
        except (OSError, ValueError):
            pass

    def add(self, pgid: int) -> None:
        """Kill group `pgid` if we end before `remove(pgid)`."""
        self._send(f"+{pgid}\n")

    def remove(self, pgid: int) -> None:
        """Group `pgid` is reaped: forget it (its number may be reused)."""
        self._send(f"-{pgid}\n")

    def close(self) -> None:
        """Let the reaper go: it kills the groups still listed, then exits."""
        if self._proc is None:
            return
        if self._proc.stdin is not None:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover
            self._proc.kill()
            self._proc.wait()


if __name__ == "__main__":
    sys.exit(main())
