"""What bench_lake.py measures inside one process (the store's settings in its environment).

    python lake_task.py throughput URL ROUNDS BATCH   -> {"rounds": [{"reader": rows/s, "reader, 3 passes": ...,
                                                                   "limit": ..., "limit, use_threads=False": ...,
                                                                   "recipe": ...}]}
    python lake_task.py cnn URL ROUNDS BATCH          -> {"rounds": [{"table": steps/s, "arrays": steps/s}]}
    python lake_task.py memory SMALL_URL BIG_URL BUDGET table|control  (every task of `stratkit launch`)
                                                       -> {"rank", "feed", "small_peak_kb", "big_peak_kb", ...}

Each prints one JSON line last. Rounds alternate the ways (their order rotates each round); the recipe's rounds
come after the others' (`throughput`).
"""

from __future__ import annotations

import json
import resource
import sys
import time


#: The recipe's rate is measured on the table's first rows: it hands tf.data one row at a time (about 3,000-5,000
#: rows/s here, so the whole 1,000,000-row table would take ~5 min a round); a rate per row needs no more.
RECIPE_ROWS = 100_000
#: `fit` reads its epochs from one pipeline (`TableInput.dataset_fn(passes=None)`): its threads start and its first
#: block is read once a fit, not once a pass. The reader is timed both ways: one pass a pipeline (every cost of a
#: start in each pass) and this many passes in one pipeline (as `fit`'s epochs).
STEADY_PASSES = 3


def _files(url: str):
    import pyarrow.fs as pafs

    from stratkit.storage.arrow import arrow_filesystem

    fs, base = arrow_filesystem(url)
    infos = fs.get_file_info(pafs.FileSelector(base, recursive=True))
    return fs, sorted(i.path for i in infos if i.path.endswith(".parquet"))


def throughput(url: str, rounds: int, batch: int) -> dict:
    import numpy as np
    import pyarrow.parquet as pq
    import tensorflow as tf

    from stratkit.data import Table, TableInput

    fs, files = _files(url)
    started = time.perf_counter()
    data = TableInput(Table.parquet(url), features="x", label="y", seed=1)
    rows = data.plan().rows
    plan_seconds = time.perf_counter() - started
    count = lambda ds: int(ds.reduce(tf.constant(0, tf.int64),  # noqa: E731 - consumed in-graph, as fit does
                                     lambda n, b: n + tf.cast(tf.shape(b[0])[0], tf.int64)))

    def reader() -> int:
        return count(data.dataset_fn(batch, passes=1)(tf.distribute.InputContext()))

    def reader_passes() -> int:    # as `fit` reads over epochs: one pipeline (its threads, first block) for all
        return count(data.dataset_fn(batch, passes=STEADY_PASSES)(tf.distribute.InputContext()))

    def limit(use_threads: bool = True) -> int:
        n = 0
        for path in files:
            with fs.open_input_file(path) as handle:
                for part in pq.ParquetFile(handle).iter_batches(batch_size=batch, columns=["x", "y"],
                                                                use_threads=use_threads):
                    n += part.num_rows
        return n

    def limit_one_thread() -> int:  # pyarrow's decode without its column threads: 1.4-1.6x the default here
        return limit(use_threads=False)

    recipe_rows = min(rows, RECIPE_ROWS)

    def recipe() -> int:   # the usual recipe: a generator of rows over pyarrow, batched by tf.data
        def rows_of():
            left = recipe_rows
            for path in files:
                with fs.open_input_file(path) as handle:
                    for part in pq.ParquetFile(handle).iter_batches(batch_size=4096, columns=["x", "y"]):
                        x = np.asarray(part.column("x").flatten().to_numpy()).reshape(part.num_rows, -1)
                        y = part.column("y").to_numpy()
                        for i in range(min(part.num_rows, left)):
                            yield x[i], y[i]
                        left -= min(part.num_rows, left)
                        if not left:
                            return

        width = data.plan().column("x").shape[0]
        ds = tf.data.Dataset.from_generator(rows_of, output_signature=(
            tf.TensorSpec((width,), tf.float32), tf.TensorSpec((), tf.float32))).batch(batch)
        return count(ds.prefetch(2))

    def reader_fsspec() -> int:    # the same reader through s3fs (STRATKIT_LAKE_FILESYSTEM=fsspec)
        import os

        os.environ["STRATKIT_LAKE_FILESYSTEM"] = "fsspec"
        try:
            return reader()
        finally:
            del os.environ["STRATKIT_LAKE_FILESYSTEM"]

    ways = {"reader": reader, f"reader, {STEADY_PASSES} passes": reader_passes, "limit": limit,
            "limit, use_threads=False": limit_one_thread}
    if url.startswith("s3://"):
        ways["reader via s3fs"] = reader_fsspec
    out = _alternate(ways, rounds, {name: rows * (STEADY_PASSES if "passes" in name else 1) for name in ways})
    # The recipe's rounds come after the others': run between them, it halved the reader's rate. The reader's
    # first pass after it took 0.58-0.66 s instead of 0.29-0.33 (its first block 0.35 s instead of 0.11), and
    # Arrow's decode threads twice their CPU, in pyarrow's default pool (mimalloc) only: after the recipe's
    # thousands of small decodes, 1.4x in jemalloc, no change in the system allocator; the pass after, as before.
    for measured, recipes in zip(out, _alternate({"recipe": recipe}, rounds, {"recipe": recipe_rows})):
        measured.update(recipes)
    return {"rows": rows, "plan_seconds": plan_seconds, "rounds": out}


def _alternate(ways: dict, rounds: int, expected: dict) -> list[dict]:
    """`rounds` rounds of every way (rows/s), their order rotating each round, after one untimed run of each
    (TensorFlow's first pipeline and trace, the files' cache)."""
    for way in ways.values():
        way()
    out = []
    for r in range(rounds):
        names = list(ways)[r % len(ways):] + list(ways)[:r % len(ways)]
        measured = {}
        for name in names:
            started = time.perf_counter()
            n = ways[name]()
            assert n == expected[name], (name, n, expected[name])
            measured[name] = n / (time.perf_counter() - started)
        out.append(measured)
    return out


def cnn(url: str, rounds: int, batch: int) -> dict:
    import keras
    import numpy as np
    import pyarrow.parquet as pq

    import stratkit
    from stratkit.data import Table, TableInput

    trainer = stratkit.Trainer(strategy="one_device")
    data = TableInput(Table.parquet(url), features="image", label="label", seed=1)
    fs, files = _files(url)
    table = [pq.read_table(fs.open_input_file(p), columns=["image", "label"]) for p in files]
    images = np.concatenate([np.asarray(t.column("image").combine_chunks().flatten().to_numpy()).reshape(
        t.num_rows, 16, 16, 3) for t in table]).astype("float32")
    labels = np.concatenate([t.column("label").to_numpy() for t in table])

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((16, 16, 3)), keras.layers.Conv2D(16, 3, activation="relu"),
                                  keras.layers.MaxPooling2D(), keras.layers.Conv2D(32, 3, activation="relu"),
                                  keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.started = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds = time.perf_counter() - self.started

    def decoded():
        """The ceiling of any reader that decodes the table with pyarrow: its raw decode (`iter_batches`, no order,
        no shuffle) fed to the CNN through the reader's own tf.data pipeline (ready steps stacked, `unbatch`)."""
        import tensorflow as tf

        per_chunk = 16

        def chunks():
            for path in files:
                with fs.open_input_file(path) as handle:
                    for part in pq.ParquetFile(handle).iter_batches(batch_size=batch * per_chunk,
                                                                    columns=["image", "label"], use_threads=False):
                        x = np.asarray(part.column("image").flatten().to_numpy()).reshape(part.num_rows, 16, 16, 3)
                        y = part.column("label").to_numpy()
                        full = part.num_rows // batch * batch
                        if full:
                            yield x[:full].reshape(-1, batch, 16, 16, 3), y[:full].reshape(-1, batch)
                        if full < part.num_rows:
                            yield x[full:][None], y[full:][None]

        signature = (tf.TensorSpec((None, None, 16, 16, 3), tf.float32), tf.TensorSpec((None, None), tf.int64))
        dataset = tf.data.Dataset.from_generator(chunks, output_signature=signature).prefetch(1).unbatch()
        options = tf.data.Options()
        options.autotune.enabled = False
        return dataset.with_options(options)

    #: Steps an epoch of each way: the decode's last step of each file is short (its files are not cut at the
    #: global batches), the others' at the table's end.
    decoded_steps = sum(-(-pq.ParquetFile(fs.open_input_file(p)).metadata.num_rows // batch) for p in files)

    def steps_per_second(name, source) -> float:
        model = trainer.build(build)
        clock = Clock()
        steps = decoded_steps if name == "decoded" else data.steps_per_epoch(batch)
        if name == "decoded":   # a dataset_fn, as the reader's own: batched, and one pipeline over the epochs
            trainer.fit(model, source, epochs=2, global_batch_size=batch, steps_per_epoch=steps, verbose=0,
                        callbacks=[clock])
        else:
            trainer.fit(model, source, epochs=2, global_batch_size=batch, verbose=0, callbacks=[clock])
        return steps / clock.seconds        # the second epoch: traced and warm

    out = []
    for r in range(rounds):
        order = [("table", data), ("arrays", (images, labels)), ("decoded", lambda context: decoded())]
        measured = {}
        for name, source in order[r % len(order):] + order[:r % len(order)]:
            measured[name] = steps_per_second(name, source)
        out.append(measured)
    return {"rows": int(len(labels)), "rounds": out}


def memory(small: str, big: str, budget: int, feed: str) -> dict:
    """Each worker: a fit on a tiny table (the reader, TensorFlow and Keras warmed), then one pass of the big table
    (`feed` "table"), or as many steps of the same model fed from memory (`feed` "control": the big table's first
    rows over and over, no reader). The peak's growth over the tiny fit's: the control's is the model's own (a
    fit of 4,000 steps under MWMS grows 28-30 MiB with no reader at all, measured), the table's less the
    control's is the reader's."""
    import keras
    import numpy as np
    import pyarrow.parquet as pq
    import tensorflow as tf

    import stratkit
    from stratkit.data import Table, TableInput

    trainer = stratkit.Trainer()

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
        return model

    peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # noqa: E731 - KiB on Linux

    def table(url: str):
        # lanes=12: "auto" picks lanes from the table's row groups, not the budget (the big table's ~945 groups
        # give 120 lanes, 60 a worker, whose open row groups alone are 48 MB); each lane holds one row group
        return TableInput(Table.parquet(url), features="x", label="y", seed=1, shuffle_window=512,
                          read_ahead_bytes=budget, lanes=12)

    def fit(data, steps=None) -> None:
        model = trainer.build(build)
        trainer.fit(model, data, epochs=1, global_batch_size=512, verbose=0, steps_per_epoch=steps)

    before = peak()
    fit(table(small))
    small_peak = peak()
    data = table(big)
    plan = data.plan()
    if feed == "table":
        fit(data)
    else:
        fs, files = _files(big)
        first = pq.ParquetFile(fs.open_input_file(files[0])).read_row_group(0, columns=["x", "y"])
        x = np.asarray(first.column("x").combine_chunks().flatten().to_numpy()).reshape(first.num_rows, -1)
        y = first.column("y").to_numpy().reshape(-1, 1)
        fit(tf.data.Dataset.from_tensor_slices((x, y)).repeat(), data.steps_per_epoch(512))
    import pyarrow as pa

    return {"rank": max(trainer.spec.worker_rank, 0), "feed": feed, "arrow_pool": pa.default_memory_pool().backend_name,
            "before_kb": before, "small_peak_kb": small_peak, "big_peak_kb": peak(), "big_rows": plan.rows,
            "big_decoded_bytes": int(plan.rows * plan.row_bytes), "budget": budget}


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "throughput":
        result = throughput(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif what == "cnn":
        result = cnn(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        result = memory(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    print("RESULT " + json.dumps(result), flush=True)
