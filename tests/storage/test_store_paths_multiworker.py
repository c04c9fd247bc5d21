"""A user's paths as store URLs on 2 real workers (MultiWorkerMirroredStrategy on 127.0.0.1), one run shared.

`store_paths_script.py` trains with `ModelCheckpoint`, `CSVLogger`, `TensorBoard` and `BackupAndRestore` on
S3 (one `ModelCheckpoint` on GCS), then saves with `Trainer.save` and Keras's own `model.save` to S3, GCS and
Azure (and `save_weights`, `export`), and resumes a fresh model from the `BackupAndRestore` it left in S3.
Worker 1 holds S3 keys that may only read (moto's IAM): any write of its to S3 would fail the run, so nothing
of the other workers reaches the store. Each worker has its own working and temp directory: none may hold a
directory named after a scheme, or a leftover. A fresh process reads every file back and compares it with the
weights the chief trained.
"""

from __future__ import annotations

import json
import os

import pytest
from procs import describe, free_ports, run_cluster, run_process, worker_tf_configs

pytestmark = [pytest.mark.slow, pytest.mark.multiworker]

SCRIPT = os.path.join(os.path.dirname(__file__), "store_paths_script.py")
SCHEMES = ("s3", "gs", "az")

CHECK = r"""
import json, os, sys
import numpy as np
import keras
import tensorflow as tf
from stratkit import storage

expected = json.loads(sys.argv[1])
urls = json.loads(os.environ["TEST_URLS"])
out = {}

def same(model):
    return all(np.array_equal(a, np.asarray(b, a.dtype)) for a, b in zip(model.get_weights(), expected["trained"]))

for scheme, base in urls.items():
    for kind in ("trainer", "keras"):
        with storage.local_copy(f"{base}/{kind}/model.keras") as path:
            out[f"{kind}-{scheme}"] = same(keras.models.load_model(path))
like = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu"), keras.layers.Dense(2)])
with storage.local_copy(urls["az"] + "/keras/model.weights.h5") as path:
    like.load_weights(path)
out["weights-az"] = same(like)
with storage.local_copy(urls["s3"] + "/export") as path:
    exported = tf.saved_model.load(path)
    served = exported.serve(tf.ones((1, 4)))
out["export-s3"] = bool(np.allclose(served.numpy(), like(np.ones((1, 4), "float32")).numpy(), atol=1e-6))
with storage.local_copy(urls["s3"] + "/logs/log.csv") as path:
    out["csv"] = open(path).read().splitlines()
with storage.local_copy(urls["gs"] + "/best.keras") as path:
    out["best-gs"] = keras.models.load_model(path).count_params()

# gs:// without gcsfs is what plain Keras does with it (tf.io.gfile), not the store layer and not a directory
sys.modules["gcsfs"] = None
from stratkit.strategy import store_paths
out["gs-without-gcsfs"] = store_paths.route("gs://bucket/model.keras", "model.save")
print(json.dumps(out))
"""


def _unique(name: str) -> str:
    return f"{name}-{os.getpid()}-{os.urandom(3).hex()}"


@pytest.fixture(scope="module")
def servers(store_server):
    return {scheme: store_server(scheme) for scheme in SCHEMES}


@pytest.fixture(scope="module")
def run(servers, tmp_path_factory):
    """The 2-worker run: its workers' results, the URLs they used, their directories."""
    root = tmp_path_factory.mktemp("store-paths")
    urls = {scheme: server.url(server.make_bucket(_unique("paths")), "run1") for scheme, server in servers.items()}
    env = {"TEST_URLS": json.dumps(urls)}
    for server in servers.values():
        env.update(server.client_env({}))
    per_worker = []
    for rank in (0, 1):
        work, temp = root / f"work{rank}", root / f"tmp{rank}"
        work.mkdir()
        temp.mkdir()
        per_worker.append({"TEST_WORKDIR": str(work), "TMPDIR": str(temp)})
    per_worker[1].update(servers["s3"].read_only_env())   # worker 1 may read S3, never write
    results = run_cluster(SCRIPT, worker_tf_configs(free_ports(2)), env=env, per_process_env=per_worker,
                          timeout=400, grace_after_failure=30, cwd=root)
    assert all(r.ok for r in results), describe(results)
    return {"reports": [r.last_json() for r in results], "urls": urls, "root": root, "env": env}


def test_saves_to_every_store_read_back_in_a_fresh_process_equal_the_trained_model(run):
    chief, other = run["reports"]
    assert chief["trained"] == other["trained"]
    for scheme in SCHEMES:      # the chief returns the URL it wrote, the other worker None
        assert chief["saved"][f"trainer-{scheme}"] == run["urls"][scheme] + "/trainer/model.keras"
        assert other["saved"][f"trainer-{scheme}"] is None
    checked = run_process(CHECK, env=run["env"], args=[json.dumps({"trained": chief["trained"]})], timeout=300)
    assert checked.ok, describe([checked])
    found = checked.last_json()
    for scheme in SCHEMES:
        assert found[f"trainer-{scheme}"] and found[f"keras-{scheme}"], (scheme, found)
    assert found["weights-az"] and found["export-s3"]
    assert found["gs-without-gcsfs"] == "keras"
    assert chief["ram_saved"] and other["ram_saved"]          # Keras's own gfile save, on every worker
    # The callbacks' files reached the store: a CSV row per epoch, the best model on GCS.
    assert found["csv"][0].startswith("epoch") and len(found["csv"]) == 3
    assert found["best-gs"] > 0


def test_the_callbacks_files_reach_the_store_from_the_chief_only_and_their_paths_are_kept(run, servers):
    chief, other = run["reports"]
    s3 = servers["s3"].fs()
    prefix = run["urls"]["s3"].split("://", 1)[1]
    names = sorted(key[len(prefix) + 1:] for key in s3.find(prefix))
    assert "ckpt/1/m.weights.h5" in names and "ckpt/2/m.weights.h5" in names
    assert "logs/log.csv" in names and any(n.startswith("tb/train/events.out.tfevents") for n in names)
    # BackupAndRestore: the second fit resumed from it (delete_checkpoint=True) and then removed it, as Keras
    # removes a local backup directory.
    assert not [n for n in names if n.startswith("backup/")], names
    # Every callback points where the user asked again after fit, on every worker.
    for report in (chief, other):
        base_s3, base_gs = run["urls"]["s3"], run["urls"]["gs"]
        assert report["paths_after_fit"] == [base_s3 + "/ckpt/{epoch}/m.weights.h5", base_s3 + "/logs/log.csv",
                                             base_s3 + "/tb", base_s3 + "/backup", base_gs + "/best.keras"]


def test_backup_and_restore_resumes_every_worker_from_the_store(run):
    for report in run["reports"]:
        assert report["resumed_epochs"] == [2], report["resumed_epochs"]   # epoch 3 only: it resumed at 2
        assert report["resumed"] == report["continued"]      # what the first model trains in its epoch 3
    assert run["reports"][0]["resumed"] == run["reports"][1]["resumed"]


def test_a_missing_bucket_stops_every_worker_before_it_saves(run):
    for report in run["reports"]:
        assert "no-such-bucket-here" in report["missing_bucket"] and "Fix:" in report["missing_bucket"]


def test_no_directory_is_named_after_a_scheme_and_nothing_is_left_behind(run):
    for rank in (0, 1):
        for top in (run["root"] / f"work{rank}", run["root"] / f"tmp{rank}"):
            left = [str(p.relative_to(top)) for p in top.rglob("*")]
            assert left == [], (top, left)
    assert not [p for p in run["root"].rglob("*") if p.name.endswith(":")]
