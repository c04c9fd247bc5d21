"""Parameter-server `trainer.fit` on numpy data works after `keras.utils.set_random_seed(0)`.

Found porting TF's parameter-server tutorial: with the global seed 0 (the usual
`keras.utils.set_random_seed(0)`), TF compares the shuffle's op seed with 0 as a
Python bool; the per-worker shuffle seed was a tensor (the worker's index), so the
chief crashed in `create_per_worker_dataset` with `OperatorNotAllowedInGraphError`.
"""

from __future__ import annotations

import pytest

from procs import cluster_tf_configs, describe, free_ports, run_cluster

pytestmark = [pytest.mark.slow, pytest.mark.multiworker]

SCRIPT = """
import json
import numpy as np
import stratkit

trainer = stratkit.Trainer()
import keras

keras.utils.set_random_seed(0)        # global seed 0: what broke the per-worker shuffle


def build():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
y = (x[:, 0] > 0).astype("int32")
model = trainer.build(build)
history = trainer.fit(model, (x, y), epochs=2, steps_per_epoch=3, global_batch_size=8)
print(json.dumps({"epochs": len(history.history["loss"])}), flush=True)
"""


def test_ps_fit_on_numpy_data_after_a_global_seed_of_zero():
    ports = iter(free_ports(3))
    configs = cluster_tf_configs({"chief": [f"127.0.0.1:{next(ports)}"], "worker": [f"127.0.0.1:{next(ports)}"],
                                  "ps": [f"127.0.0.1:{next(ports)}"]})
    results = run_cluster(SCRIPT, configs, timeout=150, grace_after_failure=30,
                          env={"STRATKIT_CHIEF_GRACE_SECONDS": "60"})
    assert all(r.ok for r in results), describe(results)
    assert results[0].last_json() == {"epochs": 2}
