"""Which Ray stratkit runs on: imported on first use, refused with a fix when missing or too old.

`import stratkit.ray` imports no Ray (nor TensorFlow): Ray is imported when a
runner runs or a Ray Train callback is made, through `import_ray`, so a
machine without Ray gets a `ConfigError` that says how to install it instead
of an ImportError from deep inside.

The floor is 2.52.0, the first release with token authentication
(`RAY_AUTH_MODE=token`), which docs/ray.md tells every cluster to turn on
(without it anyone who reaches Ray's ports runs code as you). Releases newer
than the newest tested one run with a one-time warning: `RayRunner` uses only
Ray Core's stable API (actors, placement groups, `ray.get`/`ray.wait`).
"""

from __future__ import annotations

import re
import sys
import threading
from typing import Any

from stratkit import status
from stratkit.errors import ConfigError

log = status.logger(__name__)

#: The oldest Ray accepted (token authentication, Train V2 by default).
RAY_FLOOR = (2, 52, 0)
#: The Ray releases the suite ran on (`tests/ray/`; the two-node test on 2.60.0 only); the newest is what
#: `pip install "stratkit[ray]"` gets.
TESTED_RAY_VERSIONS = ("2.52.1", "2.60.0")
INSTALL = 'pip install "stratkit[ray]"'

_warned: set[str] = set()
_lock = threading.Lock()


def parse(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a Ray version string ("2.60.0", "2.61.0rc1", "3.0.0.dev0")."""
    match = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        raise ConfigError(f"cannot read Ray's version {version!r}. Fix: {INSTALL}")
    return int(match[1]), int(match[2]), int(match[3] or 0)


def check_version(version: str, api: str) -> None:
    """Refuse a Ray older than `RAY_FLOOR`; warn once about one newer than the newest tested release."""
    found = parse(version)
    floor = ".".join(map(str, RAY_FLOOR))
    if found < RAY_FLOOR:
        raise ConfigError(f"{api} needs Ray >= {floor} (token authentication, Ray Train V2): Ray {version} is "
                          f"installed. Fix: {INSTALL} (or pip install -U \"ray[train]>={floor}\")")
    newest = max(TESTED_RAY_VERSIONS, key=parse)
    if found[:2] > parse(newest)[:2]:
        with _lock:
            if version in _warned:
                return
            _warned.add(version)
        log.warning("Ray %s is newer than the newest Ray stratkit was tested on (%s); if the run misbehaves, "
                    "try pip install \"ray[train]==%s\"", version, newest, newest)


def import_ray(api: str) -> Any:
    """The `ray` module, checked; a ConfigError naming the fix when Ray is missing or too old.

    Args:
        api: what needs Ray, for the message ("RayRunner", "RayReportCallback").
    """
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(f"{api} needs Ray, which this Python ({sys.executable}) cannot import ({exc}). "
                          'Fix: pip install "stratkit[ray]"') from None
    check_version(str(getattr(ray, "__version__", "0")), api)
    return ray
