"""Moved to `stratkit.process.tracebacks` (the process layer the Spark runner shares); kept importable here."""

from __future__ import annotations

from stratkit.process.tracebacks import CONTEXT_LINES, ExceptionScanner, last_exception

__all__ = ["CONTEXT_LINES", "ExceptionScanner", "last_exception"]
