"""The devices a trial trains on: its tuner's own, never another tuner's.

A tune run sets no TF_CONFIG (each tuner trains its trials alone), and the
engine pins each tuner's GPUs (the launcher's CUDA_VISIBLE_DEVICES), so a trial
trains on what `stratkit.detect()` sees here: Mirrored over this tuner's GPUs
when it has several, else Keras without a strategy (one GPU, or the CPU); a
multi-worker trial group (`--workers-per-trial K`) trains under
MultiWorkerMirrored over its K workers.

Imports TensorFlow only when this tuner has several GPUs.
"""

from __future__ import annotations

from typing import Any

from stratkit.errors import ConfigError


def own_devices_strategy(group: tuple[int, int] = (0, 1)) -> Any:
    """The strategy a trial trains under on this tuner: MultiWorkerMirrored over its group's workers when the
    tuner is a multi-worker trial group (`stratkit.tuning.groups`: its TF_CONFIG is the group's); else
    Mirrored over its GPUs when it has several (the launcher pinned them: CUDA_VISIBLE_DEVICES), else None:
    one device trains as Keras does without a strategy (a OneDeviceStrategy computes the same and costs
    seconds per trial in its input pipeline).

    Args:
        group: (this worker's index in its trial group, the group's size); (0, 1) is one tuner per worker.

    Raises:
        ConfigError: a multi-worker group whose TF_CONFIG is not that group's.
    """
    from stratkit.cluster import detect

    spec = detect()
    if group[1] > 1:
        if spec.strategy != "multi_worker_mirrored" or spec.num_workers != group[1]:
            raise ConfigError(f"this tuner is worker {group[0]} of a multi-worker trial group of {group[1]}, but "
                              f"stratkit.detect() sees {spec.strategy} with {spec.num_workers} worker(s) "
                              f"({spec.source}). Fix: start the search with stratkit launch --tune "
                              "--workers-per-trial K, which gives each group its TF_CONFIG")
        from stratkit.strategy.keras_compat import runtime_initialized

        if runtime_initialized():  # KerasTuner's constructor builds a model: TensorFlow started before tune()
            raise ConfigError(f"this tuner is worker {group[0]} of a multi-worker trial group of {group[1]}, whose "
                              "MultiWorkerMirroredStrategy must exist before TensorFlow runs any op, and TensorFlow "
                              "already ran (a KerasTuner tuner builds a model when it is made). Fix: at the top of "
                              "the script, strategy = stratkit.make_strategy(), and make the tuner with "
                              "distribution_strategy=strategy")
    elif spec.strategy != "mirrored":
        return None
    from stratkit.strategy.factory import make_strategy

    return make_strategy(spec)


__all__ = ["own_devices_strategy"]
