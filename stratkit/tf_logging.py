"""TensorFlow's start-up noise: logging defaults for the training processes stratkit starts.

One place for every front door (the local launcher, the Spark runner, the Ray runner).

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

Every front door uses both parts: `stratkit launch` (`launch/plan.py` adds the
defaults, `launch/attempt.py` filters each task's output, console and log
alike), the Spark runner (`spark/process.py`) and the Ray runner (`ray/task.py`).

A task that Slurm starts (`srun python train.py`) has no stratkit parent to do
either, so `quiet_tensorflow_import` does both inside the task, around
TensorFlow's import and its device probe (where every start-up line is
printed): `stratkit/__init__` uses it when a name that needs TensorFlow is
first taken from `stratkit` in an srun task that has not imported TensorFlow
yet. For that window the process's stderr (fd 2, where C++ writes) goes through
a small filter process that writes the kept lines to the real stderr, line by
line: a crash inside the window loses nothing (the filter reads to the end
after the task dies).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager

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


def started_by_srun(env: Mapping[str, str]) -> bool:
    """True in a task of an `srun` job step (a batch script itself is not one)."""
    return "SLURM_STEP_NUM_TASKS" in env and "SLURM_PROCID" in env


def _probe_devices() -> None:
    """Import TensorFlow and list its devices: where it prints its start-up lines (the CUDA probe too).
    Listing physical devices creates no context, so a strategy can still be configured after it."""
    import tensorflow as tf

    tf.config.list_physical_devices()


@contextmanager
def quiet_tensorflow_import(env: MutableMapping[str, str] | None = None) -> Iterator[None]:
    """Inside the block, TensorFlow's start-up noise on fd 2 is dropped as `StartupNoise` decides;
    at its end TensorFlow is imported and its devices probed. Sets the quiet default in `env`
    (default `os.environ`, which TensorFlow's C++ reads at import) unless the user set a level."""
    env = os.environ if env is None else env
    env.update(quiet_defaults(env))
    if StartupNoise(env).level <= 0 or "tensorflow" in sys.modules:
        yield
        _probe_devices()
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        # -I: the filter needs only this file and the standard library (no site, no PYTHONPATH). Own
        # session: a signal to the task's process group (Ctrl-C, a kill of the task) leaves it to read to
        # the end, so what the task wrote before it died still comes out.
        filter_ = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                   stdout=saved, stderr=saved, env=dict(env), start_new_session=True)
    except OSError:
        os.close(saved)
        yield
        _probe_devices()
        return
    assert filter_.stdin is not None
    os.dup2(filter_.stdin.fileno(), 2)
    try:
        yield
        _probe_devices()
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        filter_.stdin.close()
        filter_.wait()


def _filter(source, sink, env: Mapping[str, str]) -> None:
    noise = StartupNoise(env)
    for raw in source:
        if noise.keep(raw.decode(errors="replace").rstrip("\r\n")):
            sink.write(raw)
            sink.flush()


if __name__ == "__main__":      # the filter process of quiet_tensorflow_import
    _filter(sys.stdin.buffer, sys.stdout.buffer, os.environ)
