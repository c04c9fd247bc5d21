"""Shared helpers for the benchmarks: machine description and JSON/table output."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {"cores": os.cpu_count(), "python": sys.version.split()[0], "platform": platform.platform(),
            "tensorflow": version("tensorflow"), "keras": version("keras"), "pyspark": version("pyspark"),
            "stratkit": version("stratkit"), "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def write_result(name: str, payload: dict) -> Path:
    """Write benchmarks/results/<name>.json atomically, with the machine attached."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"benchmark": name, "machine": machine(), **payload}, indent=2))
    os.replace(tmp, path)
    return path


def print_table(title: str, rows: list[dict]) -> None:
    if not rows:
        return
    keys = list(rows[0])
    widths = {k: max(len(k), *(len(_fmt(r[k])) for r in rows)) for k in keys}
    print(f"\n{title}")
    print("  ".join(k.ljust(widths[k]) for k in keys))
    for row in rows:
        print("  ".join(_fmt(row[k]).ljust(widths[k]) for k in keys))


def _fmt(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)
