"""Inside Ray Train (`TensorflowTrainer`, Train V2) on a real local Ray: plain Keras 3 fails, stratkit trains exactly.

One Ray session for the module (`ray_helpers.local_ray`). Ray writes every
worker's TF_CONFIG itself (and sets TF_USE_LEGACY_KERAS=1); the tests check:

* the plain Keras 3 loop a Ray user writes (`tf.distribute.MultiWorkerMirroredStrategy()`
  + `model.fit`) fails in Ray Train with Keras's "Attempt to convert a value (PerReplica..."
  (ray-project/ray#47464);
* Ray Data: a dataset Ray Train splits, read through `stratkit.ray.dataset_shard_to_tf`, trains as one
  process on the same global batches (<= 1e-5), and shards of different sizes are refused on every worker;
* the same model through `stratkit.Trainer(seed=0)` + `trainer.fit(..., global_batch_size=64)`
  on 2 Ray Train workers ends with the weights of one process (<= 1e-5), the workers identical,
  while `RayReportCallback` reports every epoch with the chief's checkpoint, and a worker that
  dies mid-run makes Ray restart the group (`FailureConfig(max_failures=1)`), which resumes
  from Ray's checkpoint and still ends with one process's weights.
"""

from __future__ import annotations

import json
import sys

import pytest

from ray_helpers import local_ray, needs_ray

pytestmark = [pytest.mark.slow, pytest.mark.ray, needs_ray]

EPOCHS = 4
FAIL_AT_EPOCH = 2  # worker 1 dies when epoch index 2 begins, on the first attempt only


@pytest.fixture(scope="module")
def ray_session():
    with local_ray() as ray:
        import ray.cloudpickle

        # The loops below travel to Ray's workers by value: they cannot import this test module.
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        yield ray
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def make_data():
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    y = (x[:, :4].sum(axis=1) > x[:, 4:].sum(axis=1)).astype("int32")
    return x, y


def build_model():
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def plain_keras_loop(config):
    """What Ray's TensorflowTrainer docstring shows, on Keras 3: the strategy, then model.fit."""
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = build_model()
    x, y = make_data()
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)


def stratkit_loop(config):
    import os

    import keras
    import ray.train

    import stratkit
    from stratkit.ray import RayReportCallback

    rank = ray.train.get_context().get_world_rank()
    report = RayReportCallback()
    trainer = stratkit.Trainer(seed=0)
    model = trainer.build(build_model)
    callbacks = [report]
    marker = os.path.join(config["out"], "failed-once")

    class DieOnce(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if rank == 1 and epoch == FAIL_AT_EPOCH and not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(3)  # a worker lost mid-run, as after a kill

    callbacks.append(DieOnce())
    x, y = make_data()
    history = trainer.fit(model, (x, y), epochs=EPOCHS, global_batch_size=64, backup_dir=report.backup_dir,
                          callbacks=callbacks)
    weights = [w.ravel().tolist() for w in model.get_weights()]
    with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as handle:
        json.dump({"weights": weights, "resumed_epoch": report.resumed_epoch,
                   "loss": history.history["loss"]}, handle)


def one_process():
    import stratkit

    trainer = stratkit.Trainer(seed=0)
    assert trainer.num_replicas == 1
    model = trainer.build(build_model)
    x, y = make_data()
    history = trainer.fit(model, (x, y), epochs=EPOCHS, global_batch_size=64)
    return {"weights": [w.ravel().tolist() for w in model.get_weights()], "loss": history.history["loss"]}


def _trainer(loop, tmp_path, name, max_failures=0, config=None):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    return TensorflowTrainer(loop, train_loop_config=config or {},
                             scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                             run_config=RunConfig(name=name, storage_path=str(tmp_path / "ray-results"),
                                                  failure_config=FailureConfig(max_failures=max_failures)))


def test_plain_keras_3_multi_worker_fit_fails_in_ray_train(ray_session, tmp_path):
    from ray.train import WorkerGroupError

    with pytest.raises(WorkerGroupError) as caught:
        _trainer(plain_keras_loop, tmp_path, "plain-keras").fit()
    failures = caught.value.worker_failures
    assert sorted(failures) == [0, 1], failures
    for rank, error in failures.items():  # Ray's summary cuts the message short; each worker's error is whole
        assert "Attempt to convert a value (PerReplica" in str(error), (rank, str(error)[-2000:])


def test_stratkit_trainer_in_ray_train_trains_as_one_process_and_resumes_from_rays_checkpoint(ray_session, tmp_path):
    ray = ray_session
    out = tmp_path / "out"
    out.mkdir()
    # The reference runs beside the Ray Train job, in a fresh worker process without TF_CONFIG.
    reference = ray.remote(num_cpus=1, max_calls=1)(one_process).remote()
    result = _trainer(stratkit_loop, tmp_path, "stratkit", max_failures=1, config={"out": str(out)}).fit()
    assert result.error is None, result.error
    assert (out / "failed-once").exists(), "the injected failure did not happen: the resume was not tested"
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    single = ray.get(reference)

    # The restart resumed from the chief's checkpoint Ray kept (the epoch before the failure, or the one before
    # that when Ray had not yet registered it), not from scratch.
    assert ranks[0]["resumed_epoch"] == ranks[1]["resumed_epoch"]
    assert 1 <= ranks[0]["resumed_epoch"] <= FAIL_AT_EPOCH
    assert len(ranks[0]["loss"]) == EPOCHS - ranks[0]["resumed_epoch"]
    for a, b in zip(ranks[0]["weights"], ranks[1]["weights"]):
        assert a == b, "the two workers' weights differ"
    worst = max(abs(a - b) for got, want in zip(ranks[0]["weights"], single["weights"]) for a, b in zip(got, want))
    assert worst <= 1e-5, f"2 Ray Train workers vs one process: max |diff| of weights {worst}"
    assert abs(ranks[0]["loss"][-1] - single["loss"][-1]) <= 1e-5

    # Ray kept the chief's checkpoint of the last epoch.
    assert result.checkpoint is not None
    with result.checkpoint.as_directory() as directory:
        with open(f"{directory}/checkpoint.json") as handle:
            assert json.load(handle)["epoch"] == EPOCHS
    if result.metrics is not None:
        assert result.metrics["epoch"] == EPOCHS


class RecordingShard:
    """This worker's real Ray Data shard, passed through; records the ids of the rows it gave, in order."""

    def __init__(self, shard, drop_last=False):
        self.shard, self.drop_last, self.ids = shard, drop_last, []

    def iter_batches(self, **kwargs):
        batches = list(self.shard.iter_batches(**kwargs))
        if self.drop_last:  # a shard one row short: what a dataset split by hand can give
            batches[-1] = {k: v[:-1] for k, v in batches[-1].items()}
        for batch in batches:
            self.ids.extend(int(i) for i in batch["id"])
            yield batch


def ray_data_loop(config):
    import os

    import ray.train

    import stratkit
    from stratkit.errors import ConfigError
    from stratkit.ray import dataset_shard_to_tf

    rank = ray.train.get_context().get_world_rank()
    trainer = stratkit.Trainer(seed=0)
    model = trainer.build(build_model)
    refused = ""
    try:  # shards of different sizes are refused on every worker (none hangs in the agreement)
        dataset_shard_to_tf(RecordingShard(ray.train.get_dataset_shard("train"), drop_last=rank == 1), trainer,
                            64, features="x", label="y")
    except ConfigError as exc:
        refused = str(exc)
    shard = RecordingShard(ray.train.get_dataset_shard("train"))
    data, steps = dataset_shard_to_tf(shard, trainer, 64, features="x", label="y")
    history = trainer.fit(model, data, epochs=2, steps_per_epoch=steps)
    with open(os.path.join(config["out"], f"data-rank{rank}.json"), "w") as handle:
        json.dump({"ids": shard.ids, "steps": steps, "refused": refused, "loss": history.history["loss"],
                   "weights": [w.ravel().tolist() for w in model.get_weights()]}, handle)


def one_process_on(order):
    import stratkit

    trainer = stratkit.Trainer(seed=0)
    model = trainer.build(build_model)
    x, y = make_data()
    history = trainer.fit(model, (x[order], y[order]), epochs=2, global_batch_size=64, shuffle=False)
    return {"weights": [w.ravel().tolist() for w in model.get_weights()], "loss": history.history["loss"]}


def test_ray_data_shards_feed_trainer_fit_with_one_process_global_batches(ray_session, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    ray = ray_session
    out = tmp_path / "out"
    out.mkdir()
    x, y = make_data()
    dataset = ray.data.from_items([{"id": i, "x": x[i], "y": y[i]} for i in range(len(y))])
    result = TensorflowTrainer(ray_data_loop, train_loop_config={"out": str(out)}, datasets={"train": dataset},
                               scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                               run_config=RunConfig(name="ray-data", storage_path=str(tmp_path / "ray-results"))
                               ).fit()
    assert result.error is None, result.error
    ranks = [json.loads((out / f"data-rank{rank}.json").read_text()) for rank in (0, 1)]
    for got in ranks:
        assert "differ in size (127 to 128 rows" in got["refused"] and "Fix:" in got["refused"], got["refused"]
    # Ray split the rows: each worker read its own half once, 4 steps of 32 rows per epoch.
    assert [r["steps"] for r in ranks] == [4, 4]
    assert sorted(ranks[0]["ids"] + ranks[1]["ids"]) == list(range(256))
    for a, b in zip(ranks[0]["weights"], ranks[1]["weights"]):
        assert a == b, "the two workers' weights differ"
    # One process on the same global batches: step k = rows 32k..32k+31 of worker 0's shard, then of worker 1's.
    order = [i for k in range(4) for r in (0, 1) for i in ranks[r]["ids"][32 * k:32 * k + 32]]
    single = ray.get(ray.remote(num_cpus=1, max_calls=1)(one_process_on).remote(order))
    worst = max(abs(a - b) for got, want in zip(ranks[0]["weights"], single["weights"]) for a, b in zip(got, want))
    print(f"Ray Data, 2 workers vs one process: max |diff| of weights {worst}")
    assert worst <= 1e-5, f"2 Ray Train workers on Ray Data vs one process: max |diff| of weights {worst}"
    assert abs(ranks[0]["loss"][-1] - single["loss"][-1]) <= 1e-5
