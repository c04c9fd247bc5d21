"""Train from a Parquet table on a store (or a local directory), on one process or under `stratkit launch`.

    # a table to train on (skip this with a table of your own: columns "pixels", "color", "label")
    python examples/train_from_lake.py make-table s3://my-bucket/shapes --rows 100000

    # one process, then the same script on 2 workers: the same weights (one order at any world size)
    python examples/train_from_lake.py train s3://my-bucket/shapes --backup-dir s3://my-bucket/runs/shapes
    stratkit launch --workers 2 -- python examples/train_from_lake.py train s3://my-bucket/shapes \\
        --backup-dir s3://my-bucket/runs/shapes

Each worker reads only its share of the table's row groups, in background threads; every row is trained once
per epoch; a worker killed mid-epoch resumes at the last step backup, at any world size (docs/data.md). The
columns keep their types: "pixels" (64 float32s, an 8x8 image), "color" (a string, through StringLookup),
"label" (an int64 class). The store's endpoint and credentials come from its usual environment
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ... for S3).
"""

from __future__ import annotations

import argparse
import json

COLORS = ["red", "green", "blue", "black"]


def make_table(url: str, rows: int, files: int, seed: int = 0) -> None:
    """`files` Parquet files of 8x8 images of a bar (vertical / horizontal / a diagonal / a square), tinted."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stratkit.storage.arrow import arrow_filesystem

    fs, base = arrow_filesystem(url)
    fs.create_dir(base, recursive=True)   # a local directory (a store has no directories: nothing to do)
    rng = np.random.default_rng(seed)
    sizes = np.full(files, rows // files)
    sizes[: rows % files] += 1
    for index, count in enumerate(sizes):
        label = rng.integers(0, 4, count)
        images = rng.normal(0.0, 0.3, (count, 8, 8)).astype("float32")
        at = rng.integers(1, 7, count)
        for i in range(count):
            if label[i] == 0:
                images[i, :, at[i]] += 1.0
            elif label[i] == 1:
                images[i, at[i], :] += 1.0
            elif label[i] == 2:
                images[i][np.eye(8, dtype=bool)] += 1.0
            else:
                images[i, 2:6, 2:6] += 1.0
        color = np.array(COLORS)[rng.integers(0, 4, count)]
        table = pa.table({"pixels": pa.FixedSizeListArray.from_arrays(pa.array(images.reshape(-1)), 64),
                          "color": pa.array(color), "label": pa.array(label.astype("int64"))})
        with fs.open_output_stream(f"{base}/part-{index:05d}.parquet") as out:
            pq.write_table(table, out, row_group_size=max(256, int(count) // 3))


def train(url: str, epochs: int, batch: int, backup_dir: str | None) -> dict:
    import stratkit

    trainer = stratkit.Trainer()     # first: it starts the workers' collectives under stratkit launch
    import keras

    from stratkit.data import Table, TableInput

    data = TableInput(Table.parquet(url), features=["pixels", "color"], label="label", seed=1)

    def build():
        keras.utils.set_random_seed(0)
        pixels = keras.Input((8, 8, 1), name="pixels")
        color = keras.Input((), dtype="string", name="color")
        x = keras.layers.Conv2D(8, 3, activation="relu")(pixels)
        x = keras.layers.Flatten()(keras.layers.MaxPooling2D()(x))
        tint = keras.layers.StringLookup(vocabulary=COLORS, output_mode="one_hot")(color)
        out = keras.layers.Dense(4)(keras.layers.Concatenate()([x, tint]))
        model = keras.Model([pixels, color], out)
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        return model

    model = trainer.build(build)
    history = trainer.fit(model, data, epochs=epochs, global_batch_size=batch, backup_dir=backup_dir,
                          backup_every=50 if backup_dir else None, verbose=0)
    return {"rows": data.num_rows, "steps_per_epoch": data.steps_per_epoch(batch),
            "loss": [round(v, 6) for v in history.history["loss"]],
            "accuracy": [round(v, 4) for v in history.history["accuracy"]], "workers": trainer.spec.num_workers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("make-table", help="write a synthetic Parquet table")
    make.add_argument("url")
    make.add_argument("--rows", type=int, default=100_000)
    make.add_argument("--files", type=int, default=16)
    run = commands.add_parser("train", help="train on the table")
    run.add_argument("url")
    run.add_argument("--epochs", type=int, default=3)
    run.add_argument("--batch", type=int, default=256, help="the global batch")
    run.add_argument("--backup-dir", default=None)
    args = parser.parse_args()
    if args.command == "make-table":
        make_table(args.url, args.rows, args.files)
        print(json.dumps({"written": args.url, "rows": args.rows}))
    else:
        print(json.dumps(train(args.url, args.epochs, args.batch, args.backup_dir)), flush=True)


if __name__ == "__main__":
    main()
