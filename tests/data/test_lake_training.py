"""Issue 50's acceptance, at test size: a Parquet table of 64 files of unequal sizes (row groups of several sizes)
on moto's S3, trained through `Trainer.fit(TableInput(...))`.

* 2 workers under `stratkit launch` equal one process (weights and history within 1e-5), and every row id is
  trained once per epoch (ids recorded inside the replica step, counted over the workers);
* a SIGKILL mid-epoch on 2 workers (backups on S3) resumes at a step backup on 3 workers under `LocalRunner`,
  from a fresh staging directory (a fresh host reads only the store), and equals the uninterrupted run;
* TFRecord shards of the same rows on the GCS emulator: 2 workers under `LocalRunner` equal one process.

The full-size run (1,000,000 rows; the same world size resumed too) is `benchmarks/lake_acceptance.py`'s job.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from procs import child_env, describe, run_process

pytestmark = [pytest.mark.slow, pytest.mark.multiworker]

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "lake_train.py"
FILES, ROWS, BATCH = 64, 6000, 128      # 47 steps per epoch, the last one 112 rows
BUCKET = "lake-tests"


@pytest.fixture(scope="module")
def lake(store_server):
    """(table URL, the environment a training process needs) for the table on moto's S3."""
    import stores

    sys.path.insert(0, str(HERE))
    import lake_tables

    from stratkit.storage.arrow import arrow_filesystem

    s3 = store_server("s3")
    s3.make_bucket(BUCKET)
    url = f"s3://{BUCKET}/t64"
    with stores.client_settings(s3):
        fs, base = arrow_filesystem(url)
        assert lake_tables.write_parquet(fs, base, FILES, ROWS) == ROWS
    env = {**s3.env, "LAKE_BATCH": str(BATCH), "LAKE_EVERY": "10"}
    yield url, env


def _result(stdout: str, prefix: str = "") -> list[dict]:
    return [json.loads(line.split("RESULT ", 1)[1]) for line in stdout.splitlines()
            if line.startswith(prefix) and "RESULT " in line]


@pytest.fixture(scope="module")
def reference(lake):
    url, env = lake
    one = run_process(str(SCRIPT), args=[url], env=env, timeout=300)
    assert one.ok, describe([one])
    (result,) = _result(one.stdout)
    for epoch in ("0", "1"):                   # one process: every row once per epoch
        assert sorted(result["ids"][epoch]) == list(range(ROWS))
    return result


def _same(a: dict, b: dict) -> None:
    gap = max(float(np.max(np.abs(np.subtract(x, y)))) for x, y in zip(a["w"], b["w"]))
    assert gap <= 1e-5, gap
    for key in a["h"]:
        np.testing.assert_allclose(a["h"][key], b["h"][key], atol=1e-5, err_msg=key)
    assert a["e"].keys() == b["e"].keys() == {"loss", "mae"}, (a["e"], b["e"])   # evaluate: one pass, every worker
    for key in a["e"]:
        np.testing.assert_allclose(a["e"][key], b["e"][key], atol=1e-5, err_msg=f"evaluate {key}")


def _launch(workers: int, argv: list[str], env: dict, restarts: int = 0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stratkit.cli", "launch", "--workers", str(workers),
                           "--max-restarts", str(restarts), "--no-private-network", "--", sys.executable, str(SCRIPT),
                           *argv], env=child_env(env=env), capture_output=True, text=True, timeout=420)


@contextlib.contextmanager
def _by_value(cloudpickle, module):
    """`module` pickled by value meanwhile, a registration made before kept: tests/spark/test_spark_lake.py
    registers lake_train when it is imported, and a test here that unregistered it after its run left that
    module's Spark tasks unable to import lake_train (when both ran in one process, this one first)."""
    before = module.__name__ in cloudpickle.list_registry_pickle_by_value()
    cloudpickle.register_pickle_by_value(module)
    try:
        yield
    finally:
        if not before:
            cloudpickle.unregister_pickle_by_value(module)


def test_two_workers_under_launch_equal_one_process_and_train_every_row_once_per_epoch(lake, reference):
    url, env = lake
    done = _launch(2, [url], env)
    assert done.returncode == 0, done.stderr[-4000:]
    results = {r["rank"]: r for r in _result(done.stdout)}
    assert set(results) == {0, 1}
    for result in results.values():
        _same(reference, result)
    for w0, w1 in zip(results[0]["w"], results[1]["w"]):      # one model, not two close ones: bit for bit
        assert np.array_equal(w0, w1), float(np.max(np.abs(np.subtract(w0, w1))))
    for epoch in ("0", "1"):
        ids = results[0]["ids"][epoch] + results[1]["ids"][epoch]
        assert len(ids) == ROWS and sorted(ids) == list(range(ROWS)), epoch   # each row once, none padded
        assert min(len(results[0]["ids"][epoch]), len(results[1]["ids"][epoch])) > ROWS // 3  # both read


def test_what_the_plan_and_the_lanes_warn_of_is_said_once_by_the_chief_and_every_row_is_still_read_once(
        lake, store_server):
    """3 lanes over 2 workers: one worker reads 2 lanes, the other 1; and the table's directory holds a file without
    `.parquet`, left out. Every worker plans the table, the chief says each once; the epoch is every row once."""
    import stores

    from stratkit.storage.arrow import arrow_filesystem

    url, env = lake
    stray = f"s3://{BUCKET}/t64-stray"
    with stores.client_settings(store_server("s3")):
        fs, base = arrow_filesystem(url)
        _, copy = arrow_filesystem(stray)
        import pyarrow.fs as pafs

        for info in fs.get_file_info(pafs.FileSelector(base, recursive=True)):
            fs.copy_file(info.path, copy + info.path[len(base):])
        with fs.open_output_stream(f"{copy}/NOTES") as out:
            out.write(b"not a table file")
    done = _launch(2, [stray], {**env, "LAKE_LANES": "3", "LAKE_EPOCHS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    said = done.stdout + done.stderr
    assert said.count("3 lanes over 2 workers: some read 2 lanes, others 1") == 1, done.stderr[-4000:]
    assert said.count("1 file(s) without .parquet were not read, e.g. 'NOTES'") == 1, done.stderr[-4000:]
    results = {r["rank"]: r for r in _result(done.stdout)}
    ids = results[0]["ids"]["0"] + results[1]["ids"]["0"]
    assert len(ids) == ROWS and sorted(ids) == list(range(ROWS))


def test_four_replicas_under_mirrored_equal_one_device_and_train_every_row_once_per_epoch(lake, reference):
    """One process, 4 logical CPUs: each step's rows split over 4 replicas (47 steps, the last of 112 rows: 28 a
    replica; with 6000 rows and 128 a batch, each replica's part of a step is 32 or 28 rows)."""
    url, env = lake
    done = run_process(str(SCRIPT), args=[url], env={**env, "LAKE_REPLICAS": "4"}, timeout=300)
    assert done.ok, describe([done])
    (result,) = _result(done.stdout)
    _same(reference, result)
    for epoch in ("0", "1"):
        assert sorted(result["ids"][epoch]) == list(range(ROWS)), epoch


def test_a_sigkill_mid_epoch_on_two_workers_resumes_at_the_step_on_three_under_local_runner(lake, reference, tmp_path,
                                                                                            monkeypatch):
    """2 workers under launch: worker 1 SIGKILLed before global step 70 (epoch 2, step 23), no restart. Then 3
    workers under LocalRunner, with a fresh staging directory (a fresh host: only the store), resume at the
    newest committed step backup on S3 and finish the run as the uninterrupted one. (The same world size resumes through
    the same cursor: tests/data/test_lake_order.py checks every world size against reading from the start.)"""
    import cloudpickle
    import lake_train
    import stores

    from stratkit import LocalRunner

    url, env = lake
    backup = f"s3://{BUCKET}/runs/{uuid.uuid4().hex}"
    killed = _launch(2, [url, backup], {**env, "LAKE_KILL_AT": "70:1:0",
                                        "STRATKIT_BACKUP_STAGING": str(tmp_path / "staging-2")})
    assert killed.returncode != 0 and "worker 1 killed before step 70" in killed.stdout, killed.stderr[-3000:]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("STRATKIT_BACKUP_STAGING", str(tmp_path / "staging-3"))   # a fresh host: only the store
    stores.refresh_clients()
    with _by_value(cloudpickle, lake_train):
        resumed = LocalRunner(num_workers=3, private_network=False, timeout=420).run(lake_train.train, url, backup)
    steps = -(-ROWS // BATCH)
    start = resumed["first_step"]
    # a committed step backup (every 10 steps) within an epoch: the newest one, which under load may be some
    # backups behind the kill, since uploads run beside training (seen: step 30 at load 6, step 60 quiet)
    assert 0 < start <= 70 and start % 10 == 0 and start % steps != 0, start
    epoch = start // steps
    # worker 0 read only its share of the batches after the backup: nothing before it was read and dropped
    assert len(resumed["ids"][str(epoch)]) <= ((epoch + 1) * steps - start) * (BATCH // 3 + 2)
    _same(reference, resumed)


@pytest.fixture(scope="module")
def gcs_shards(store_server):
    """(URL of TFRecord shards of the same shape on the GCS emulator, the environment a process needs)."""
    import lake_tables
    import stores

    from stratkit.storage.arrow import arrow_filesystem

    gcs = store_server("gs")
    gcs.make_bucket(BUCKET)
    url = f"gs://{BUCKET}/shards"
    with stores.client_settings(gcs):
        fs, base = arrow_filesystem(url)
        assert lake_tables.write_tfrecord(fs, base, 16, ROWS // 2) == ROWS // 2
    return url, {**gcs.env, "LAKE_KIND": "tfrecord", "LAKE_BATCH": str(BATCH)}


def test_tfrecord_shards_on_gcs_train_on_two_workers_as_on_one_process(gcs_shards, monkeypatch):
    import cloudpickle
    import lake_train
    import stores

    from stratkit import LocalRunner

    url, env = gcs_shards
    one = run_process(str(SCRIPT), args=[url], env=env, timeout=300)
    assert one.ok, describe([one])
    (reference,) = _result(one.stdout)
    assert sorted(reference["ids"]["0"]) == list(range(ROWS // 2))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    stores.refresh_clients()
    with _by_value(cloudpickle, lake_train):
        two = LocalRunner(num_workers=2, private_network=False, timeout=420).run(lake_train.train, url)
    _same(reference, two)
