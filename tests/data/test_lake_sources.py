"""The table reader on real files, in this process: each source, bad input refused before step 1, a file that
vanishes mid-run, a Delta version pinned through a commit and a resume, deletion vectors applied.

Local files (the stores are tests/data/test_lake_training.py's); one device (`Trainer(strategy="one_device")`).
"""

from __future__ import annotations

import os
import pickle
import re
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

import lake_tables
from stratkit.data import Table, TableInput, TableReadError
from stratkit.errors import ConfigError

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

ROWS = 3000


@pytest.fixture(scope="module")
def parquet_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("parquet")
    assert lake_tables.write_parquet(pafs.LocalFileSystem(), str(root), 12, ROWS) == ROWS
    return root


def _ids(data: TableInput, batch: int, world: int = 1, rank: int = 0) -> list[np.ndarray]:
    reader = data.reader(batch, world, rank, passes=1)
    try:
        return [np.concatenate([part[0].reshape(-1) for part in step]) for step in reader]  # a column: (rows, 1)
    finally:
        reader.close()


def test_a_planned_table_pickles_small_and_every_worker_reads_the_rows_of_one_global_order(parquet_dir):
    data = TableInput(Table.parquet(parquet_dir), features="id", label="y", seed=4, shuffle_window=50)
    assert data.plan().rows == ROWS and data.plan().units > 12
    copy = pickle.loads(pickle.dumps(data))               # what a driver hands its tasks: the plan travels
    assert copy.plan().fingerprint == data.plan().fingerprint and len(pickle.dumps(data)) < 20_000
    one = _ids(data, 128)
    assert np.array_equal(np.sort(np.concatenate(one)), np.arange(ROWS))
    for world in (2, 3):
        parts = [_ids(copy, 128, world, rank) for rank in range(world)]
        for k, expected in enumerate(one):
            assert np.array_equal(np.sort(np.concatenate([p[k] for p in parts])), np.sort(expected))
    second = data.reader(128, passes=2)                    # the next pass is another order
    steps = [np.concatenate([p[0].reshape(-1) for p in step]) for step in second]
    assert len(steps) == 2 * len(one) and not np.array_equal(steps[0], steps[len(one)])


def test_columns_keep_their_types_and_a_lossy_cast_is_refused_from_the_statistics(tmp_path):
    big = 2**40 + np.arange(10, dtype=np.int64)             # ids beyond float32's exact integers
    pq.write_table(pa.table({"id": big, "s": [f"w{i}" for i in range(10)], "y": np.ones(10, "float64")}),
                   tmp_path / "a.parquet")
    data = TableInput(Table.parquet(tmp_path), features=["id", "s"], label="y", shuffle=False)
    (step,) = list(data.reader(10, passes=1))
    ((ids, words), y), = [(p[0], p[1]) for p in step]            # no model: a tuple, in the order given
    ids, words = ids.reshape(-1), words.reshape(-1)                   # (rows, 1): feeds.py's rule for a column
    assert ids.dtype == np.int64 and np.array_equal(np.sort(ids), big)      # exact
    assert words.dtype == object and isinstance(words[0], bytes) and y.dtype == np.float64
    ids = keras.Input((), dtype="float32", name="id")
    model = keras.Model(ids, keras.layers.Dense(1)(keras.ops.expand_dims(ids, -1)))
    with pytest.raises(ConfigError, match=r"column 'id': casting its int64 values to the model's float32"):
        TableInput(Table.parquet(tmp_path), features="id", label="y").feed(model)


def _bad(tmp_path, name, **columns):
    pq.write_table(pa.table(columns), tmp_path / name)


def test_bad_tables_are_refused_before_step_1_naming_the_file_or_column_and_the_fix(tmp_path, parquet_dir):
    with pytest.raises(ConfigError, match=r"column 'nope' is not in table file .*part-00000\.parquet.*Fix"):
        TableInput(Table.parquet(parquet_dir), features="nope", label="y").feed()
    with pytest.raises(ConfigError, match=r"does not exist\. Fix"):
        Table.parquet(tmp_path / "missing").plan()
    shutil.copytree(parquet_dir, tmp_path / "mixed")
    _bad(tmp_path / "mixed", "zz.parquet", id=np.arange(3, dtype=np.int32), x=pa.array([[1.0] * 3] * 3,
         pa.list_(pa.float32(), 3)), y=np.ones(3, "float32"))
    with pytest.raises(ConfigError, match=r"column 'id' is int64 in table file .*part-00000.* but int32 in "
                                          r".*zz\.parquet.*schemas differ\. Fix"):
        Table.parquet(tmp_path / "mixed", columns=["id", "y"]).plan()
    (tmp_path / "nulls").mkdir()
    _bad(tmp_path / "nulls", "n.parquet", x=pa.array([1.0, None, 3.0]), y=np.ones(3))
    with pytest.raises(ConfigError, match=r"column 'x' has 1 null value\(s\) in table file .*n\.parquet.*Fix"):
        Table.parquet(tmp_path / "nulls").plan()
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "j.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match=r"j\.parquet' is not a readable Parquet file .* Fix"):
        Table.parquet(tmp_path / "junk").plan()
    with pytest.raises(ConfigError, match=r"filter condition .*'id'.* not a partition column"):
        Table.parquet(parquet_dir, filter=[("id", ">", 3)]).plan()


def test_hive_partitions_are_columns_and_the_filter_prunes_files(tmp_path):
    for day in (1, 2, 3):
        (tmp_path / f"day={day}").mkdir()
        pq.write_table(pa.table({"x": np.full(5, float(day))}), tmp_path / f"day={day}" / "p.parquet")
    data = TableInput(Table.parquet(tmp_path, filter=[("day", ">=", 2)]), features=["x", "day"], shuffle=False)
    (step,) = list(data.reader(100, passes=1))
    x, day = (a.reshape(-1) for a in step[0][0])
    assert day.dtype == np.int64 and sorted(set(day.tolist())) == [2, 3]
    assert np.array_equal(x, day.astype(float))


def test_a_file_that_vanishes_mid_run_stops_the_reader_with_its_name(tmp_path, parquet_dir):
    shutil.copytree(parquet_dir, tmp_path / "t")
    data = TableInput(Table.parquet(tmp_path / "t"), features="id", label="y", lanes=1, shuffle=False)
    data.plan()
    os.remove(tmp_path / "t" / "part-00011.parquet")      # the last file in the plan's order: read last
    reader = data.reader(100, passes=1)
    with pytest.raises(TableReadError, match=r"part-00011\.parquet' is gone .*backups written so far are kept"):
        for _ in reader:
            pass


@pytest.fixture(scope="module")
def trainer():
    import stratkit

    return stratkit.Trainer(strategy="one_device")


def _build():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


class Crash(RuntimeError):
    pass


class At(keras.callbacks.Callback):
    """Run `action()` right before global step `step` (an epoch has `per_epoch` steps)."""

    def __init__(self, per_epoch: int, **actions):
        super().__init__()
        self.per_epoch, self.actions = per_epoch, {int(k[1:]): v for k, v in actions.items()}

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        action = self.actions.get(self.epoch * self.per_epoch + batch)
        if action is not None:
            action()


def test_a_delta_version_is_pinned_through_a_commit_and_a_resume_reads_it_again(trainer, tmp_path):
    """3 versions written with deltalake; training reads version 1: explicitly, and pinned at fit start when
    version 1 is the latest. A commit made during training changes nothing, and the resume (after new commits)
    reads version 1 again, from the backup's record."""
    from deltalake import WriterProperties, write_deltalake

    path = str(tmp_path / "delta")
    small = WriterProperties(max_row_group_size=300)
    write_deltalake(path, lake_tables.columns(0, 1500), writer_properties=small)
    write_deltalake(path, lake_tables.columns(1500, 1000), mode="append", writer_properties=small)

    def data(version=None):
        return TableInput(Table.delta(path, version=version), features="x", label="y", seed=2)

    batch = 100   # 25 steps a pass of version 1
    reference = trainer.build(_build)
    history = trainer.fit(reference, data(1), epochs=2, global_batch_size=batch, verbose=0)
    commit = lambda: write_deltalake(path, lake_tables.columns(2500, 700), mode="append")  # noqa: E731

    def crash():
        raise Crash("before step 33")

    model = trainer.build(_build)
    with pytest.raises(Crash):      # pinned at fit start (the latest: 1); a commit lands during the run
        trainer.fit(model, data(), epochs=2, global_batch_size=batch, verbose=0, backup_dir=str(tmp_path / "b"),
                    backup_every=5, callbacks=[At(25, s10=commit, s33=crash)])
    write_deltalake(path, lake_tables.columns(3200, 300), mode="append")    # and another before the resume
    from deltalake import DeltaTable

    assert DeltaTable(path).version() == 3
    from stratkit.training.checkpoint import find_resume_point

    point = find_resume_point(str(tmp_path / "b"))
    assert (point.position.epoch, point.position.step) == (1, 5)
    assert point.state()["data"]["source"]["version"] == 1 and point.state()["data"]["rows"] == 2500
    resumed = trainer.build(_build)
    again = trainer.fit(resumed, data(), epochs=2, global_batch_size=batch, verbose=0,
                        backup_dir=str(tmp_path / "b"), backup_every=5)
    for a, b in zip(reference.get_weights(), resumed.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
    np.testing.assert_allclose(history.history["loss"], again.history["loss"], atol=1e-6)
    with pytest.raises(ConfigError, match=r"has no version 9 \(its versions: 0 to 3.*Fix"):
        Table.delta(path, version=9).plan()


def test_delta_deletion_vectors_are_applied(tmp_path):
    from deltalake import write_deltalake

    path = str(tmp_path / "dv")
    write_deltalake(path, lake_tables.columns(0, 400), configuration={"delta.enableDeletionVectors": "true"})
    lake_tables.delete_with_vector(path, [0, 5, 7, 399])
    data = TableInput(Table.delta(path), features="id", label="y", shuffle=False)
    assert data.plan().rows == 396
    ids = np.concatenate(_ids(data, 64))
    assert sorted(ids.tolist()) == sorted(set(range(400)) - {0, 5, 7, 399})


def test_a_vanished_file_stops_trainer_fit_with_the_readers_error_and_the_backups_are_kept(trainer, tmp_path,
                                                                                             parquet_dir):
    shutil.copytree(parquet_dir, tmp_path / "t")
    data = TableInput(Table.parquet(tmp_path / "t"), features="x", label="y", lanes=1, shuffle=False,
                      shuffle_window=100, read_ahead_bytes=1 << 16)   # reads a few windows ahead of the step
    class Gone(keras.callbacks.Callback):   # after fit planned the table, before the reader reaches the file
        def on_train_begin(self, logs=None):
            os.remove(tmp_path / "t" / "part-00011.parquet")   # read last (lanes=1, in order)

    model = trainer.build(_build)
    with pytest.raises(TableReadError, match=r"part-00011\.parquet' is gone"):
        trainer.fit(model, data, epochs=1, global_batch_size=100, verbose=0, backup_dir=str(tmp_path / "b"),
                    backup_every=5, callbacks=[Gone()])
    from stratkit.training.checkpoint import find_resume_point

    assert find_resume_point(str(tmp_path / "b")).position.step >= 5     # the last good backup is there


def test_tfrecord_features_are_checked_against_the_records_before_training(tmp_path):
    lake_tables.write_tfrecord(pafs.LocalFileSystem(), str(tmp_path), 3, 300)
    good = {"id": tf.io.FixedLenFeature([], tf.int64), "x": tf.io.FixedLenFeature([3], tf.float32),
            "y": tf.io.FixedLenFeature([], tf.float32)}
    data = TableInput(Table.tfrecord(tmp_path, features=good), features="id", label="y")
    assert sorted(np.concatenate(_ids(data, 64)).tolist()) == list(range(300))
    wrong = {**good, "x": tf.io.FixedLenFeature([4], tf.float32)}
    with pytest.raises(ConfigError, match=r"shard-00000\.tfrecord' do not match features= .*Fix"):
        Table.tfrecord(tmp_path, features=wrong).plan()
    with pytest.raises(ConfigError, match=r"feature 'x' is a VarLenFeature.*Fix"):
        Table.tfrecord(tmp_path, features={"x": tf.io.VarLenFeature(tf.float32)})


def test_a_hand_written_fit_through_dataset_fn_trains_as_trainer_fit(trainer, parquet_dir):
    data = TableInput(Table.parquet(parquet_dir), features="x", label="y", seed=6)
    through_trainer = trainer.build(_build)
    trainer.fit(through_trainer, data, epochs=2, global_batch_size=128, verbose=0)
    with trainer.strategy.scope():
        by_hand = _build()
    dataset = trainer.strategy.distribute_datasets_from_function(data.dataset_fn(128, model=by_hand))
    by_hand.fit(dataset, epochs=2, steps_per_epoch=data.steps_per_epoch(128), verbose=0)
    for a, b in zip(through_trainer.get_weights(), by_hand.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_steps_per_epoch_runs_on_across_passes_and_a_resume_continues_them(trainer, parquet_dir, tmp_path):
    """Epochs of 10 steps over passes of 24 (3000 rows, batch 128): a crash at global step 27 (pass 2, batch 3)
    resumes from the step backup of step 25 and ends as the uninterrupted run."""
    data = TableInput(Table.parquet(parquet_dir), features="x", label="y", seed=8)
    reference = trainer.build(_build)
    trainer.fit(reference, data, epochs=4, steps_per_epoch=10, global_batch_size=128, verbose=0)

    def crash():
        raise Crash("before step 27")

    model = trainer.build(_build)
    with pytest.raises(Crash):
        trainer.fit(model, data, epochs=4, steps_per_epoch=10, global_batch_size=128, verbose=0,
                    backup_dir=str(tmp_path / "b"), backup_every=5, callbacks=[At(10, s27=crash)])
    resumed = trainer.build(_build)
    trainer.fit(resumed, data, epochs=4, steps_per_epoch=10, global_batch_size=128, verbose=0,
                backup_dir=str(tmp_path / "b"), backup_every=5)
    for a, b in zip(reference.get_weights(), resumed.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_the_default_shuffle_window_fits_the_read_ahead_budget_of_one_process(tmp_path):
    """`shuffle_window="auto"` took ~32 MiB a block whatever the budget, so a table of large row groups with the
    default settings (bench_lake's: 1M rows of 16 float32s, 65,536-row groups, 256 MiB) was refused at its first
    batch (12 lanes' row groups 123 MB + two blocks 134 MB + a quarter > 256 MiB). The same shape at a sixteenth:
    62,500 rows, 4,096-row groups, 16 MiB."""
    rows, features = 62_500, 16
    table = pa.table({"id": np.arange(rows, dtype=np.int64),
                      **{f"f{i}": np.random.default_rng(i).random(rows, dtype=np.float32) for i in range(features)}})
    for part in range(4):
        pq.write_table(table.slice(part * rows // 4, rows // 4), tmp_path / f"part-{part}.parquet",
                       row_group_size=4096)
    data = TableInput(Table.parquet(tmp_path), features=["id", *(f"f{i}" for i in range(features))], label=None,
                      read_ahead_bytes=16 << 20)
    reader = data.reader(1024, passes=1)
    try:        # each step's parts: (x,) with x the inputs in order, id first
        ids = np.concatenate([np.asarray(part[0][0]).reshape(-1) for step in reader for part in step])
    finally:
        reader.close()
    assert np.array_equal(np.sort(ids), np.arange(rows))
    assert data.layout().window < -(-rows // data.layout().lanes)      # the budget, not the lane, bounds it


def test_wide_rows_are_decoded_in_batches_of_a_few_mib_so_the_shuffle_window_keeps_its_room(tmp_path):
    """Rows of 768 float32s in 2,500-row groups (bench_lake's CNN table): each lane decoded 4,096 rows (12 MB) at a
    time, its lanes took the budget's room, and the window fell to 11 rows a lane: 227 blocks a pass, and a small
    CNN fed at 0.66x its steps/s on arrays. Decode batches of at most 4 MiB leave it hundreds of rows."""
    rows, width = 6_000, 768
    values = np.random.default_rng(0).random(rows * width, dtype=np.float32)
    table = pa.table({"image": pa.FixedSizeListArray.from_arrays(pa.array(values), width),
                      "id": np.arange(rows, dtype=np.int64)})
    pq.write_table(table, tmp_path / "images.parquet", row_group_size=2_500)
    data = TableInput(Table.parquet(tmp_path), features="image", label="id")     # the default budget, 256 MiB
    assert data.layout().lanes == 12
    assert data.layout().window >= 100, data.layout()
    reader = data.reader(128, passes=1)
    try:
        ids = np.concatenate([np.asarray(part[1]).reshape(-1) for step in reader for part in step])
    finally:
        reader.close()
    assert np.array_equal(np.sort(ids), np.arange(rows))


@pytest.mark.parametrize("batch,replicas,world", [(ROWS - 1, 2, 1), (300, 3, 2), (256, 2, 40)],
                         ids=["one-row-steps-over-2-replicas", "3-replicas-on-2-workers", "workers-without-lanes"])
def test_dataset_fn_yields_the_readers_per_replica_parts_in_order_empty_ones_included(parquet_dir, batch, replicas,
                                                                                      world):
    """What tf.data hands each replica is the reader's part, in its order: uneven splits, a step of fewer rows than
    replicas (empty parts) and workers that own no lane. (TensorFlow 2.21's `unbatch` crashed the process on an
    empty part: the pipeline cuts such a worker's runs another way.)"""
    data = TableInput(Table.parquet(parquet_dir), features=["id", "x"], label="y", seed=5, shuffle_window=64)
    assert data.steps_per_epoch(batch) * batch - ROWS < batch
    for rank in sorted({0, world // 2, world - 1}):
        context = tf.distribute.InputContext(num_input_pipelines=world, input_pipeline_id=rank,
                                             num_replicas_in_sync=world * replicas)
        reader = data.reader(batch, world, rank, replicas=replicas, passes=1)
        try:
            expected = [part for step in reader for part in step]
        finally:
            reader.close()
        got = list(data.dataset_fn(batch, passes=1)(context).as_numpy_iterator())
        assert len(got) == len(expected) == data.steps_per_epoch(batch) * replicas
        for mine, theirs in zip(got, expected):
            for a, b in zip(tf.nest.flatten(mine), tf.nest.flatten(theirs)):
                assert a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)
        if world == 1:
            assert min(len(tf.nest.flatten(part)[0]) for part in expected) == 0   # the empty parts were there


def test_the_table_dataset_runs_without_tf_data_autotuning(parquet_dir):
    """tf.data's autotuning model thread held the iterator's end up to 0.3 s in 4 of 15 passes of a 1M-row table
    (every validation pass and evaluate makes an iterator); the pipeline has no tunable knob, so it is off."""
    data = TableInput(Table.parquet(parquet_dir), features=["id", "x"], label="y", seed=5)
    dataset = data.dataset_fn(64, passes=1)(tf.distribute.InputContext())
    assert dataset.options().autotune.enabled is False
    assert sum(len(tf.nest.flatten(x)[0]) for x in dataset.as_numpy_iterator()) == ROWS


def test_a_tiny_table_read_endlessly_gives_its_steps_at_once_not_after_reading_far_ahead(tmp_path):
    """12 rows in 2 files, a pass of 3 steps, read without end (`fit`'s repeat): the first steps come within
    seconds. (The blocks ahead were a budget's worth: 256 MiB of 12-row blocks, hundreds of thousands of passes
    submitted to the pool before the first step came out, the process's memory growing.)"""
    import threading

    for i, (lo, hi) in enumerate(((0, 5), (5, 12))):
        pq.write_table(pa.table({"id": np.arange(lo, hi, dtype="int64"), "y": np.zeros(hi - lo, "float32")}),
                       tmp_path / f"part-{i}.parquet", row_group_size=3)
    data = TableInput(Table.parquet(tmp_path), features="id", label="y", seed=3)
    reader = data.reader(5)
    got: list[np.ndarray] = []
    taker = threading.Thread(target=lambda: got.extend(
        np.concatenate([part[0].reshape(-1) for part in step]) for step, _ in zip(reader, range(12))), daemon=True)
    try:
        taker.start()
        taker.join(60)
        assert not taker.is_alive(), f"{len(got)} of 12 steps within 60 s; the reader keeps {reader.ahead} blocks ahead"
    finally:
        reader.close()
    assert [len(ids) for ids in got] == [5, 5, 2] * 4
    for n in range(4):
        assert sorted(np.concatenate(got[3 * n:3 * n + 3]).tolist()) == list(range(12))


def test_trainer_evaluate_reads_a_table_as_fit_does_every_row_once_columns_side_by_side(trainer, parquet_dir):
    # Trainer.evaluate built the table's batches without the model: two columns reached a one-input model as two
    # tensors (Keras: "expected axis -1 of input shape to have value 4, but received input with shape (None, 3)").
    def build():
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
        return model

    data = TableInput(Table.parquet(parquet_dir), features=["x", "id"], label="y", shuffle=False)
    model = trainer.build(build)
    got = trainer.evaluate(model, data, global_batch_size=128)
    rows = pq.read_table(str(parquet_dir), columns=["x", "id", "y"])
    x = np.concatenate([np.stack(rows.column("x").to_numpy(zero_copy_only=False)),
                        rows.column("id").to_numpy()[:, None]], axis=1).astype("float32")
    # labels shaped as the output, as the table gives them: Keras's own evaluate, given labels of one rank and
    # then another, retraces its step with a shape of unknown rank and fails (Keras alone does)
    y = rows.column("y").to_numpy().reshape(-1, 1)
    want = model.evaluate(x, y, batch_size=128, verbose=0, return_dict=True)
    assert len(x) == ROWS
    for key in ("loss", "mae"):
        assert abs(got[key] - want[key]) <= 1e-5 * max(1.0, abs(want[key])), (key, got, want)


def test_a_glob_matches_within_one_directory_level_as_spark_and_the_shell_do(tmp_path):
    # `*` matched across "/": "t/*.parquet" also took t/hive/part=1/c.parquet (fnmatch over the whole path)
    table = pa.table({"x": pa.array([1.0, 2.0]), "y": pa.array([0.0, 1.0])})
    for name in ("a.parquet", "b.parquet", "hive/part=1/c.parquet", "hive/part=2/d.parquet"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, tmp_path / name)
    names = lambda url: [os.path.relpath(f, tmp_path) for f in Table.parquet(url).plan().files]  # noqa: E731
    assert names(f"{tmp_path}/*.parquet") == ["a.parquet", "b.parquet"]
    assert names(f"{tmp_path}/hive/*/*.parquet") == ["hive/part=1/c.parquet", "hive/part=2/d.parquet"]
    assert names(f"{tmp_path}/hive/part=[2]/*") == ["hive/part=2/d.parquet"]
    assert names(f"{tmp_path}/hive/**/*.parquet") == ["hive/part=1/c.parquet", "hive/part=2/d.parquet"]
    assert names(f"{tmp_path}/**/b.parquet") == ["b.parquet"]
    assert TableInput(Table.parquet(f"{tmp_path}/*.parquet"), features="x", label="y").num_rows == 4


def test_a_glob_that_names_directories_reads_their_files_as_spark_does(tmp_path):
    """`t/day=*` was refused ("holds no .parquet files"): Spark reads a directory a glob matches."""
    table = pa.table({"x": pa.array([1.0, 2.0]), "y": pa.array([0.0, 1.0])})
    for name in ("day=1/a.parquet", "day=2/b.parquet", "day=2/sub/c.parquet", "day=2/notes.txt", "day=2/_SUCCESS",
                 "other/d.parquet"):
        (tmp_path / "t" / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, tmp_path / "t" / name)
    names = lambda url: [os.path.relpath(f, tmp_path / "t") for f in Table.parquet(url).plan().files]  # noqa: E731
    assert names(f"{tmp_path}/t/day=*") == ["day=1/a.parquet", "day=2/b.parquet", "day=2/sub/c.parquet"]
    assert names(f"{tmp_path}/t/day=[2]") == ["day=2/b.parquet", "day=2/sub/c.parquet"]
    data = TableInput(Table.parquet(f"{tmp_path}/t/day=*"), features=["x", "day"], shuffle=False)
    (step,) = list(data.reader(10, passes=1))
    assert sorted(step[0][0][1].reshape(-1).tolist()) == [1, 1, 2, 2, 2, 2]          # the partition is kept


def test_hive_partition_values_are_decoded_and_the_default_partition_is_a_null(tmp_path):
    """pyarrow (as Spark and Hive) writes `city=New%20York` and `city=__HIVE_DEFAULT_PARTITION__`: the reader fed
    the raw names (b"New%20York", b"__HIVE_DEFAULT_PARTITION__") to the model and a filter on "New York" kept no
    file."""
    import pyarrow.dataset as pads

    city = ["New York", "Paris", None] * 10
    pads.write_dataset(pa.table({"city": city, "x": np.arange(30, dtype="float32")}), tmp_path / "t",
                       format="parquet", partitioning=["city"], partitioning_flavor="hive")
    url = str(tmp_path / "t")
    with pytest.raises(ConfigError, match=r"partition column 'city' is null for 1 file\(s\).*Fix"):
        TableInput(Table.parquet(url), features=["city", "x"]).feed()
    assert TableInput(Table.parquet(url), features="x").num_rows == 30          # not read: no refusal
    kept = TableInput(Table.parquet(url, filter=[("city", "!=", "Paris")]), features=["city", "x"], shuffle=False)
    (step,) = list(kept.reader(100, passes=1))
    names, x = (a.reshape(-1) for a in step[0][0])
    assert sorted({n.decode() if isinstance(n, bytes) else n for n in names}) == ["New York"]
    assert sorted(x.tolist()) == [float(i) for i in range(0, 30, 3)]           # the null partition compares false
    assert TableInput(Table.parquet(url, filter=[("city", "=", "New York")]), features="x").num_rows == 10
    assert TableInput(Table.parquet(url, filter=[("city", "=", None)]), features="x").num_rows == 10


def test_a_path_that_exists_with_glob_characters_is_read_as_written_and_a_glob_keeps_its_partitions(tmp_path):
    table = pa.table({"x": pa.array([1.0, 2.0]), "y": pa.array([0.0, 1.0])})
    (tmp_path / "run[1]").mkdir()
    pq.write_table(table, tmp_path / "run[1]" / "part-0.parquet")
    assert TableInput(Table.parquet(tmp_path / "run[1]"), features="x", label="y").num_rows == 2
    for day in (1, 2):
        (tmp_path / "t" / f"day={day}").mkdir(parents=True)
        pq.write_table(table, tmp_path / "t" / f"day={day}" / "p.parquet")
    # a glob inside the partition's directory name: the partition column is still there (it was lost)
    data = TableInput(Table.parquet(f"{tmp_path}/t/day=*/*.parquet"), features=["x", "day"], shuffle=False)
    (step,) = list(data.reader(10, passes=1))
    assert sorted(step[0][0][1].reshape(-1).tolist()) == [1, 1, 2, 2]


def test_a_null_first_row_and_an_empty_array_of_a_list_column_are_refused_as_what_they_are(tmp_path):
    (tmp_path / "first").mkdir()
    _bad(tmp_path / "first", "f.parquet", x=pa.array([None] + [[0.0] * 4] * 7, pa.list_(pa.float32())),
         y=np.zeros(8, "float32"))
    with pytest.raises(ConfigError, match=r"column 'x' has null value\(s\) in table file .*f\.parquet.*Fix"):
        Table.parquet(tmp_path / "first").plan()           # was a TypeError from the array's width
    (tmp_path / "empty").mkdir()
    _bad(tmp_path / "empty", "e.parquet", x=pa.array([[0.0] * 4] * 7 + [[]], pa.list_(pa.float32())),
         y=np.zeros(8, "float32"))
    with pytest.raises(ConfigError, match=r"column 'x' has 1 null or empty value\(s\) .*an empty array.*e\.parquet"):
        Table.parquet(tmp_path / "empty").plan()


def test_a_delta_timestamp_before_the_table_is_refused_and_a_version_in_a_string_is_that_version(tmp_path):
    """delta-rs reads version 0 for a timestamp before the table existed: training read a snapshot nobody had."""
    from deltalake import write_deltalake

    path = str(tmp_path / "delta")
    write_deltalake(path, lake_tables.columns(0, 100))
    write_deltalake(path, lake_tables.columns(100, 50), mode="append")
    with pytest.raises(ConfigError, match=r"version='2000-01-01T00:00:00Z' is before the earliest commit .*Fix"):
        Table.delta(path, version="2000-01-01T00:00:00Z").plan()
    import datetime as dt

    with pytest.raises(ConfigError, match=r"before the earliest commit"):
        Table.delta(path, version=dt.datetime(2000, 1, 1)).plan()
    assert Table.delta(path, version="0").plan().rows == 100
    assert Table.delta(path, version=" 1 ").plan().rows == 150
    assert Table.delta(path, version=dt.datetime.now(dt.timezone.utc)).plan().rows == 150


def test_validation_split_with_a_table_names_a_held_out_table_as_the_fix(trainer, parquet_dir):
    """The fix said dataset.take(n) / dataset.skip(n), which a TableInput does not have."""
    data = TableInput(Table.parquet(parquet_dir), features="x", label="y")
    with pytest.raises(ConfigError, match=r"validation_split=0.2 splits arrays only .*data is a TableInput. Fix: pass "
                                          r"validation_data=TableInput\(<a held-out table>\)"):
        trainer.fit(trainer.build(_build), data, global_batch_size=64, validation_split=0.2)


def test_a_delta_timestamp_string_without_an_offset_is_utc_as_a_naive_datetime_is(tmp_path):
    """A naive datetime was read as UTC, but the same moment as a string without an offset ('2099-01-01',
    '2099-01-01T00:00:00') was refused as a version the table does not have (delta-rs parses RFC 3339 only)."""
    import datetime as dt

    from deltalake import write_deltalake

    path = str(tmp_path / "delta")
    write_deltalake(path, lake_tables.columns(0, 100))
    write_deltalake(path, lake_tables.columns(100, 50), mode="append")
    for when in ("2099-01-01", "2099-01-01T00:00:00", "2099-01-01 00:00:00.5", "2099-01-01T00:00:00Z",
                 dt.datetime(2099, 1, 1)):
        assert Table.delta(path, version=when).plan().rows == 150, when
    with pytest.raises(ConfigError, match=r"version='2000-01-01' is before the earliest commit"):
        Table.delta(path, version="2000-01-01").plan()
    with pytest.raises(ConfigError, match=r"version='last tuesday' for the Delta table .* is not a version number, a "
                                          r"datetime or an ISO 8601 string. Fix"):
        Table.delta(path, version="last tuesday").plan()


def test_a_model_trained_on_a_table_then_scores_arrays_whose_labels_have_another_rank_and_the_reverse(
        trainer, parquet_dir):
    """Keras reuses a model's traced step, and one traced for (B, 1) labels (a table's, for a Dense(1)) failed on
    numpy's (B,) ("Cannot take the length of shape with unknown rank"), and the reverse."""
    data = TableInput(Table.parquet(parquet_dir), features="x", label="y", seed=1)
    table = pq.read_table(parquet_dir, columns=["x", "y"])
    x = np.stack(table.column("x").to_numpy(zero_copy_only=False)).astype("float32")
    y = table.column("y").to_numpy().astype("float32")                       # (rows,)
    model = trainer.build(_build)
    trainer.fit(model, data, epochs=1, global_batch_size=256, verbose=0)
    scored = trainer.evaluate(model, (x, y), global_batch_size=256)
    assert np.isfinite(scored["loss"])
    assert np.isclose(model.evaluate(x, y, batch_size=256, verbose=0, return_dict=True)["loss"], scored["loss"],
                      rtol=1e-5)
    other = trainer.build(_build)
    trainer.fit(other, (x, y), epochs=1, global_batch_size=256, verbose=0)
    assert np.isfinite(trainer.evaluate(other, data, global_batch_size=256)["loss"])
    model.fit(x, y, batch_size=256, epochs=1, verbose=0)                        # the user's own fit after ours


def test_a_null_in_a_file_without_statistics_is_refused_naming_the_file(trainer, tmp_path):
    (tmp_path / "t").mkdir()
    pq.write_table(pa.table({"x": pa.array([[1.0] * 3] * 4, pa.list_(pa.float32(), 3)),
                             "y": pa.array([0.0, 1.0, 2.0, 3.0])}), tmp_path / "t" / "a.parquet")
    pq.write_table(pa.table({"x": pa.array([[1.0] * 3] * 4, pa.list_(pa.float32(), 3)),
                             "y": pa.array([0.0, None, 2.0, 3.0])}), tmp_path / "t" / "b.parquet",
                   write_statistics=False)
    data = TableInput(Table.parquet(tmp_path / "t"), features="x", label="y")
    with pytest.raises(ConfigError, match=r"column 'y' has 1 null value\(s\) in table file .*b\.parquet.*Fix"):
        trainer.fit(trainer.build(_build), data, epochs=1, global_batch_size=4, verbose=0)


def test_files_without_the_suffix_beside_the_tables_are_left_out_with_a_warning_naming_one(tmp_path, caplog):
    pq.write_table(pa.table({"x": [1.0, 2.0]}), tmp_path / "part-0.parquet")
    pq.write_table(pa.table({"x": [3.0]}), tmp_path / "000000_0")          # as Hive names its data files
    with caplog.at_level("WARNING", logger="stratkit"):
        assert Table.parquet(tmp_path).plan().rows == 2
    assert "1 file(s) without .parquet were not read, e.g. '000000_0'" in caplog.text
    assert Table.parquet(f"{tmp_path}/*").plan().rows == 3


def test_a_file_column_named_as_a_partition_is_warned_of_and_the_directorys_value_is_read(tmp_path, caplog):
    """Files that also hold their partition's column (day=1/ holding a column `day`): the directory's value was
    read and the file's ignored without a word, however the two differed."""
    for day in (1, 2):
        (tmp_path / f"day={day}").mkdir()
        pq.write_table(pa.table({"x": [1.0, 2.0], "day": pa.array([7, 7], pa.int64())}),
                       tmp_path / f"day={day}" / "p.parquet")
    with caplog.at_level("WARNING", logger="stratkit"):
        plan = Table.parquet(tmp_path, columns=["x", "day"]).plan()
    assert [f.name for f in plan.arrow_schema] == ["x", "day"]
    assert plan.partitions[0]["day"] in (1, 2)                     # the directory's value is what is read
    assert re.search(r"column 'day' is both a partition \(the directories day=\.\.\.\) and a column of table file "
                     r".*p\.parquet.*the directory's value is read.*Fix", caplog.text), caplog.text
    assert [f.name for f in Table.parquet(tmp_path).plan().arrow_schema] == ["x", "day"]   # every column, once
    caplog.clear()
    with caplog.at_level("WARNING", logger="stratkit"):
        assert [f.name for f in Table.parquet(tmp_path, columns=["x"]).plan().arrow_schema] == ["x"]
    assert "is both a partition" not in caplog.text                  # not read: nothing to say


def test_class_weight_and_predict_with_a_table_are_refused_before_training_with_the_fix(trainer, parquet_dir):
    """class_weight reached Keras, which cannot map a distributed dataset (AttributeError: ... has no attribute
    'map'); predict said "data[0] is a TableInput" (and under launch raised TensorFlow's TypeError)."""
    data = TableInput(Table.parquet(parquet_dir), features="x", label="y")
    model = trainer.build(_build)
    with pytest.raises(ConfigError, match=r"class_weight is not applied to a stratkit.data.TableInput.*"
                                          r"sample_weight="):
        trainer.fit(model, data, epochs=1, global_batch_size=64, class_weight={0: 1.0, 1: 2.0}, verbose=0)
    with pytest.raises(ConfigError, match=r"Trainer.predict does not read a stratkit.data.TableInput.*Fix"):
        trainer.predict(model, data, global_batch_size=64)


def test_a_compressed_tfrecord_file_is_refused_as_compressed(tmp_path):
    with tf.io.TFRecordWriter(str(tmp_path / "a.tfrecord"), options="GZIP") as writer:
        for i in range(50):
            example = tf.train.Example(features=tf.train.Features(feature={
                "y": tf.train.Feature(float_list=tf.train.FloatList(value=[float(i)]))}))
            writer.write(example.SerializeToString())
    with pytest.raises(ConfigError, match=r"a\.tfrecord' is GZIP-compressed .*uncompressed TFRecord files only.*Fix"):
        Table.tfrecord(tmp_path, features={"y": tf.io.FixedLenFeature([], tf.float32)}).plan()
