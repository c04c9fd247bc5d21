"""Private scratch directories of non-chief workers, removed however the worker ends.

A non-chief worker of a multi-worker run writes its copies of the user's files
(TensorBoard logs, checkpoints, CSV logs, a backup copy, a `Trainer.save`) to
directories of its own in the temp dir (`stratkit.strategy.side_effects`,
`Trainer.save`). A `finally` removes them after a normal `fit`/`save`; an
exit handler removes whatever is left at a normal interpreter exit. Neither runs
when the worker is SIGKILLed (a launcher's or a test's group kill, the OOM
killer, a Spark executor lost), and a worker that is still training when the
chief exits may be killed that way next. So the first directory also starts
a tiny sweeper process (this file run as `python -I -S`, standard library only;
it starts in the background, 0.1-0.2 s on a busy 2-core machine, without
blocking the worker), in a session of its own so a group kill spares it. The worker tells it
each directory over its stdin ("+PATH" made, "-PATH" removed); when the pipe
closes -- the worker exited or was killed: the kernel closes it in every
case -- it removes every directory still listed, and exits. The same shape as
`stratkit.process.reaper`, for files instead of process groups.

Best effort by design: if the sweeper cannot start, the `finally` and the exit
handler still hold. Imports nothing outside the standard library.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable
from typing import IO

_lock = threading.Lock()
_live: set[str] = set()
_sweeper: subprocess.Popen[bytes] | None = None
_owner_pid: int | None = None  # the process that made the directories (a fork's exit must not remove them)


def make(prefix: str) -> str:
    """A new private directory `<tempdir>/<prefix>XXXXXXXX` (0700), removed at the latest when this process ends."""
    path = tempfile.mkdtemp(prefix=prefix)
    with _lock:
        _tell(f"+{path}")
        _live.add(path)
    return path


def remove(paths: Iterable[str]) -> None:
    """Remove directories made by :func:`make` (any other path is removed too, just not tracked)."""
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
        with _lock:
            if path in _live:
                _live.discard(path)
                _tell(f"-{path}")


def _tell(line: str) -> None:
    """Send one line to the sweeper, starting it (and the exit handler) first; never raises."""
    global _sweeper, _owner_pid
    if _owner_pid != os.getpid():  # first use in this process, or in a fork of one that used it
        if _owner_pid is None:
            atexit.register(_remove_all)  # a fork inherits the registration
        _live.clear()  # a fork's parent removes its own directories
        _owner_pid, _sweeper = os.getpid(), _start_sweeper()
    if _sweeper is None or "\n" in line:
        return
    try:
        assert _sweeper.stdin is not None
        _sweeper.stdin.write(line.encode("utf-8", "surrogateescape") + b"\n")
        _sweeper.stdin.flush()
    except (OSError, ValueError):  # it died: the finally and the exit handler remain
        _sweeper = None


def _start_sweeper() -> subprocess.Popen[bytes] | None:
    here = os.path.abspath(__file__)
    argv = [sys.executable, "-I", "-S", here] if os.path.isfile(here) else [
        sys.executable, "-m", "stratkit.strategy.scratch"]  # installed as a zip: through our environment
    try:
        return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError:  # pragma: no cover
        return None


def _remove_all() -> None:
    if os.getpid() != _owner_pid:
        return
    remove(list(_live))


def sweep(lines: Iterable[str]) -> set[str]:
    """Follow "+PATH"/"-PATH" lines until they end; remove the directories still listed; return them."""
    paths: set[str] = set()
    for line in lines:
        line = line.rstrip("\n")
        if line[:1] == "+":
            paths.add(line[1:])
        elif line[:1] == "-":
            paths.discard(line[1:])
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
    return paths


def main(stdin: IO[str] | None = None) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the closed pipe ends it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sweep(stdin if stdin is not None else sys.stdin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
