"""`Trainer.build` with a model from tf_keras (legacy Keras 2): a message about Keras versions.

stratkit's Trainer drives Keras 3 models. A tf_keras model needs none of
stratkit's Keras 3 fixes and trains correctly under `stratkit.make_strategy()`
with tf_keras's own `fit`, so the error says exactly that.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from procs import describe, run_process

pytestmark = pytest.mark.slow


def test_a_tf_keras_model_is_refused_with_a_message_about_keras_versions():
    pytest.importorskip("tf_keras")
    result = run_process(textwrap.dedent('''
        import json
        import stratkit
        trainer = stratkit.Trainer()
        import numpy as np
        import tf_keras

        def build():
            model = tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(4,))])
            model.compile(optimizer="sgd", loss="mse")
            return model

        try:
            trainer.build(build)
            print(json.dumps({"error": None}))
        except stratkit.ConfigError as exc:
            print(json.dumps({"error": str(exc)}))

        # What the message recommends really trains: make_strategy() + tf_keras's own fit.
        strategy = stratkit.make_strategy()
        with strategy.scope():
            model = build()
        x = np.ones((32, 4), "float32")
        history = model.fit(x, x.sum(axis=1, keepdims=True), batch_size=8, epochs=2, verbose=0)
        print(json.dumps({"losses": history.history["loss"]}))
    '''), env={"TF_USE_LEGACY_KERAS": None, "STRATKIT_KERAS_COMPAT": None}, timeout=120)
    assert result.ok, describe([result])
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    error = json.loads(lines[0])["error"]
    assert error is not None, result.stdout
    assert "tf_keras" in error and "Keras 2" in error and "Keras 3" in error
    assert "none of stratkit's Keras 3 fixes" in error
    assert "stratkit.make_strategy()" in error and "model.fit" in error
    losses = json.loads(lines[1])["losses"]
    assert len(losses) == 2 and losses[1] < losses[0]
