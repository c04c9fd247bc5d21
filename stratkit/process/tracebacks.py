"""Find the exception a task died of in its output, however long its traceback or message.

A failure report shows a task's last lines, but the line that matters most --
the exception's type and message -- is often not among them: a TensorFlow
graph error prints its type line first ("...InvalidArgumentError: Graph
execution error:") and then hundreds of lines of "defined at" frames. So the
output pump follows every line as it streams by and keeps the last exception seen:

- after a "Traceback (most recent call last):" line, the first line that is not
  indented (frames are) is the exception: "module.Type: message";
- failing that, the last line that reads like one ("ValueError: bad input",
  what `sys.exit("...Error: ...")` prints).

It keeps a few of the lines that follow, since multi-line messages (TF's)
put the useful part right after the type.

Imports no TensorFlow.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

#: Lines kept after the exception's own line: the start of a multi-line message.
CONTEXT_LINES = 4

_TRACEBACK = "Traceback (most recent call last):"
# "During handling of the above exception, another exception occurred:", "The above exception was ..."
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
# `pkg.mod.SomeError: message`, `KeyboardInterrupt`, `SystemExit: 3`: a dotted name that says what it is.
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure|Warning)(: |:?$)")


class _Stream:
    """The scanning state of one output stream (stdout and stderr are followed separately)."""

    def __init__(self) -> None:
        self.in_traceback = False
        self.collecting: list[str] | None = None


class ExceptionScanner:
    """Fed every line of a task's output; `exception` is the last exception it printed, with context.

    `feed(line, stream)` takes lines of several streams interleaved; a traceback
    is only recognised within one stream, so stdout prints between the lines of
    a stderr traceback do not break it.
    """

    def __init__(self, context_lines: int = CONTEXT_LINES) -> None:
        self._context = context_lines
        self._streams: dict[str, _Stream] = {}
        self._found: list[str] = []

    @property
    def exception(self) -> tuple[str, ...]:
        """The exception's line and up to `context_lines` non-blank lines after it; () when none seen."""
        return tuple(self._found)

    def feed(self, line: str, stream: str = "stderr") -> None:
        state = self._streams.setdefault(stream, _Stream())
        if line.startswith(_TRACEBACK) or line.startswith(_CHAINED):
            state.in_traceback = line.startswith(_TRACEBACK)
            state.collecting = None
            return
        if state.collecting is not None and len(state.collecting) > self._context:
            state.collecting = None
        if state.collecting is not None:
            if line.strip():
                state.collecting.append(line)
            return
        if state.in_traceback:
            if line[:1].isspace() or not line:
                return  # a frame, its source line, its ^^^ markers
            state.in_traceback = False
            self._start(state, line)
        elif _EXCEPTION_LINE.match(line):
            self._start(state, line)

    def _start(self, state: _Stream, line: str) -> None:
        # The list is shared with the stream's state: the lines that follow land in it as they arrive.
        state.collecting = self._found = [line]


def last_exception(lines: Iterable[str], context_lines: int = CONTEXT_LINES) -> tuple[str, ...]:
    """The last exception in `lines` (one stream), as `ExceptionScanner.exception`."""
    scanner = ExceptionScanner(context_lines)
    for line in lines:
        scanner.feed(line)
    return scanner.exception
