"""Phase marks: when did a training process reach each step of its start and end?

A launcher that wants a per-phase timeline (the Spark runner does) sets
STRATKIT_TIMELINE to a file path in the training process's environment;
`mark(name)` then appends `{"event": name, "t": <time.time()>}` as one JSON
line. Without the variable `mark` does nothing, so the calls can stay in
library code (strategy ready, first step, end of training) at no cost.

Wall-clock `time.time()` on purpose: the marks of several processes on one
host (driver, Spark task, training process) are compared with each other.
"""

from __future__ import annotations

import json
import os
import time

TIMELINE_VAR = "STRATKIT_TIMELINE"


def enabled() -> bool:
    return bool(os.environ.get(TIMELINE_VAR))


def mark(event: str, when: float | None = None) -> None:
    """Record that this process reached `event` now (or at `when`); a no-op unless STRATKIT_TIMELINE is set."""
    path = os.environ.get(TIMELINE_VAR)
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"event": event, "t": time.time() if when is None else when}) + "\n")
    except OSError:  # a timeline is diagnostics: never fail training over it
        pass


def read(path: str) -> list[dict]:
    """The marks in the file at `path`, in order (an unreadable file or line is skipped)."""
    events = []
    try:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                try:
                    item = json.loads(line)
                except ValueError:
                    continue
                if isinstance(item, dict) and "event" in item and "t" in item:
                    events.append({"event": str(item["event"]), "t": float(item["t"])})
    except OSError:
        pass
    return events
