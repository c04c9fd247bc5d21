"""Which Ray stratkit runs on: imported on first use, refused with a fix when missing or too old.

`import stratkit.ray` imports no Ray (nor TensorFlow): Ray is imported when a
runner runs or a Ray Train callback is made, through `import_ray`, so a
machine without Ray gets a `ConfigError` that says how to install it instead
of an ImportError from deep inside.

The floor is 2.52.0, the first release with token authentication
(`RAY_AUTH_MODE=token`), which docs/ray.md tells every cluster to turn on
(without it anyone who reaches Ray's ports runs code as you). A release newer
than the newest tested minor release is refused too, as the Keras gate refuses
an untested Keras: Ray Train's worker setup and `ray.train.report` have changed
between minor releases, and a deep traceback from inside Ray (or a silently
different TF_CONFIG) is worse than a message. `STRATKIT_RAY_UNTESTED=1` runs it
anyway, with a one-time warning. Releases between the floor and the newest
tested one are accepted, as the `stratkit[ray]` pin accepts them.
"""

from __future__ import annotations

import os
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
#: Set to 1 to run on a Ray newer than the newest tested release (with a warning) instead of a ConfigError.
ENV_VAR = "STRATKIT_RAY_UNTESTED"

_warned: set[str] = set()
_lock = threading.Lock()


def parse(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a Ray version string ("2.60.0", "2.61.0rc1", "3.0.0.dev0")."""
    match = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        raise ConfigError(f"cannot read Ray's version {version!r}. Fix: {INSTALL}")
    return int(match[1]), int(match[2]), int(match[3] or 0)


def _opted_in() -> bool:
    """Whether `ENV_VAR` asks to run an untested Ray; a value other than 0/1 is a ConfigError."""
    raw = os.environ.get(ENV_VAR, "").strip()
    if raw in ("", "0"):
        return False
    if raw == "1":
        return True
    raise ConfigError(f"{ENV_VAR}={raw!r} is not understood. Fix: {ENV_VAR}=1 runs a Ray newer than the "
                      f"tested releases at your own risk; unset it (or 0) to refuse one")


def tested_range() -> str:
    """The Ray releases accepted without opting in, for messages: ">= 2.52.0, <= 2.60.x (tested: ...)"."""
    newest = parse(max(TESTED_RAY_VERSIONS, key=parse))
    return (f"Ray >= {'.'.join(map(str, RAY_FLOOR))}, <= {newest[0]}.{newest[1]}.x "
            f"(tested: {', '.join(sorted(TESTED_RAY_VERSIONS, key=parse))})")


def check_version(version: str, api: str) -> None:
    """Refuse a Ray older than `RAY_FLOOR`, or newer than the newest tested minor release unless `ENV_VAR`=1.

    Raises:
        ConfigError: naming the installed version, the tested range and the fix.
    """
    found = parse(version)
    floor = ".".join(map(str, RAY_FLOOR))
    if found < RAY_FLOOR:
        raise ConfigError(f"{api} needs Ray >= {floor} (token authentication, Ray Train V2): Ray {version} is "
                          f"installed. Fix: {INSTALL} (or pip install -U \"ray[train]>={floor}\")")
    newest = max(TESTED_RAY_VERSIONS, key=parse)
    if found[:2] <= parse(newest)[:2]:
        return
    if not _opted_in():
        raise ConfigError(f"{api}: Ray {version} is installed, newer than the Ray releases stratkit was tested on "
                          f"({tested_range()}). Fix: {INSTALL} (Ray {newest}), or set {ENV_VAR}=1 to run on "
                          f"Ray {version} anyway, at your own risk (inside Ray Train, also in the workers' "
                          f"environment: runtime_env={{'env_vars': {{'{ENV_VAR}': '1'}}}})")
    with _lock:
        if version in _warned:
            return
        _warned.add(version)
    log.warning("Ray %s is newer than the newest Ray stratkit was tested on (%s); running it because %s=1. "
                "If the run misbehaves: pip install \"ray[train]==%s\"", version, newest, ENV_VAR, newest)


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
