"""Count local GPUs without importing TensorFlow.

`CUDA_VISIBLE_DEVICES` decides when it is set (that is what TensorFlow will
see); otherwise the NVIDIA driver's /proc entries are counted.
"""

from __future__ import annotations

import os
from typing import Mapping

_DRIVER_DIR = "/proc/driver/nvidia/gpus"


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
    try:
        return len(os.listdir(_DRIVER_DIR))
    except OSError:
        return 0
