"""Each column in its own type, from the DataFrame to the model (issue 49), on a real 2-executor Spark.

int64 ids above 2^24, strings, a list of two inputs (64 + 1 columns) with two heads, and a subclassed model
(a tuple in, a dict out): `KerasEstimator` on 2 workers trains as one process does on the same rows (full
batches: weights and history within 1e-5), `transform` / `keras_predict` score as the one-process model's
`predict`, and `SparkRunner` with a `DataFrameInput` feeds the model by `dataset_fn(..., model=model)`. A cast
that would change a value is a `ConfigError` naming the column before training.

The session is tests/spark/test_spark_runner.py's (`shared_session`): the executors start once for the modules.
"""

from __future__ import annotations

import sys

import cloudpickle
import ml_models
import numpy as np
import pytest
from ml_models import build_ids
from spark_helpers import shared_session

from stratkit.errors import ConfigError

pytestmark = [pytest.mark.slow, pytest.mark.spark]

cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(ml_models)

ID_ROWS = 200
ID_EPOCHS = 10  # one process reaches accuracy 1.0 at epoch 3; ids rounded to float32 cap it at 0.75
DIGIT_ROWS = 240


@pytest.fixture(scope="module")
def spark():
    return shared_session("local-cluster[2,1,1024]", {"spark.stratkit.stage": "arrow"})


def _one_process(build, x, y, batch, epochs):
    """(the model, its history) trained in this process on full batches in row order: the reference (through
    tf.data when `x` holds strings, which Keras's numpy adapter does not take)."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    model = build()
    if any(np.asarray(v).dtype == object for v in keras.tree.flatten(x)):
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
        history = model.fit(data, epochs=epochs, shuffle=False, verbose=0)
    else:
        history = model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return model, history.history


def _assert_same_weights(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


# -- int64 ids above 2^24 -------------------------------------------------------------------------

def _ids():
    ids = np.arange(ml_models.ID_BASE, ml_models.ID_BASE + ID_ROWS, dtype="int64")
    return ids, ids % 2


@pytest.fixture(scope="module")
def ids_frame(spark):
    ids, parity = _ids()
    return spark.createDataFrame([(int(i), int(p)) for i, p in zip(ids, parity)], "id long, label long").repartition(2)


@pytest.fixture(scope="module")
def ids_reference():
    ids, parity = _ids()
    return _one_process(ml_models.build_ids, ids.reshape(-1, 1), parity, ID_ROWS, ID_EPOCHS)


def test_int64_ids_above_2_24_train_on_two_workers_as_one_process_and_transform_scores_them(ids_frame,
                                                                                              ids_reference):
    from stratkit.spark import KerasEstimator

    model, history = ids_reference
    assert history["accuracy"][-1] == 1.0
    fitted = KerasEstimator(buildFn=ml_models.build_ids, featuresCols=["id"], labelCols=["label"], epochs=ID_EPOCHS,
                            batchSize=ID_ROWS, numWorkers=2, seed=0, shuffle=False, verbose=0).fit(ids_frame)
    assert fitted.training_info["workers"] == 2
    assert fitted.history["accuracy"][-1] == 1.0
    np.testing.assert_allclose(fitted.history["loss"], history["loss"], atol=1e-5, rtol=0)
    _assert_same_weights(fitted.keras_model().get_weights(), model.get_weights())
    rows = sorted(fitted.transform(ids_frame).select("id", "label", "prediction").collect())
    ids, parity = _ids()
    assert [r["id"] for r in rows] == ids.tolist()
    predictions = np.array([r["prediction"] for r in rows])
    np.testing.assert_allclose(predictions, model.predict(ids.reshape(-1, 1), verbose=0)[:, 0], atol=1e-5, rtol=0)
    assert ((predictions > 0.5) == parity.astype(bool)).all()


def train_ids(data, epochs):
    """train_fn for SparkRunner: the int64 model on this worker's rows, typed for the model by dataset_fn."""
    import stratkit

    trainer = stratkit.Trainer()
    model = trainer.build(build_ids)
    history = trainer.fit(model, data.dataset_fn(ID_ROWS, model=model, shuffle=False),
                          steps_per_epoch=data.steps_per_epoch(ID_ROWS, trainer.num_replicas), epochs=epochs,
                          verbose=0)
    return {"weights": model.get_weights(), "history": history.history}


def test_int64_ids_train_with_sparkrunner_and_a_dataframe_input_as_one_process(ids_frame, ids_reference):
    from stratkit.spark import DataFrameInput, SparkRunner

    model, history = ids_reference
    result = SparkRunner(num_workers=2).run(train_ids, DataFrameInput(ids_frame, feature_cols=["id"]), ID_EPOCHS)
    assert result["history"]["accuracy"][-1] == 1.0
    np.testing.assert_allclose(result["history"]["loss"], history["loss"], atol=1e-5, rtol=0)
    _assert_same_weights(result["weights"], model.get_weights())


def test_a_cast_that_would_change_ids_is_refused_naming_the_column_before_training(ids_frame, capsys):
    from stratkit.spark import KerasEstimator

    estimator = KerasEstimator(buildFn=ml_models.build_float_ids, featuresCols=["id"], labelCols=["label"],
                               batchSize=ID_ROWS, numWorkers=2)
    with pytest.raises(ConfigError, match=r"column 'id': casting its int64 values to the model's float32 would "
                                          r"change them .*dtype='int64'"):
        estimator.fit(ids_frame)
    assert "Epoch 1/" not in capsys.readouterr().out


# -- strings beside numbers -----------------------------------------------------------------------

def _words(n=96):
    rng = np.random.default_rng(4)
    index = np.arange(n) % len(ml_models.WORDS)
    x = rng.normal(size=n)
    return np.array(ml_models.WORDS)[index], x, index * 0.1 + 0.5 * x


def test_a_string_column_beside_a_number_trains_on_two_workers_as_one_process_and_transform_scores_it(spark):
    import tensorflow as tf

    from stratkit.spark import KerasEstimator

    words, x, y = _words()
    frame = spark.createDataFrame([(i, str(w), float(v), float(t)) for i, (w, v, t) in enumerate(zip(words, x, y))],
                                  "id long, word string, x double, label double").repartition(3)
    inputs = {"word": words.astype(object).reshape(-1, 1), "x": x.reshape(-1, 1)}
    model, history = _one_process(ml_models.build_words, inputs, y, len(y), 5)
    fitted = KerasEstimator(buildFn=ml_models.build_words, featuresCols=["word", "x"], labelCols=["label"], epochs=5,
                            batchSize=len(y), numWorkers=2, seed=0, verbose=0).fit(frame)
    np.testing.assert_allclose(fitted.history["loss"], history["loss"], atol=1e-5, rtol=0)
    _assert_same_weights(fitted.keras_model().get_weights(), model.get_weights())
    rows = sorted(fitted.transform(frame).select("id", "prediction").collect())
    expected = model.predict(tf.data.Dataset.from_tensor_slices((inputs,)).batch(len(y)), verbose=0)[:, 0]
    np.testing.assert_allclose([r["prediction"] for r in rows], expected, atol=1e-5, rtol=0)


# -- a list of two inputs and two heads; a subclassed model -----------------------------------------

@pytest.fixture(scope="module")
def digits(spark):
    """(the frame, the pixels, parity, digit and big arrays) of the first DIGIT_ROWS digits."""
    from sklearn.datasets import load_digits

    data = load_digits()
    pixels, digit = data.data[:DIGIT_ROWS] / 16.0, data.target[:DIGIT_ROWS].astype("int64")
    parity, big = digit % 2, (digit >= 5).astype("int64")
    frame = spark.createDataFrame(
        [(i, [float(v) for v in pixels[i]], int(parity[i]), int(digit[i]), int(big[i])) for i in range(DIGIT_ROWS)],
        "id long, pixels array<double>, parity long, digit long, big long").repartition(3)
    return frame, pixels, parity, digit, big


def test_a_list_of_two_inputs_and_two_heads_fit_and_transform_as_one_process(digits):
    from stratkit.spark import KerasEstimator

    frame, pixels, parity, digit, big = digits
    inputs = [pixels, parity.reshape(-1, 1)]
    model, history = _one_process(ml_models.build_two_by_two, inputs, [digit, big], DIGIT_ROWS, 3)
    fitted = KerasEstimator(buildFn=ml_models.build_two_by_two, featuresCols=["pixels", "parity"],
                            labelCols=["digit", "big"], epochs=3, batchSize=DIGIT_ROWS, numWorkers=2, seed=0,
                            verbose=0).fit(frame)
    np.testing.assert_allclose(fitted.history["loss"], history["loss"], atol=1e-5, rtol=0)
    _assert_same_weights(fitted.keras_model().get_weights(), model.get_weights())
    rows = sorted(fitted.transform(frame).select("id", "prediction_digit", "prediction_big").collect())
    expected_digit, expected_big = model.predict(inputs, verbose=0)
    np.testing.assert_allclose([r["prediction_digit"] for r in rows], expected_digit, atol=1e-5, rtol=0)
    np.testing.assert_allclose([r["prediction_big"] for r in rows], expected_big[:, 0], atol=1e-5, rtol=0)


def test_a_subclassed_model_with_a_tuple_in_and_a_dict_out_fits_and_scores_as_one_process(digits):
    from stratkit.spark import KerasEstimator, keras_predict

    frame, pixels, parity, digit, big = digits
    inputs = (pixels, parity.reshape(-1, 1))
    model, history = _one_process(ml_models.build_subclassed, inputs, {"big": big, "digit": digit}, DIGIT_ROWS, 3)
    custom = {"TwoByTwo": ml_models.subclassed_class()}
    fitted = KerasEstimator(buildFn=ml_models.build_subclassed, featuresCols=["pixels", "parity"],
                            labelCols=["big", "digit"], epochs=3, batchSize=DIGIT_ROWS, numWorkers=2, seed=0,
                            verbose=0, customObjects=custom).fit(frame)
    np.testing.assert_allclose(fitted.history["loss"], history["loss"], atol=1e-5, rtol=0)
    _assert_same_weights(fitted.keras_model().get_weights(), model.get_weights())
    expected = model.predict(list(inputs), verbose=0)  # a tuple of two would be read as (x, y)
    for scored in (fitted.transform(frame), keras_predict(frame, fitted.model_bytes(), ["pixels", "parity"],
                                                          custom_objects=custom)):
        rows = sorted(scored.select("id", "prediction_big", "prediction_digit").collect())
        np.testing.assert_allclose([r["prediction_big"] for r in rows], expected["big"][:, 0], atol=1e-5, rtol=0)
        np.testing.assert_allclose([r["prediction_digit"] for r in rows], expected["digit"], atol=1e-5, rtol=0)
