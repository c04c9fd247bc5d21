"""Weight regularizers, `add_loss` and sample weights train on a parameter-server cluster exactly as in Keras' fit.

One script runs as every task of a real PS cluster (chief + 2 workers + 1 ps,
processes on 127.0.0.1) and, as the reference, as one process (`one_device`:
Keras' own `model.fit`). Asynchronous workers make most numbers
order-dependent, so the data is built to make them exact:

* every row appears twice, consecutively: the two workers' shards (rows 0, 2,
  4, ... and 1, 3, 5, ...) hold the same 32 rows, so with a global batch of 32
  every PS step sees exactly those 32 rows;
* phase A trains with learning rate 0: the weights do not move, so every
  step's loss is the full-data loss (data term weighted by sample weights +
  `add_loss` term + L1/L2 terms), whichever worker runs it and however many
  steps each runs; Keras' fit over the 64 rows (two batches of 32) logs the
  same mean;
* phase B trains one step with learning rate 0.1: one worker, one batch of the
  32 distinct rows, so the new weights equal Keras' one step on those rows.
"""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

from procs import cluster_tf_configs, describe, free_ports, run_cluster, run_process

SCRIPT = textwrap.dedent('''
    import json, os, sys
    import stratkit

    trainer = stratkit.Trainer()   # ps and worker tasks serve here, then exit
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    base_x = rng.normal(size=(32, 8)).astype("float32")
    base_y = rng.integers(0, 3, size=32).astype("int32")
    base_w = rng.uniform(0.2, 3.0, size=32).astype("float32")
    doubled = tuple(np.repeat(a, 2, axis=0) for a in (base_x, base_y, base_w))


    class ActivityPenalty(keras.layers.Layer):
        def call(self, inputs):
            self.add_loss(0.05 * keras.ops.mean(keras.ops.square(inputs)))
            return inputs


    def build():
        model = keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(16, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.02)),
            ActivityPenalty(),
            keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L2(0.02),
                               bias_regularizer=keras.regularizers.L1(0.01)),
        ])
        model.compile(optimizer=keras.optimizers.SGD(0.0),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], weighted_metrics=["accuracy"])
        return model


    model = trainer.build(build)
    init = np.random.default_rng(1)
    model.set_weights([init.normal(scale=0.5, size=w.shape).astype("float32") for w in model.get_weights()])
    ps = trainer.spec.strategy == "parameter_server"
    # Phase A: learning rate 0, 8 steps on PS (4 passes over each shard), one pass (2 steps) in Keras' fit.
    frozen = trainer.fit(model, doubled, epochs=1, steps_per_epoch=8 if ps else None, global_batch_size=32,
                         verbose=0)
    # Phase B: one step at learning rate 0.1 on the 32 distinct rows.
    model.optimizer.learning_rate.assign(0.1)
    trainer.fit(model, doubled if ps else (base_x, base_y, base_w), epochs=1, steps_per_epoch=1,
                global_batch_size=32, verbose=0)
    report = {"strategy": trainer.spec.strategy,
              "frozen": {k: v[-1] for k, v in frozen.history.items() if k != "examples_per_sec"},
              "frozen_steps": getattr(frozen, "steps", None),
              "weights": [w.tolist() for w in model.get_weights()]}
    with open(os.environ["OUT"] + f"-{trainer.spec.task_type or 'local'}.json", "w") as handle:
        json.dump(report, handle)
''')


def _ps_cluster() -> list[dict]:
    ports = iter(free_ports(4))
    return cluster_tf_configs({"chief": [f"127.0.0.1:{next(ports)}"],
                               "worker": [f"127.0.0.1:{next(ports)}", f"127.0.0.1:{next(ports)}"],
                               "ps": [f"127.0.0.1:{next(ports)}"]})


@pytest.mark.slow
@pytest.mark.multiworker
def test_regularizers_add_loss_and_sample_weights_match_keras_fit_on_a_ps_cluster(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = str(tmp_path / "report")
    env = {"OUT": out, "STRATKIT_CHIEF_GRACE_SECONDS": "60"}
    results = run_cluster(str(script), _ps_cluster(), env=env, timeout=180, grace_after_failure=30)
    assert all(r.ok for r in results), describe(results)
    reference = run_process(str(script), env=env, timeout=120)
    assert reference.ok, describe([reference])
    ps = json.loads((tmp_path / "report-chief.json").read_text())
    keras_fit = json.loads((tmp_path / "report-local.json").read_text())
    assert ps["strategy"] == "parameter_server" and keras_fit["strategy"] == "one_device"

    assert ps["frozen_steps"] == 8
    # Loss with every term (sample-weighted data loss, add_loss, L1 and L2) and both accuracies.
    assert sorted(ps["frozen"]) == sorted(keras_fit["frozen"]) == ["accuracy", "loss", "weighted_accuracy"]
    for name, value in keras_fit["frozen"].items():
        assert ps["frozen"][name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    # The gradient has every term too: one step gives Keras' weights.
    for got, want in zip(ps["weights"], keras_fit["weights"], strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
