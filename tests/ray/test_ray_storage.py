"""Ray on object storage (moto's S3 server on loopback, a real local Ray).

* Ray Train: `RunConfig(storage_path="s3://...")` with stratkit's `RayReportCallback`: Ray uploads every
  reported checkpoint to the bucket through pyarrow.fs (which reads the endpoint and keys from the same
  environment as s3fs: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...), a worker dies mid-run, and the restarted group
  resumes from the checkpoint Ray reads back from the bucket.
* RayRunner: a `train_fn` that saves with `Trainer.save` to an s3:// URL and returns it; the driver reads the
  model back.

The store's settings are in the environment before `ray.init`, so Ray's processes inherit them, as a cluster's
nodes would have them.
"""

from __future__ import annotations

import json
import sys

import pytest
import stores
from ray_helpers import local_ray, needs_ray

pytestmark = [pytest.mark.slow, pytest.mark.ray, needs_ray]

EPOCHS = 3
FAIL_AT_EPOCH = 2


@pytest.fixture(scope="module")
def s3_ray(store_server):
    import cloudpickle

    server = store_server("s3")
    with stores.client_settings(server), local_ray() as ray:
        import ray.cloudpickle

        # the loops travel to Ray's workers (RayRunner's tasks: with cloudpickle) by value
        for pickler in (cloudpickle, ray.cloudpickle):
            pickler.register_pickle_by_value(sys.modules[__name__])
        yield server, ray
        for pickler in (cloudpickle, ray.cloudpickle):
            pickler.unregister_pickle_by_value(sys.modules[__name__])


def build_model():
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def make_data():
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 4)).astype("float32"), rng.normal(size=(64, 2)).astype("float32")


def loop(config):
    import os

    import keras
    import ray.train

    import stratkit
    from stratkit.ray import RayReportCallback

    rank = ray.train.get_context().get_world_rank()
    report = RayReportCallback()
    trainer = stratkit.Trainer(seed=0)
    model = trainer.build(build_model)
    marker = os.path.join(config["out"], "failed-once")

    class DieOnce(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if rank == 1 and epoch == FAIL_AT_EPOCH and not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(3)

    x, y = make_data()
    history = trainer.fit(model, (x, y), epochs=EPOCHS, global_batch_size=16, backup_dir=report.backup_dir,
                          callbacks=[report, DieOnce()], verbose=0)
    with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as handle:
        json.dump({"resumed_epoch": report.resumed_epoch, "epochs": len(history.history["loss"])}, handle)


def test_ray_train_keeps_its_checkpoints_in_s3_and_a_restart_resumes_from_there(s3_ray, tmp_path):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    server, _ = s3_ray
    bucket = server.make_bucket("ray-storage")
    out = tmp_path / "out"
    out.mkdir()
    result = TensorflowTrainer(loop, train_loop_config={"out": str(out)},
                               scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                               run_config=RunConfig(name="on-s3", storage_path=f"s3://{bucket}/ray",
                                                    failure_config=FailureConfig(max_failures=1))).fit()
    assert result.error is None, result.error
    assert (out / "failed-once").exists(), "the injected failure did not happen: the resume was not tested"
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["resumed_epoch"] == ranks[1]["resumed_epoch"] >= 1
    assert ranks[0]["epochs"] == EPOCHS - ranks[0]["resumed_epoch"]
    # Ray's checkpoints are objects in the bucket, the last one at the last epoch, and Ray reads it back.
    names = server.fs().find(f"{bucket}/ray/on-s3")
    assert [n for n in names if n.endswith("/checkpoint.json")], names
    assert result.checkpoint is not None and result.checkpoint.path.startswith(f"{bucket}/ray/on-s3")
    with result.checkpoint.as_directory() as directory, open(f"{directory}/checkpoint.json") as handle:
        assert json.load(handle)["epoch"] == EPOCHS


def train_and_save(url):
    import stratkit

    trainer = stratkit.Trainer(seed=0)
    model = trainer.build(build_model)
    x, y = make_data()
    trainer.fit(model, (x, y), epochs=1, global_batch_size=16, verbose=0)
    return {"saved": trainer.save(model, url), "weights": [w.tolist() for w in model.get_weights()]}


def test_a_ray_runner_train_fn_saves_to_s3_and_the_driver_reads_it_back(s3_ray):
    import keras
    import numpy as np

    from stratkit import storage
    from stratkit.ray import RayRunner

    server, _ = s3_ray
    url = server.url(server.make_bucket("ray-results"), "out", "model.keras")
    result = RayRunner(num_workers=2).run(train_and_save, url)
    assert result["saved"] == url
    with storage.local_copy(url) as path:
        loaded = keras.models.load_model(path)
    for got, want in zip(loaded.get_weights(), result["weights"]):
        assert np.array_equal(got, np.asarray(want, got.dtype))
