"""A ResNet-50-style image classifier on synthetic images (no download).

Bottleneck residual blocks (1x1 -> 3x3 -> 1x1, batch norm, projection
shortcuts) in ResNet-50's stage layout, scaled by --width and --blocks so it
fits a CPU; `--blocks 3,4,6,3 --width 64 --image 224` is the real ResNet-50.
Runs unchanged on one process or under TF_CONFIG / `stratkit launch`.
"""

from __future__ import annotations

import argparse
import json

import stratkit


def synthetic_images(n: int, image: int, classes: int, seed: int = 0):
    """Images whose class is encoded in a learnable colour/texture pattern."""
    import numpy as np

    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, size=n).astype("int32")
    x = rng.normal(0, 0.5, size=(n, image, image, 3)).astype("float32")
    x[..., 0] += (y[:, None, None] / classes).astype("float32")
    return x, y


def resnet(image: int, classes: int, width: int, blocks: list[int]):
    import keras
    from keras import layers

    def bottleneck(x, filters, stride, project):
        shortcut = x
        if project:
            shortcut = layers.Conv2D(4 * filters, 1, strides=stride, use_bias=False)(x)
            shortcut = layers.BatchNormalization()(shortcut)
        x = layers.Conv2D(filters, 1, strides=stride, use_bias=False)(x)
        x = layers.ReLU()(layers.BatchNormalization()(x))
        x = layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
        x = layers.ReLU()(layers.BatchNormalization()(x))
        x = layers.Conv2D(4 * filters, 1, use_bias=False)(x)
        x = layers.BatchNormalization()(x)
        return layers.ReLU()(layers.Add()([x, shortcut]))

    inputs = keras.Input((image, image, 3))
    x = layers.Conv2D(width, 7 if image >= 64 else 3, strides=2 if image >= 64 else 1, padding="same",
                      use_bias=False)(inputs)
    x = layers.ReLU()(layers.BatchNormalization()(x))
    for stage, count in enumerate(blocks):
        filters = width * 2 ** stage
        for i in range(count):
            x = bottleneck(x, filters, stride=2 if (i == 0 and stage > 0) else 1, project=(i == 0))
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(classes)(x), name="resnet_style")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--examples", type=int, default=512)
    parser.add_argument("--image", type=int, default=32)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--blocks", default="1,1,1,1", help="bottleneck blocks per stage (ResNet-50: 3,4,6,3)")
    parser.add_argument("--per-replica-batch", type=int, default=32)
    parser.add_argument("--backup-dir", default=None)
    args = parser.parse_args(argv)

    trainer = stratkit.Trainer()
    import keras

    def build_and_compile():
        model = resnet(args.image, args.classes, args.width, [int(b) for b in args.blocks.split(",")])
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        return model

    x, y = synthetic_images(args.examples, args.image, args.classes)
    model = trainer.build(build_and_compile)
    history = trainer.fit(model, (x, y), epochs=args.epochs, per_replica_batch_size=args.per_replica_batch,
                          backup_dir=args.backup_dir, scale_learning_rate=trainer.num_replicas > 1,
                          warmup_epochs=1 if trainer.num_replicas > 1 and args.epochs > 1 else 0)
    result = {"loss": [round(v, 4) for v in history.history["loss"]], "params": model.count_params(),
              "replicas": trainer.num_replicas, "strategy": trainer.spec.strategy}
    if trainer.is_chief:
        print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
