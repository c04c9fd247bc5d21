"""Port of "Parameter server training with ParameterServerStrategy"
(tensorflow/docs, tutorials/distribute/parameter_server_training.ipynb).

The tutorial builds an in-process cluster, a ParameterServerStrategy with a
variable partitioner, then trains two ways:
- Keras `model.fit` with a `DatasetCreator` (gone in Keras 3) -> here `--mode fit`:
  `stratkit.Trainer(...).fit`, which runs the coordinator loop for you;
- a custom loop -> `--mode loop`: `ClusterCoordinator`, `create_per_worker_dataset`,
  `schedule` / `join`, with raw atomic `tf.Variable` counters instead of Keras metrics
  (Keras 3 metrics lose updates under asynchronous workers; stratkit refuses them).

What changed: no in-process cluster or `SimpleClusterResolver` to build (`stratkit launch`
or your cluster sets TF_CONFIG), `tf.distribute.ParameterServerStrategy(resolver, ...)` ->
`stratkit.make_strategy(variable_partitioner=...)`, which also runs the ps and worker tasks
(the tutorial's `tf.distribute.Server(...).join()`), and exits them when the chief is done.
    stratkit launch --chief --workers 2 --ps 1 -- python examples/tutorials/parameter_server.py [--mode loop]
    python examples/tutorials/parameter_server.py      # no cluster: the same code on one device
"""

from __future__ import annotations

import argparse

import stratkit

from _digits import build_model, load_digits_split, report

GLOBAL_BATCH = 64


def partitioner(min_shard_bytes: int):
    """The tutorial's partitioner: variables of more than min_shard_bytes are split over the ps tasks."""
    import tensorflow as tf

    num_ps = len(stratkit.detect().cluster.get("ps", ()))
    return tf.distribute.experimental.partitioners.MinSizePartitioner(min_shard_bytes=min_shard_bytes,
                                                                      max_shards=max(num_ps, 1))


def count_sharded(model) -> int:
    """How many of the model's weights the partitioner split over several ps tasks."""
    return sum(type(w.value).__name__ == "ShardedVariable" for w in model.weights)


def trainable_shards(model) -> list:
    """model.trainable_variables, with each partitioned (sharded) weight replaced by its shards."""
    targets = []
    for weight in model.trainable_variables:
        sharded = type(weight.value).__name__ == "ShardedVariable"
        targets.extend(weight.value.variables if sharded else [weight])
    return targets


def compile_model(model):
    import keras

    model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def with_trainer(args) -> dict:
    # The tutorial's model.fit(DatasetCreator(dataset_fn), epochs=5, steps_per_epoch=20, callbacks=...)
    trainer = stratkit.Trainer(seed=0, **({"variable_partitioner": partitioner(args.min_shard_bytes)} if _is_ps() else {}))
    x, y, x_test, y_test = load_digits_split()
    model = trainer.build(lambda: compile_model(build_model()))
    history = trainer.fit(model, (x, y), epochs=args.epochs, steps_per_epoch=args.steps,
                          global_batch_size=GLOBAL_BATCH)
    accuracy = trainer.evaluate(model, (x_test, y_test), global_batch_size=GLOBAL_BATCH)["accuracy"]
    return dict(strategy=trainer.spec.strategy, sharded=count_sharded(model), loss=float(history.history["loss"][-1]),
                train_accuracy=float(history.history["accuracy"][-1]), eval_accuracy=float(accuracy))


def _is_ps() -> bool:
    return stratkit.detect().strategy == "parameter_server"


def with_coordinator(args) -> dict:
    if not _is_ps():
        raise SystemExit("--mode loop needs a parameter-server cluster: "
                         "stratkit launch --chief --workers 2 --ps 1 -- python parameter_server.py --mode loop")
    strategy = stratkit.make_strategy(variable_partitioner=partitioner(args.min_shard_bytes))  # ps/worker tasks serve here, then exit
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    x, y, x_test, y_test = load_digits_split()
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)

    def dataset_fn(input_context):
        batch = input_context.get_per_replica_batch_size(GLOBAL_BATCH)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x)).repeat()
        return ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id).batch(batch).prefetch(2)

    @tf.function
    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)

    per_worker_iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))

    with strategy.scope():
        model = build_model()
        optimizer = keras.optimizers.RMSprop(0.01)
        # A partitioned weight holds a ShardedVariable, which Keras 3 cannot differentiate or update
        # ("'ShardedVariable' object has no attribute 'handle'"): train its shards, one per ps.
        targets = trainable_shards(model)
        optimizer.build(targets)             # slots now, on the ps of each shard (not inside a closure)
        # Instead of keras.metrics.SparseCategoricalAccuracy: raw counters, atomic on the ps.
        steps = tf.Variable(0, dtype=tf.int64)
        correct = tf.Variable(0.0)
        seen = tf.Variable(0.0)
        loss_sum = tf.Variable(0.0)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    @tf.function
    def train_step(iterator):
        def replica_fn(batch):
            features, labels = batch
            with tf.GradientTape() as tape:
                logits = model(features, training=True)
                loss = tf.nn.compute_average_loss(loss_fn(labels, logits), global_batch_size=GLOBAL_BATCH)
            grads = tape.gradient(loss, targets)
            optimizer.apply_gradients(zip(grads, targets))
            hits = tf.cast(tf.equal(tf.argmax(logits, axis=1, output_type=tf.int32), labels), tf.float32)
            return tf.reduce_sum(hits), tf.cast(tf.size(labels), tf.float32), loss

        c, n, loss = (strategy.reduce("SUM", v, axis=None)
                      for v in strategy.run(replica_fn, args=(next(iterator),)))
        correct.assign_add(c)                    # outside strategy.run: one atomic kernel on the ps
        seen.assign_add(n)
        loss_sum.assign_add(loss)
        return steps.assign_add(1)

    for epoch in range(args.epochs):
        for var in (correct, seen, loss_sum):
            var.assign(0.0)
        for _ in range(args.steps):
            coordinator.schedule(train_step, args=(per_worker_iterator,))
        coordinator.join()
        print(f"Epoch {epoch}: accuracy {float(correct.numpy() / seen.numpy()):.4f}, "
              f"loss {float(loss_sum.numpy()) / args.steps:.4f}", flush=True)

    predicted = tf.argmax(model(x_test, training=False), axis=1).numpy()   # on the coordinator
    return dict(strategy="parameter_server", sharded=count_sharded(model), steps=int(steps.numpy()), scheduled=args.epochs * args.steps,
                loss=float(loss_sum.numpy()) / args.steps, train_accuracy=float(correct.numpy() / seen.numpy()),
                eval_accuracy=float((predicted == y_test).mean()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("fit", "loop"), default="fit")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="steps_per_epoch (the tutorial uses 20)")
    parser.add_argument("--min-shard-bytes", type=int, default=256 << 10,
                        help="partition variables larger than this over the ps tasks (the tutorial's 256 KiB)")
    args = parser.parse_args()
    numbers = with_coordinator(args) if args.mode == "loop" else with_trainer(args)
    report(tutorial="parameter_server", mode=args.mode, **numbers)


if __name__ == "__main__":
    main()
