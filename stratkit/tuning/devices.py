"""The devices a trial trains on: its tuner's own, never another tuner's.

A tune run sets no TF_CONFIG (each tuner trains its trials alone), and the
engine pins each tuner's GPUs (the launcher's CUDA_VISIBLE_DEVICES), so a trial
trains on what `stratkit.detect()` sees here: Mirrored over this tuner's GPUs
when it has several, else Keras without a strategy (one GPU, or the CPU).

Imports TensorFlow only when this tuner has several GPUs.
"""

from __future__ import annotations

from typing import Any


def own_devices_strategy() -> Any:
    """The strategy a trial trains under on this tuner: Mirrored over its GPUs when it has several, else None:
    one device trains as Keras does without a strategy (a OneDeviceStrategy computes the same and costs seconds
    per trial in its input pipeline)."""
    from stratkit.cluster import detect

    spec = detect()
    if spec.strategy != "mirrored":
        return None
    from stratkit.strategy.factory import make_strategy

    return make_strategy(spec)


__all__ = ["own_devices_strategy"]
