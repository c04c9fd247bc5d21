"""Count local GPUs without importing TensorFlow.

`CUDA_VISIBLE_DEVICES` decides when it is set (that is what TensorFlow will
see); otherwise the NVIDIA driver's /proc entries are counted.

For tests only, `STRATKIT_FAKE_GPU_COUNT=N` stands in for the driver on a
machine without GPUs (it is read only when CUDA_VISIBLE_DEVICES is unset), so
the launcher's, Slurm's and Spark's GPU planning run end to end on CPU.
TensorFlow itself still sees no GPU.
"""

from __future__ import annotations

import os
from typing import Mapping

from stratkit.errors import ConfigError

_DRIVER_DIR = "/proc/driver/nvidia/gpus"
#: A stand-in GPU inventory for tests (see the module docstring); never set it on a real host.
FAKE_COUNT_VAR = "STRATKIT_FAKE_GPU_COUNT"


def count_gpus(env: Mapping[str, str]) -> int:
    """GPUs this process will see."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        # CUDA stops at the first invalid id such as -1, so "0,-1,1" shows one GPU.
        count = 0
        for gpu_id in ids:
            if gpu_id.startswith("-"):
                break
            count += 1
        return count
    fake = env.get(FAKE_COUNT_VAR, "").strip()
    if fake:
        if not (fake.isascii() and fake.isdigit()) or len(fake) > 4:
            raise ConfigError(f"{FAKE_COUNT_VAR}={fake!r} is not a GPU count. Fix: a whole number such as "
                              f"{FAKE_COUNT_VAR}=8 (a stand-in for tests), or unset it")
        return int(fake)
    try:
        return len(os.listdir(_DRIVER_DIR))
    except OSError:
        return 0
