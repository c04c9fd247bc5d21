"""Issue 50 on Ray: `RayRunner` trains from a Parquet table on a store (moto's S3 on loopback, a real local Ray)
through `Trainer.fit(TableInput(...))`, each worker reading its own lanes from the store, equal to one process.

The table and the train_fn are tests/data's (`lake_tables`, `lake_train`): 64 files of unequal sizes, the ids
recorded inside the replica step. The store's settings and the script's are in the environment before
`ray.init`, so Ray's processes inherit them, as a cluster's nodes would have them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import stores
from procs import describe, run_process
from ray_helpers import local_ray, needs_ray

pytestmark = [pytest.mark.slow, pytest.mark.ray, needs_ray]

DATA = Path(__file__).resolve().parents[1] / "data"
FILES, ROWS, BATCH = 64, 3000, 128
BUCKET = "lake-ray"


@pytest.fixture(scope="module")
def lake_ray(store_server):
    """(table URL, the one-process reference result, ray) with the table on moto's S3 and Ray started after."""
    import cloudpickle

    sys.path.insert(0, str(DATA))
    import lake_tables
    import lake_train

    from stratkit.storage.arrow import arrow_filesystem

    server = store_server("s3")
    server.make_bucket(BUCKET)
    url = f"s3://{BUCKET}/t64"
    script = {"LAKE_BATCH": str(BATCH)}
    with stores.client_settings(server):
        fs, base = arrow_filesystem(url)
        assert lake_tables.write_parquet(fs, base, FILES, ROWS) == ROWS
        one = run_process(str(DATA / "lake_train.py"), args=[url], env={**server.env, **script}, timeout=300)
        assert one.ok, describe([one])
        reference = json.loads(next(line.split("RESULT ", 1)[1] for line in one.stdout.splitlines()
                                    if "RESULT " in line))
        saved = {name: os.environ.get(name) for name in script}
        os.environ.update(script)
        try:
            with local_ray() as ray:
                import ray.cloudpickle

                for pickler in (cloudpickle, ray.cloudpickle):     # train_fn travels to Ray's workers by value
                    pickler.register_pickle_by_value(lake_train)
                yield url, reference, lake_train
                for pickler in (cloudpickle, ray.cloudpickle):
                    pickler.unregister_pickle_by_value(lake_train)
        finally:
            for name, value in saved.items():
                os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)


def test_two_ray_workers_read_a_table_on_s3_and_train_as_one_process(lake_ray):
    from stratkit.ray.runner import RayRunner

    url, reference, lake_train = lake_ray
    for epoch in ("0", "1"):                       # one process: every row once per epoch
        assert sorted(reference["ids"][epoch]) == list(range(ROWS))
    chief = RayRunner(num_workers=2, timeout=420).run(lake_train.train, url)
    gap = max(float(np.max(np.abs(np.subtract(a, b)))) for a, b in zip(reference["w"], chief["w"]))
    assert gap <= 1e-5, gap
    for key in reference["h"]:
        np.testing.assert_allclose(reference["h"][key], chief["h"][key], atol=1e-5, err_msg=key)
    for epoch in ("0", "1"):                       # the chief read its share only: each row at most once
        ids = chief["ids"][epoch]
        assert len(ids) == len(set(ids)) and ROWS // 3 < len(ids) < ROWS, (epoch, len(ids))
