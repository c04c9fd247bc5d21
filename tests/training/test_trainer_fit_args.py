"""`Trainer.fit` takes what users pass to `model.fit` (issue 23, item 6): honoured and equal to
`model.fit` on the same data, or refused in one `ConfigError` that names the alternative.

Every comparison builds two models with the same initial weights under the same one-device strategy:
one trained by `trainer.fit`, one by Keras's own `model.fit` (through stratkit's guard), unshuffled.
The 2-worker run is in `test_trainer_multiworker.py`.
"""

from __future__ import annotations

import numpy as np
import pytest

import stratkit
from stratkit.errors import ConfigError

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

pytestmark = pytest.mark.slow

CLASS_WEIGHT = {0: 1.0, 1: 3.0, 2: 0.5}


@pytest.fixture(scope="module")
def trainer():
    return stratkit.Trainer(strategy="one_device")


def _classifier():
    keras.utils.set_random_seed(7)  # the same initial weights for both models of a comparison
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def _data(n=64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype("float32")
    return x, rng.integers(0, 3, size=(n,)).astype("int32")


def _pair(trainer):
    return trainer.build(_classifier), trainer.build(_classifier)


def _assert_same_weights(a, b, atol=1e-6):
    for left, right in zip(a.get_weights(), b.get_weights(), strict=True):
        np.testing.assert_allclose(left, right, atol=atol)


class Batches(keras.utils.PyDataset):
    """A finite PyDataset of (x, y) batches of `batch` rows."""

    def __init__(self, x, y, batch, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.batch = x, y, batch

    def __len__(self):
        return len(self.x) // self.batch

    def __getitem__(self, i):
        rows = slice(i * self.batch, (i + 1) * self.batch)
        return self.x[rows], self.y[rows]


# -- honoured, equal to model.fit ------------------------------------------------------------------
def test_class_weight_and_validation_split_on_arrays_equal_model_fit(trainer):
    x, y = _data()
    ours, keras_model = _pair(trainer)
    history = trainer.fit(ours, (x, y), epochs=2, global_batch_size=8, shuffle=False, verbose=0,
                          validation_split=0.25, class_weight=CLASS_WEIGHT)
    reference = keras_model.fit(x, y, epochs=2, batch_size=8, shuffle=False, verbose=0, validation_split=0.25,
                                class_weight=CLASS_WEIGHT)
    _assert_same_weights(ours, keras_model)
    # The last quarter was held out, as Keras does (not trained on, evaluated each epoch).
    assert history.history["val_loss"] == pytest.approx(reference.history["val_loss"], abs=1e-6)
    assert history.history["loss"] == pytest.approx(reference.history["loss"], abs=1e-6)


def test_sample_weight_and_y_keywords_equal_model_fit(trainer):
    x, y = _data()
    weights = np.linspace(0.1, 2.0, len(x)).astype("float32")
    ours, keras_model = _pair(trainer)
    trainer.fit(ours, x, y=y, sample_weight=weights, epochs=2, batch_size=16, shuffle=False, verbose=0)
    keras_model.fit(x, y, sample_weight=weights, epochs=2, batch_size=16, shuffle=False, verbose=0)
    _assert_same_weights(ours, keras_model)
    also = trainer.build(_classifier)
    trainer.fit(also, (x, y), sample_weight=weights, epochs=2, global_batch_size=16, shuffle=False, verbose=0)
    _assert_same_weights(also, keras_model)


def test_initial_epoch_and_validation_freq_equal_model_fit(trainer):
    x, y = _data()
    ours, keras_model = _pair(trainer)
    history = trainer.fit(ours, (x, y), epochs=4, initial_epoch=1, validation_data=(x[:16], y[:16]),
                          validation_freq=2, validation_batch_size=4, global_batch_size=8, shuffle=False,
                          verbose=0)
    reference = keras_model.fit(x, y, epochs=4, initial_epoch=1, validation_data=(x[:16], y[:16]),
                                validation_freq=2, validation_batch_size=4, batch_size=8, shuffle=False, verbose=0)
    _assert_same_weights(ours, keras_model)
    assert len(history.history["loss"]) == 3                      # epochs 2, 3 and 4 only
    assert history.history["val_loss"] == pytest.approx(reference.history["val_loss"], abs=1e-6)
    assert len(history.history["val_loss"]) == 2                  # validated after epochs 2 and 4 (1-based)


def test_a_py_dataset_trains_with_its_own_batch_equal_to_model_fit(trainer):
    x, y = _data()
    ours, keras_model = _pair(trainer)
    history = trainer.fit(ours, Batches(x, y, 8), epochs=2, verbose=0, class_weight=CLASS_WEIGHT,
                          validation_data=Batches(x[:16], y[:16], 8))
    reference = keras_model.fit(Batches(x, y, 8), epochs=2, verbose=0, shuffle=False, class_weight=CLASS_WEIGHT,
                                validation_data=Batches(x[:16], y[:16], 8))
    _assert_same_weights(ours, keras_model)
    assert history.history["val_loss"] == pytest.approx(reference.history["val_loss"], abs=1e-6)
    assert history.history["examples_per_sec"]                    # its batch (8) is the global batch
    # A size given must be its batch; steps_per_epoch must make every epoch as long (a divisor of its length).
    assert trainer.fit(trainer.build(_classifier), Batches(x, y, 8), global_batch_size=8, steps_per_epoch=4,
                       epochs=2, verbose=0).history["loss"]
    assert trainer.evaluate(ours, Batches(x, y, 8))["loss"] == pytest.approx(
        keras_model.evaluate(Batches(x, y, 8), verbose=0, return_dict=True)["loss"], abs=1e-6)


# -- refused in one message --------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"global_batch_size": 16}, r"PyDataset.*its batch of 8 rows is the global batch.*global_batch_size=16.*"
                                r"Fix: drop global_batch_size"),
    ({"steps_per_epoch": 3}, r"steps_per_epoch=3 does not divide the PyDataset's 8 batches.*Fix: "
                             r"steps_per_epoch=None.*or one of 1, 2, 4, 8"),
    ({"steps_per_epoch": 9}, r"steps_per_epoch=9 does not divide the PyDataset's 8 batches"),
])
def test_a_py_dataset_with_another_batch_or_uneven_epochs_is_refused_in_one_message(trainer, kwargs, message):
    x, y = _data()
    with pytest.raises(ConfigError, match=message):
        trainer.fit(trainer.build(_classifier), Batches(x, y, 8), verbose=0, **kwargs)


def test_a_python_generator_is_refused_naming_py_dataset_and_tf_data(trainer):
    x, y = _data()

    def batches():
        for i in range(0, 64, 8):
            yield x[i:i + 8], y[i:i + 8]

    with pytest.raises(ConfigError, match=r"a Python generator.*keras.utils.PyDataset.*"
                                          r"tf.data.Dataset.from_generator\(<the generator function>"):
        trainer.fit(trainer.build(_classifier), batches(), epochs=1, verbose=0)


@pytest.mark.parametrize("call, message", [
    (lambda t, m, x, y: t.fit(m, tf.data.Dataset.from_tensor_slices((x, y)), global_batch_size=8,
                              validation_split=0.2),
     r"validation_split=0.2 splits arrays only.*data is a tf.data.Dataset.*Fix: pass validation_data"),
    (lambda t, m, x, y: t.fit(m, (x, y), global_batch_size=8, validation_split=0.2, validation_data=(x, y)),
     r"both validation_split=0.2 and validation_data.*Fix: give one"),
    (lambda t, m, x, y: t.fit(m, (x, y), global_batch_size=8, validation_split=1.5),
     r"validation_split must be a number in \[0, 1\): got 1.5"),
    (lambda t, m, x, y: t.fit(m, (x, y, np.ones(len(x))), global_batch_size=8, class_weight=CLASS_WEIGHT),
     r"class_weight and sample weights.*Fix: fold the class weights into the sample weights, or drop one"),
    (lambda t, m, x, y: t.fit(m, (x, y, np.ones(len(x))), global_batch_size=8, sample_weight=np.ones(len(x))),
     r"sample_weight is given, and data already holds sample weights.*Fix: give them once"),
    (lambda t, m, x, y: t.fit(m, (x, y), global_batch_size=8, y=y),
     r"y is given, and data already holds y.*Fix: give them once"),
    (lambda t, m, x, y: t.fit(m, (x, y), global_batch_size=8, batch_size=16),
     r"batch_size=16 and global_batch_size=8 disagree.*Fix: give one"),
    (lambda t, m, x, y: t.fit(m, (x, y), global_batch_size=8, x=x),
     r"Trainer.fit takes x as data.*Fix: trainer.fit\(model, \(x, y\)"),
    (lambda t, m, x, y: t.fit(m, (x, y), global_batch_size=8, epoch=3),
     r"Trainer.fit got an unexpected keyword argument 'epoch'.*Fix: one of .*class_weight"),
    (lambda t, m, x, y: t.fit(m, x, y),
     r"epochs must be a positive integer: got an array.*Fix: pass \(x, y\) as data"),
])
def test_what_cannot_be_honoured_is_a_config_error_naming_the_alternative(trainer, call, message):
    x, y = _data()
    with pytest.raises(ConfigError, match=message):
        call(trainer, trainer.build(_classifier), x, y)
