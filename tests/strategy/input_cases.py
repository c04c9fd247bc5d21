"""Every input form reads as one process (issue 39): the cases `parity_cases.py` runs for them.

Each case trains a small linear model on batches whose order and rows change the weights (SGD on random
rows), so a batch trained twice, skipped, taken out of order, or split unlike one process's shows in the
weights. Each also reports whether the user's own NumPy arrays were left as they were (`rows_intact`):
TensorFlow wrote into arrays a generator or a PyDataset handed it on 2 replicas, when their memory was
64-byte aligned; each case's arrays are a fresh copy so aligned (`aligned`), so that shows on every run and
one case's damage never reaches another. What only one mode can say (stratkit's log lines, plain Keras's
numbers on one process, a refusal on 2 workers) sits under `per_mode`.

The TFRecord files are written at run time into a temporary directory of each process (the same rows
every time). `unknown_length` (issue 49) is round 5's job instead (benchmarks/tasks/unknown_length_task.py:
Adam on `filter().batch(64)`, no `steps_per_epoch`), run with two CPU-bound processes beside it; it says
whether it stopped (`error`), the steps that trained, and whether every copy of the optimizer's step counter
equals them (`counted`).
"""

import contextlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import stratkit
from stratkit.process.children import kill_group, start_child

CASES = ["py_dataset_threads", "py_dataset_processes", "trainer_py_dataset", "generator", "from_generator",
         "tfrecord_one_file", "tfrecord_files", "trainer_tfrecord", "tfrecord_file_policy", "unknown_length"]
#: issue 49's job: round 5's input of unknown length (what benchmarks/replica_race.py runs 50 times a mode)
UNKNOWN_LENGTH_TASK = Path(__file__).resolve().parents[2] / "benchmarks" / "tasks" / "unknown_length_task.py"

FEATURES, BATCH, BATCHES = 6, 4, 12
_rng = np.random.default_rng(7)
X = _rng.normal(size=(BATCH * BATCHES, FEATURES)).astype("float32")
Y = (X @ _rng.normal(size=(FEATURES, 1)) + 0.3).astype("float32")


def aligned(array):
    """A copy of `array` whose memory starts on a 64-byte boundary (TensorFlow shares such memory)."""
    raw = np.empty(array.nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    out = raw[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    return out


def rows():
    """This case's own copy of the rows, as a user's arrays."""
    return aligned(X), aligned(Y)


class Rows(keras.utils.PyDataset):
    """Keras's own PyDataset example: batch i is a view of the arrays the object holds."""

    def __init__(self, x, y, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x) // BATCH

    def __getitem__(self, i):
        return self.x[i * BATCH:(i + 1) * BATCH], self.y[i * BATCH:(i + 1) * BATCH]


def batches(x, y, steps):
    """A Python generator of views of the arrays, `steps` batches, round and round."""
    for step in range(steps):
        i = step % BATCHES
        yield x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]


def model_in(scope):
    with scope:
        keras.utils.set_random_seed(3)    # Python's random too: a shuffled PyDataset's batch order
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    return model


def trained(model, history, x=X, y=Y):
    history = {k: v for k, v in history.history.items() if k != "examples_per_sec"}
    return {"w": [float(v) for w in model.get_weights() for v in np.ravel(w)], "h": history,
            "rows_intact": bool(np.array_equal(x, X) and np.array_equal(y, Y))}


def fit(data, strategy=None, x=X, y=Y, **kwargs):
    model = model_in(strategy.scope() if strategy is not None else contextlib.nullcontext())
    return trained(model, model.fit(data, epochs=2, verbose=0, **kwargs), x, y)


@contextlib.contextmanager
def said():
    """What stratkit says while the block runs (its info and warning lines)."""
    lines = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("stratkit")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


@contextlib.contextmanager
def burning(processes):
    """`processes` CPU-bound processes beside the block: on 2 cores, the load a race needs to show."""
    burners = [start_child([sys.executable, "-c", "while True: pass"], os.environ, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL) for _ in range(processes)]
    try:
        yield
    finally:
        for burner in burners:
            kill_group(burner.pid)
            burner.wait()


def unknown_length_task():
    spec = importlib.util.spec_from_file_location("unknown_length_task", UNKNOWN_LENGTH_TASK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_records(directory, files):
    """The rows of X, Y as `files` TFRecord files (rows in order, split evenly)."""
    paths, per = [], len(X) // files
    for f in range(files):
        path = os.path.join(directory, f"part-{files}-{f}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for row in range(f * per, (f + 1) * per):
                feature = {"x": tf.train.Feature(float_list=tf.train.FloatList(value=X[row])),
                           "y": tf.train.Feature(float_list=tf.train.FloatList(value=Y[row]))}
                writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
        paths.append(path)
    return paths


def parse(record):
    row = tf.io.parse_single_example(record, {"x": tf.io.FixedLenFeature([FEATURES], tf.float32),
                                              "y": tf.io.FixedLenFeature([1], tf.float32)})
    return row["x"], row["y"]


def records(directory, files, policy=None):
    dataset = tf.data.TFRecordDataset(write_records(directory, files)).map(parse)
    if policy is not None:
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = getattr(tf.data.experimental.AutoShardPolicy, policy)
        dataset = dataset.with_options(options)
    return dataset


def case(name, mode, trainer, strategy):
    if name in ("py_dataset_threads", "py_dataset_processes"):
        # model.fit's default shuffle=True: the batch order Python's random draws (seeded alike everywhere)
        processes = name == "py_dataset_processes"
        x, y = rows()
        out = fit(Rows(x, y, workers=2, use_multiprocessing=processes), strategy, x, y)
        out["per_mode"] = {}
        if mode == "one":            # stratkit's one-device choice against Keras without a strategy
            x, y = rows()
            plain = fit(Rows(x, y, workers=2, use_multiprocessing=processes), None, x, y)
            out["per_mode"]["plain_gap"] = float(np.max(np.abs(np.subtract(out["w"], plain["w"]))))
        return out
    if name == "unknown_length":
        # issue 49: filter().batch(64), no steps_per_epoch, Adam, 4 epochs of 5 batches. Keras learns the end from
        # the step whose get_next fails, once an epoch; two CPU-bound processes run beside the fit (one pair per
        # run: the chief's on 2 workers), the load under which that step's optimizer update raced the abort
        with burning(2 if mode != "mwms" or strategy.cluster_resolver.task_id == 0 else 0):
            out = unknown_length_task().train(strategy, epochs=4, rows=400)
        copies = out.pop("iterations")
        return {"w": out["w"], "h": {"loss": out["loss"]}, "error": out["error"], "steps": out["steps"],
                "counted": all(c == out["steps"] for c in copies), "per_mode": {"iterations": copies}}
    if name == "trainer_py_dataset":
        def build():
            return model_in(contextlib.nullcontext())

        model = trainer.build(build)
        x, y = rows()
        return trained(model, trainer.fit(model, Rows(x, y, workers=2), epochs=2, verbose=0), x, y)
    if name == "generator":          # a Python generator of views, 2 epochs of 6 steps
        x, y = rows()
        return fit(batches(x, y, 12), strategy, x, y, steps_per_epoch=6)
    if name == "from_generator":     # the user's own from_generator dataset, the function each pass restarts
        x, y = rows()
        signature = (tf.TensorSpec((None, FEATURES), tf.float32), tf.TensorSpec((None, 1), tf.float32))
        return fit(tf.data.Dataset.from_generator(lambda: batches(x, y, BATCHES), output_signature=signature),
                   strategy, x, y)
    directory = tempfile.mkdtemp(prefix="input-cases-")
    try:
        if name in ("tfrecord_one_file", "tfrecord_files"):   # AUTO, the default: one file, then 4 files
            with said() as lines:
                out = fit(records(directory, 1 if name == "tfrecord_one_file" else 4).batch(BATCH), strategy)
            out["per_mode"] = {"said": [line for line in lines if "auto-shard" in line]}
            return out
        if name == "trainer_tfrecord":   # Trainer.fit batches and shards an unbatched dataset: 2 files, AUTO
            model = trainer.build(lambda: model_in(contextlib.nullcontext()))
            with said() as lines:
                history = trainer.fit(model, records(directory, 2), epochs=2, global_batch_size=BATCH, verbose=0)
            out = trained(model, history)
            out["per_mode"] = {"said": [line for line in lines if "auto-shard" in line]}
            # FILE chosen, one file: refused on 2 workers (before: TensorFlow's error at step 1), trains on one
            model = trainer.build(lambda: model_in(contextlib.nullcontext()))
            try:
                trainer.fit(model, records(directory, 1, "FILE"), epochs=1, global_batch_size=BATCH, verbose=0)
                out["per_mode"]["file_policy"] = "trained"
            except stratkit.ConfigError as error:
                out["per_mode"]["file_policy"] = f"ConfigError: {error}"
            out["per_mode"]["file_policy_steps"] = int(model.optimizer.iterations.numpy())
            return out
        if name == "tfrecord_file_policy":  # FILE chosen: 1 file refused on 2 workers; 4 files train, not exactly
            out = {"per_mode": {}}
            for files in (1, 4):
                model = model_in(strategy.scope())
                try:
                    with said() as lines:
                        model.fit(records(directory, files, "FILE").batch(BATCH), epochs=1, verbose=0)
                    said_ = [line for line in lines if "auto-shard" in line]
                except stratkit.ConfigError as error:
                    said_ = f"ConfigError: {error}"
                out["per_mode"][f"{files}"] = {"said": said_, "steps": int(model.optimizer.iterations.numpy())}
            return out
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    raise SystemExit(f"unknown input case {name}")
