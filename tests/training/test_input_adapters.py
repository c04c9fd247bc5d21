"""The input layer: one adapter per input kind, one check per rule, the same data on every path.

`fit`/`evaluate`/`predict` on the synchronous strategies, evaluation in this
process and the parameter-server workers' shards all read the user's data
through `stratkit.training.inputs`; these tests run each path in one process.
"""

from __future__ import annotations

import numpy as np
import pytest

from stratkit.errors import ConfigError
from stratkit.training import inputs

tf = pytest.importorskip("tensorflow")

pytestmark = pytest.mark.slow

ROWS, BATCH = 96, 8


def _arrays():
    ids = np.arange(ROWS, dtype="float32")[:, None]
    return ids, ids * 2


def _kinds():
    x, y = _arrays()

    def dataset_fn(context):
        return tf.data.Dataset.from_tensor_slices((x, y)).shard(
            context.num_input_pipelines, context.input_pipeline_id).batch(context.get_per_replica_batch_size(BATCH))

    return {"numpy": (x, y), "dataset": tf.data.Dataset.from_tensor_slices((x, y)),
            "batched_dataset": tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).prefetch(2),
            "dataset_fn": dataset_fn}


def test_each_input_kind_gets_its_own_adapter():
    assert {kind: inputs.adapter_for(data).kind for kind, data in _kinds().items()} == {
        "numpy": "numpy", "dataset": "dataset", "batched_dataset": "batched_dataset", "dataset_fn": "dataset_fn"}
    assert inputs.adapter_for({"a": np.zeros((4, 1))}).kind == "numpy"


@pytest.mark.parametrize(("batch", "replicas"), [(16, 2), (8, 8), (7, 1), (96, 3)])
def test_a_global_batch_that_splits_evenly_passes(batch, replicas):
    inputs.check_divisible(batch, replicas)


@pytest.mark.parametrize(("batch", "replicas", "hint"), [(15, 2, "e.g. 14 or 16,"), (3, 4, "e.g. 4,"),
                                                          (10, 4, "e.g. 8 or 12,")])
def test_an_uneven_global_batch_is_refused_with_the_fix(batch, replicas, hint):
    with pytest.raises(ConfigError) as info:
        inputs.check_divisible(batch, replicas)
    message = str(info.value)
    assert f"global_batch_size={batch} does not split evenly over {replicas} replicas" in message
    assert hint in message and "Fix:" in message


@pytest.mark.parametrize("kind", ["numpy", "dataset"])
def test_every_kind_the_strategy_batches_is_refused_by_the_same_divisibility_check(kind):
    strategy = tf.distribute.get_strategy()
    with pytest.raises(ConfigError, match=r"global_batch_size=15 does not split evenly over 2 replicas.*14 or 16"):
        inputs.prepare(_kinds()[kind], strategy=strategy, num_replicas=2, global_batch_size=15)


def test_a_batched_dataset_is_refused_by_the_same_divisibility_check():
    x, y = _arrays()
    batched = tf.data.Dataset.from_tensor_slices((x, y)).batch(15)
    with pytest.raises(ConfigError, match=r"global_batch_size=15 does not split evenly over 2 replicas.*14 or 16"):
        inputs.prepare(batched, strategy=tf.distribute.get_strategy(), num_replicas=2, global_batch_size=None)


@pytest.mark.parametrize("kind", ["numpy", "dataset", "batched_dataset", "dataset_fn"])
def test_local_evaluation_reads_every_row_once_in_batches(kind):
    dataset = inputs.local_dataset(_kinds()[kind], BATCH)
    seen = np.concatenate([x.numpy()[:, 0] for x, _ in dataset])
    assert sorted(seen.tolist()) == list(range(ROWS))


def test_local_predict_reads_the_inputs_of_every_kind_in_order():
    x, _ = _arrays()
    for data in (x, (x,), tf.data.Dataset.from_tensor_slices(x), tf.data.Dataset.from_tensor_slices(_arrays()),
                 tf.data.Dataset.from_tensor_slices(x).batch(BATCH)):
        batches = list(inputs.predict_dataset(data, BATCH))
        assert np.concatenate([b.numpy() for b in batches])[:, 0].tolist() == list(range(ROWS))


@pytest.mark.parametrize("kind", ["numpy", "dataset", "batched_dataset", "dataset_fn"])
def test_each_parameter_server_worker_reads_its_own_shard_repeated(kind):
    workers, steps = 3, 2 * (ROWS // BATCH // 3)  # two passes over each worker's shard
    adapter = inputs.adapter_for(_kinds()[kind])
    adapter.check_worker_shards(BATCH, workers, 1)
    assert [tuple(s.shape) for s in tf.nest.flatten(adapter.batched_element_spec(workers, 1))] == [(None, 1)] * 2
    shards = []
    for index in range(workers):
        def context(index=index):
            return tf.distribute.InputContext(num_input_pipelines=workers, input_pipeline_id=index,
                                              num_replicas_in_sync=1)

        dataset = adapter.worker_dataset_fn(BATCH, context, seed=7)(tf.distribute.InputContext())
        ids = [x.numpy()[:, 0].astype(int).tolist() for x, _ in dataset.take(steps)]
        assert all(len(batch) == BATCH for batch in ids)
        first, second = ids[: steps // 2], ids[steps // 2:]
        assert sorted(sum(first, [])) == sorted(sum(second, [])), "the shard repeats whole"
        shards.append(set(sum(first, [])))
    assert set().union(*shards) == set(range(ROWS)) and sum(len(s) for s in shards) == ROWS


def test_a_parameter_server_worker_without_a_full_step_is_refused_for_every_kind_that_can_tell():
    x, y = _arrays()
    with pytest.raises(ConfigError, match=r"96 examples: each of the 4 workers reads 24, fewer than one step's "
                                          r"batch of 25"):
        inputs.adapter_for((x, y)).check_worker_shards(25, 4, 1)
    with pytest.raises(ConfigError, match=r"96 examples: each of the 4 workers reads 24"):
        inputs.adapter_for(tf.data.Dataset.from_tensor_slices((x, y))).check_worker_shards(25, 4, 1)
    with pytest.raises(ConfigError, match=r"12 batch\(es\), fewer than the 13 workers"):
        inputs.adapter_for(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)).check_worker_shards(BATCH, 13, 1)
