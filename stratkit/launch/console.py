"""Everything the launcher writes: its own messages, the tasks' prefixed lines and logs, events.jsonl.

One lock, so lines of different tasks and the launcher never interleave
mid-line. Writes to our own stdout/stderr never raise: when they went away
(e.g. `stratkit launch ... | head`) the tasks keep running and logging.

Imports no TensorFlow.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import IO, Any

from stratkit.errors import ConfigError
from stratkit.process.pump import Line, prefixed

_TAG = "[stratkit launch]"


class Console:
    """The launcher's output streams and, with `--log-dir`, its events file."""

    def __init__(self, stdout: IO[str], stderr: IO[str]) -> None:
        self.stdout = stdout
        self.stderr = stderr
        self.lock = threading.Lock()
        self._events: IO[str] | None = None

    def open_events(self, log_dir: str) -> None:
        """Create `log_dir` and append to its events.jsonl (a ConfigError naming --log-dir when it cannot)."""
        try:
            os.makedirs(log_dir, exist_ok=True)
            self._events = open(os.path.join(log_dir, "events.jsonl"), "a")  # noqa: SIM115 - open for the launch
        except OSError as exc:
            raise ConfigError(f"--log-dir {log_dir!r} cannot be written: {exc.strerror}. Fix: choose a "
                              "directory you can write to, or omit --log-dir") from None

    def close(self) -> None:
        if self._events is not None:
            self._events.close()
            self._events = None

    def say(self, text: str) -> None:
        """A launcher message on stderr, each line tagged `[stratkit launch]`."""
        with self.lock:
            self._write(self.stderr, "".join(f"{_TAG} {line}\n" for line in text.splitlines()))

    def report(self, text: str) -> None:
        """The failure report on stderr, untagged."""
        with self.lock:
            self._write(self.stderr, text + "\n")

    def event(self, kind: str, **fields: Any) -> None:
        """One record in events.jsonl (nothing without --log-dir)."""
        if self._events is None:
            return
        record = {"time": round(time.time(), 3), "event": kind, **fields}
        with self.lock:
            self._events.write(json.dumps(record) + "\n")
            self._events.flush()

    def task_line(self, name: str, line: Line, log: IO[bytes] | None) -> None:
        """A task's line: raw to its log, prefixed `[name] ` to our stdout or stderr (as it printed it)."""
        with self.lock:
            if log is not None:
                try:
                    log.write(line.raw + b"\n")
                except (OSError, ValueError):
                    pass
            self._write(self.stderr if line.stream == "stderr" else self.stdout, prefixed(name, line.text) + "\n")

    @staticmethod
    def _write(stream: IO[str], text: str) -> None:
        try:
            stream.write(text)
            stream.flush()
        except (OSError, ValueError):  # our own stream went away (e.g. `| head`): keep supervising and logging
            pass
