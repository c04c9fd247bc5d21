"""The driver of tests/ray/test_ray_hosts.py, run on test host h1 against the two-node Ray cluster.

`python ray_hosts_driver.py ADDRESS OUT`: RayRunner with 2 workers, one per node (STRICT_SPREAD), trains 3
epochs; the driver then trains the same model in its own process (no TF_CONFIG), then the same job runs
inside Ray Train (TensorflowTrainer, one worker per node); each result is printed as JSON.
Then a second, long run, which the test breaks by killing h2: its RayTrainingError is printed as JSON.
"""

from __future__ import annotations

import json
import os
import sys

import ray

from stratkit.ray import RayRunner, RayTrainingError


def make_data():
    import numpy as np

    rng = np.random.default_rng(1)
    x = rng.normal(size=(256, 8)).astype("float32")
    return x, (x[:, :4].sum(axis=1) > x[:, 4:].sum(axis=1)).astype("int32")


def train(epochs):
    import socket

    import keras

    import stratkit

    class Epochs(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            print(f"EPOCH {epoch + 1}", flush=True)

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    trainer = stratkit.Trainer(seed=0)
    model = trainer.build(build)
    trainer.fit(model, make_data(), epochs=epochs, global_batch_size=64, callbacks=[Epochs()], verbose=0)
    return {"weights": [w.ravel().tolist() for w in model.get_weights()], "host": socket.gethostname(),
            "replicas": trainer.num_replicas, "source": trainer.spec.source}


def ray_train_loop(config):
    """The same job inside Ray Train (TensorflowTrainer writes the TF_CONFIG); each rank writes its weights."""
    import json
    import os

    import ray.train

    result = train(config["epochs"])
    rank = ray.train.get_context().get_world_rank()
    with open(os.path.join(config["out"], f"raytrain-rank{rank}.json"), "w") as handle:
        json.dump(result, handle)


def main(address: str, out: str) -> None:
    ray.init(address=address, _node_ip_address="198.18.0.1", log_to_driver=False)
    runner = RayRunner(num_workers=2, placement_strategy="STRICT_SPREAD", timeout=300)
    got = runner.run(train, 3)
    print("RESULT " + json.dumps({"got": got, "nodes": runner.last_run.nodes}), flush=True)
    single = train(3)
    print("SINGLE " + json.dumps(single), flush=True)
    from ray.train import RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    TensorflowTrainer(ray_train_loop, train_loop_config={"epochs": 3, "out": out},
                      scaling_config=ScalingConfig(num_workers=2, placement_strategy="STRICT_SPREAD"),
                      run_config=RunConfig(name="hosts", storage_path=os.path.join(out, "ray-results"))).fit()
    ranks = []
    for rank in (0, 1):
        with open(os.path.join(out, f"raytrain-rank{rank}.json")) as handle:
            ranks.append(json.load(handle))
    print("RAYTRAIN " + json.dumps(ranks), flush=True)
    print("LONG RUN STARTS", flush=True)
    try:
        RayRunner(num_workers=2, placement_strategy="STRICT_SPREAD", timeout=300).run(train, 1000)
        print("LOST " + json.dumps({"error": None}), flush=True)
    except RayTrainingError as error:
        print("LOST " + json.dumps({"task": error.task, "node": error.node, "lost": error.lost,
                                    "summary": str(error).splitlines()[0]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
