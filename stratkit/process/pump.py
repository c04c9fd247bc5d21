"""Follow a child's output line by line: hand each line on, keep its tail and the last exception it printed.

One tail policy for every front door (the launcher's root-cause report and
the Spark runner's error): the last `TAIL_LINES` = 50 lines, each cut to
`TAIL_LINE_CHARS` = 8,000 characters. Fifty lines hold a Python traceback and
what led to it; longer tails bury the cause, and the exception line itself is
kept apart (`stratkit.process.tracebacks`), however far back it was printed.
Lines passed on to the console or a log are not cut: a line without a newline
is handed on in pieces of `MAX_LINE_BYTES` (a progress bar must not grow
without bound in our memory).

Imports no TensorFlow.
"""

from __future__ import annotations

import collections
import os
import selectors
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO

from stratkit.process.tracebacks import ExceptionScanner

#: How many of a task's last output lines a failure report shows.
TAIL_LINES = 50
#: The longest line a tail keeps whole (a longer one is cut, with a marker).
TAIL_LINE_CHARS = 8000
#: The longest partial line buffered before it is handed on anyway.
MAX_LINE_BYTES = 64 * 1024
_TRUNCATED = " ...(truncated)"


@dataclass(frozen=True)
class Line:
    """One line of a child's output, without its newline.

    Attributes:
        stream: the name it came from ("stdout", "stderr", or what the caller named its pipes).
        raw: the bytes as printed (for a log file).
        text: decoded as UTF-8 (invalid bytes replaced), a trailing carriage return dropped.
    """

    stream: str
    raw: bytes
    text: str


def prefixed(name: str, text: str) -> str:
    """`[worker:1] text`: a line of task `name` on a console that several tasks share."""
    return f"[{name}] {text}"


def cut_line(text: str, chars: int = TAIL_LINE_CHARS) -> str:
    """`text`, or its first `chars` characters and a marker when it is longer (the tail's rule for one line)."""
    return text if len(text) <= chars else text[:chars] + _TRUNCATED


class Tail:
    """The last `lines` lines seen, each cut to `chars` characters."""

    def __init__(self, lines: int = TAIL_LINES, chars: int = TAIL_LINE_CHARS) -> None:
        self._lines: collections.deque[str] = collections.deque(maxlen=lines)
        self._chars = chars

    def add(self, text: str) -> None:
        self._lines.append(cut_line(text, self._chars))

    def lines(self) -> tuple[str, ...]:
        return tuple(self._lines)

    def __len__(self) -> int:
        return len(self._lines)

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._lines))


class OutputPump:
    """Reads a child's pipes until they close, one line at a time, on one thread.

    For every complete line it updates `tail` and `scanner` (the last exception
    printed), then calls `on_line(Line)`. One thread reads every pipe, the
    first-named first when several have data waiting: two threads racing would
    often put a crash's traceback (stderr, written last) before the prints that
    preceded it, and out of the tail.

    `run()` pumps in the calling thread; `start()` in a daemon thread, `join()` waits for it.

    Args:
        streams: the pipes to read, by name, in priority order (e.g. {"stdout": ..., "stderr": ...}).
        on_line: called for every line, from the pumping thread.
        name: the thread's name.
        tail_lines: lines kept in `tail` (the default is the one policy; see the module docstring).
        keep: when given, a line it returns False for is dropped before anything sees it (known
            start-up noise, say); it can change its mind as lines go by.
    """

    def __init__(self, streams: Mapping[str, IO[bytes]], on_line: Callable[[Line], None], *,
                 name: str = "stratkit-pump", tail_lines: int = TAIL_LINES,
                 keep: Callable[[str], bool] | None = None) -> None:
        self._streams = dict(streams)
        self._on_line = on_line
        self._keep = keep
        self.tail = Tail(tail_lines)
        self.scanner = ExceptionScanner()
        self._thread = threading.Thread(target=self.run, daemon=True, name=name)

    def start(self) -> OutputPump:
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> None:
        """Wait for the pipes to close (the child and everything it started exited), at most `timeout` s."""
        if self._thread.ident is not None:
            self._thread.join(timeout)

    def run(self) -> None:
        names = {pipe.fileno(): name for name, pipe in self._streams.items()}
        order = list(names)
        partial = {fd: b"" for fd in names}
        with selectors.DefaultSelector() as selector:
            for fd in names:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                for fd in sorted((key.fd for key, _ in selector.select()), key=order.index):
                    data = os.read(fd, 65536)
                    if not data:  # EOF: the child and everything in its group closed the pipe
                        selector.unregister(fd)
                        if partial[fd]:
                            self._emit(names[fd], partial[fd])
                        continue
                    *lines, rest = (partial[fd] + data).split(b"\n")
                    for line in lines:
                        self._emit(names[fd], line)
                    if len(rest) > MAX_LINE_BYTES:
                        self._emit(names[fd], rest)
                        rest = b""
                    partial[fd] = rest
        for pipe in self._streams.values():
            pipe.close()

    def _emit(self, stream: str, raw: bytes) -> None:
        text = raw.decode("utf-8", "replace").rstrip("\r")
        if self._keep is not None and not self._keep(text):
            return
        self.tail.add(text)
        self.scanner.feed(text, stream)
        self._on_line(Line(stream, raw, text))
