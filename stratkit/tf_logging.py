"""TensorFlow's start-up noise: logging defaults for the training processes stratkit starts.

One place for both front doors (the local launcher and the Spark runner).

Two parts, because TensorFlow 2.21 logs some lines before its own logging is
configured:
  * `quiet_defaults(env)`: TF_CPP_MIN_LOG_LEVEL=2 (hide TensorFlow's C++ INFO
    and WARNING lines) unless the user set it -- an explicit setting always wins;
  * `StartupNoise(env).keep(line)`: the lines absl prints before TensorFlow
    initialises logging ignore TF_CPP_MIN_LOG_LEVEL (measured: "WARNING: All
    log messages before absl::InitializeLog() ...", "I0000 ... port.cc] oneDNN
    custom operations are on", "I0000 ... cudart_stub.cc] Could not find cuda
    drivers", printed twice per import). They are dropped when their severity
    is below the effective TF_CPP_MIN_LOG_LEVEL, as TensorFlow would have done;
    the "failed call to cuInit" error (an ERROR, so kept by level 2) is dropped
    only where no GPU was to be used: GPUs hidden on purpose
    (CUDA_VISIBLE_DEVICES=""), or a machine without CUDA drivers, which
    TensorFlow says first ("cudart_stub.cc] Could not find cuda drivers on your
    machine, GPU will not be used"). On a machine with drivers it is kept: there
    it is a real problem.

Both front doors use both parts: `stratkit launch` (`launch/plan.py` adds the
defaults, `launch/attempt.py` filters each task's output, console and log
alike) and the Spark runner (`spark/process.py`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

LEVEL_VAR = "TF_CPP_MIN_LOG_LEVEL"
DEFAULT_LEVEL = "2"

_PRE_INIT = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
# absl/glog line prefix: severity letter, MMDD, time (before absl's init: 00:00:<epoch seconds>), thread id,
# file:line]
_ABSL_LINE = re.compile(r"^(?P<severity>[IWEF])\d{4} [\d:.]+\s+\d+\s+\S+:\d+\]")
_SEVERITY = {"I": 0, "W": 1, "E": 2, "F": 3}
_CUDA_PROBE = ("failed call to cuInit", "cuda_platform.cc", "cuda_executor.cc")
_NO_DRIVER = "Could not find cuda drivers on your machine"


def quiet_defaults(env: Mapping[str, str]) -> dict[str, str]:
    """The logging variables to add to `env` for a training process (only those the user did not set)."""
    return {} if LEVEL_VAR in env else {LEVEL_VAR: DEFAULT_LEVEL}


class StartupNoise:
    """Decides which output lines of a training process are TensorFlow noise the user asked not to see.

    Args:
        env: the training process's environment (after `quiet_defaults`).
    """

    def __init__(self, env: Mapping[str, str]) -> None:
        try:
            self.level = int(env.get(LEVEL_VAR, "0"))
        except ValueError:
            self.level = 0
        self.gpus_hidden = env.get("CUDA_VISIBLE_DEVICES") == ""
        self.no_driver = False  # TensorFlow said so: no GPU will be used

    def keep(self, line: str) -> bool:
        if self.level <= 0:
            return True
        if _NO_DRIVER in line and _ABSL_LINE.match(line):
            self.no_driver = True
        if line.startswith(_PRE_INIT):
            return False
        match = _ABSL_LINE.match(line)
        if match is None:
            return True
        severity = _SEVERITY[match["severity"]]
        if severity < self.level:
            return False
        no_gpu_wanted = self.gpus_hidden or self.no_driver
        return not (no_gpu_wanted and severity == 2 and any(probe in line for probe in _CUDA_PROBE))
