"""A worker's `ParquetShard` read for a model, without Spark: Parquet files as the staging executors write them
(each column in its own type, their min/max reported), batches typed and shaped for the model's inputs."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stratkit.errors import ConfigError
from stratkit.spark.data import StagedData

pytestmark = pytest.mark.slow  # imports TensorFlow

BASE = 2**40


def _staged(tmp_path, labeled=True, **kwargs):
    ids = np.arange(BASE, BASE + 12, dtype="int64")
    table = pa.table({"id": ids, "word": [f"w{i % 3}" for i in range(12)], "label": (ids % 2).astype("int64"),
                      "weight": np.linspace(0.5, 1.5, 12)})
    files = []
    for i, part in enumerate((table.slice(0, 5), table.slice(5))):
        path = tmp_path / f"part-{i:05d}.parquet"
        pq.write_table(part, path, row_group_size=3)
        files.append((path.as_uri(), part.num_rows))
    labels = {"label_col": "label", "weight_col": "weight"} if labeled else {}
    return StagedData(path=str(tmp_path), files=tuple(files), feature_cols=("word", "id"),  # by name: id, word
                      stats=(("id", int(ids[0]), int(ids[-1])),), **labels, **kwargs)


def _model():
    import keras

    word = keras.Input((1,), dtype="string", name="word")
    ids = keras.Input((1,), dtype="int64", name="id")
    hashed = keras.layers.Hashing(16)(ids)
    looked = keras.layers.StringLookup(vocabulary=["w0", "w1", "w2"])(word)
    joined = keras.layers.Concatenate()([keras.ops.cast(hashed, "float32"), keras.ops.cast(looked, "float32")])
    model = keras.Model({"word": word, "id": ids}, keras.layers.Dense(1, activation="sigmoid")(joined))
    model.compile(optimizer="sgd", loss="binary_crossentropy")
    return model


def test_dataset_fn_for_a_model_gives_its_dict_with_ids_exact_strings_labels_and_weights(tmp_path):
    import tensorflow as tf

    model = _model()
    shard = _staged(tmp_path).shard(1, 2)   # rows 6..11: across both files' row groups
    dataset = shard.dataset_fn(4, shuffle=False, model=model)(
        tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=2))
    inputs, labels, weights = next(iter(dataset))
    assert inputs["id"].dtype == tf.int64 and inputs["id"].numpy()[:, 0].tolist() == [BASE + 6, BASE + 7]
    assert inputs["word"].dtype == tf.string and inputs["word"].numpy()[:, 0].tolist() == [b"w0", b"w1"]
    assert labels.numpy().tolist() == [[0], [1]] and weights.dtype == tf.float32
    model.fit(shard.dataset(model=model).batch(3), epochs=1, verbose=0)   # the model takes them as they are
    joined = shard.to_numpy(model=model)
    assert len(joined) == 3 and joined[0]["id"].shape == (6, 1) and joined[2].shape == (6,)


def test_unlabeled_rows_for_a_model_are_its_inputs_alone(tmp_path):
    model = _model()
    (inputs,) = _staged(tmp_path, labeled=False).shard(0, 1).to_numpy(model=model)
    assert sorted(inputs) == ["id", "word"] and inputs["id"][:, 0].tolist() == list(range(BASE, BASE + 12))


def test_without_a_model_the_matrix_refuses_ids_its_dtype_would_change_before_a_row_is_read(tmp_path):
    shard = _staged(tmp_path).shard(0, 1)
    with pytest.raises(ConfigError, match=r"column 'word' holds strings but the model's input 'features' takes "
                                          r"float32"):
        shard.dataset_fn(4)
    staged = _staged(tmp_path)
    numbers = StagedData(staged.path, staged.files, ("id",), "label", stats=staged.stats)
    with pytest.raises(ConfigError, match=r"column 'id': casting its int64 values to the model's float32 would "
                                          r"change them .*or pass model=model to dataset_fn"):
        numbers.shard(0, 1).dataset_fn(4)
    with pytest.raises(ConfigError, match=r"feature_dtype='float64' and model= both choose"):
        _staged(tmp_path, feature_dtype="float64").shard(0, 1).dataset_fn(4, model=_model())


def test_every_worker_count_reads_exactly_its_contiguous_rows_through_the_table_reader(tmp_path):
    """Files of unequal sizes, several row groups, an empty one between: worker i of W gets rows
    [i*N//W, (i+1)*N//W) in file order, each once, whatever W (more workers than rows included)."""
    ids = np.arange(23, dtype="int64")
    files = []
    for i, (lo, hi) in enumerate(((0, 7), (7, 7), (7, 19), (19, 23))):
        path = tmp_path / f"part-{i:05d}-a0.parquet"
        pq.write_table(pa.table({"id": ids[lo:hi], "label": ids[lo:hi] % 2}), path, row_group_size=4)
        files.append((str(path), hi - lo))
    staged = StagedData(path=str(tmp_path), files=tuple(files), feature_cols=("id",), label_col="label")
    for count in (1, 2, 3, 5, 23, 30):
        seen = []
        for index in range(count):
            shard = staged.shard(index, count)
            got = [v for b in shard.record_batches(batch_rows=3) for v in b.column("id").to_pylist()]
            assert got == list(range(index * 23 // count, (index + 1) * 23 // count)), (index, count)
            assert shard.schema()["id"].dtype == "int64"
            seen += got
        assert seen == list(range(23)), count


def test_a_staged_file_rewritten_during_the_run_is_refused_naming_it(tmp_path):
    staged = _staged(tmp_path)
    path = tmp_path / "part-00001.parquet"
    pq.write_table(pa.table({"id": np.arange(3, dtype="int64"), "word": ["a"] * 3, "label": np.zeros(3, "int64"),
                             "weight": np.ones(3)}), path)
    with pytest.raises(ConfigError, match=r"part-00001\.parquet.* hold \[3\] rows, not the \[7\] the staging wrote"):
        list(staged.shard(1, 2).record_batches())


def test_table_input_is_the_whole_staged_table_on_every_shard_and_one_process_trains_each_row_once(tmp_path):
    import keras

    import stratkit

    staged = _staged(tmp_path)
    inputs = [staged.shard(i, 3).table_input(seed=5) for i in range(3)]
    plans = [data.plan() for data in inputs]
    assert all(p.files == plans[0].files and p.rows == 12 for p in plans)
    assert inputs[0].features == ["word", "id"] and inputs[0].label == "label" and inputs[0].sample_weight == "weight"
    seen = []

    class Recorded(keras.Model):
        def train_step(self, data):
            import tensorflow as tf

            tf.py_function(lambda ids: seen.append(ids.numpy().ravel().tolist()) or 0, [data[0]["id"]], tf.int32)
            return super().train_step(data)

    word = keras.Input((1,), dtype="string", name="word")
    ids = keras.Input((1,), dtype="int64", name="id")
    looked = keras.layers.StringLookup(vocabulary=["w0", "w1", "w2"])(word)
    joined = keras.layers.Concatenate()([keras.ops.cast(keras.layers.Hashing(16)(ids), "float32"),
                                         keras.ops.cast(looked, "float32")])
    model = Recorded({"word": word, "id": ids}, keras.layers.Dense(1, activation="sigmoid")(joined))
    model.compile(optimizer="sgd", loss="binary_crossentropy")
    stratkit.Trainer(strategy="one_device").fit(model, inputs[1], epochs=2, global_batch_size=5, verbose=0)
    assert [len(batch) for batch in seen] == [5, 5, 2] * 2                  # the last batch partial, none skipped
    for epoch in (seen[:3], seen[3:]):
        assert sorted(v for batch in epoch for v in batch) == list(range(BASE, BASE + 12))


def test_table_input_refuses_what_a_table_input_cannot_take_naming_the_fix(tmp_path):
    staged = _staged(tmp_path)
    two = StagedData(staged.path, staged.files, ("id",), ("label", "weight"))
    with pytest.raises(ConfigError, match=r"one label column, not \['label', 'weight'\]. Fix"):
        two.shard(0, 1).table_input()
    with pytest.raises(ConfigError, match=r"feature_dtype='float64' chose one for all. Fix: drop feature_dtype"):
        _staged(tmp_path, feature_dtype="float64").shard(0, 1).table_input()
