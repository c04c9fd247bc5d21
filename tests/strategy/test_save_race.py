"""Every worker calling `model.save`/`model.export` on the same path under MWMS: no race.

Before: 2 workers saving to one path crashed the chief in MergeV2Checkpoints in
3 of 6 runs, once left a SavedModel that did not load; then `export` printed the private
temporary as where it saved. Now every worker writes the path atomically (a private
temporary, then a rename), so the path is always one worker's whole file or directory,
and what Keras prints names that path. Real processes: 2 MWMS workers on 127.0.0.1, one shared directory.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from procs import describe, free_ports, run_cluster, worker_tf_configs

pytestmark = pytest.mark.slow

SAVE_EVERYWHERE = textwrap.dedent("""
    import json, os, stratkit
    strategy = stratkit.make_strategy()  # MWMS from TF_CONFIG
    spec = stratkit.detect()
    import keras, numpy as np, tensorflow as tf

    OUT = os.environ["OUT"]
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x = np.linspace(0, 1, 64 * 4, dtype="float32").reshape(64, 4)
    model.fit(x, x[:, :1], batch_size=16, epochs=1, verbose=0)
    for _ in range(3):
        model.save(os.path.join(OUT, "m.keras"))           # every worker, the same path
    model.save_weights(os.path.join(OUT, "w.weights.h5"))
    model.export(os.path.join(OUT, "exported"))             # a SavedModel directory
    strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)  # every worker is done
    report = {"chief": spec.is_chief, "leftovers": sorted(n for n in os.listdir(tempfile_dir)
                                                          if n.startswith("stratkit-save"))
              if (tempfile_dir := __import__("tempfile").gettempdir()) else []}
    if spec.is_chief:
        expected = np.asarray(model(x[:8]))  # no predict(): it is a collective, and the other worker has left
        loaded = keras.models.load_model(os.path.join(OUT, "m.keras"))
        report["keras_ok"] = bool(np.allclose(np.asarray(loaded(x[:8])), expected, atol=1e-6))
        served = tf.saved_model.load(os.path.join(OUT, "exported"))
        report["export_ok"] = bool(np.allclose(served.serve(tf.constant(x[:8])).numpy(), expected, atol=1e-6))
        model.load_weights(os.path.join(OUT, "w.weights.h5"))
        report["weights_ok"] = True
    print(json.dumps(report))
""")


def test_two_workers_saving_and_exporting_to_one_path_never_race(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    temps = [tmp_path / "tmp0", tmp_path / "tmp1"]
    for t in temps:
        t.mkdir()
    results = run_cluster(SAVE_EVERYWHERE, worker_tf_configs(free_ports(2)), env={"OUT": str(out)},
                          per_process_env=[{"TMPDIR": str(t)} for t in temps], timeout=240, grace_after_failure=20)
    assert all(r.ok for r in results), describe(results)
    chief, other = (r.last_json() for r in results)
    assert chief["chief"] and not other["chief"]
    assert chief["keras_ok"] and chief["export_ok"] and chief["weights_ok"], chief
    assert sorted(os.listdir(out)) == ["exported", "m.keras", "w.weights.h5"]  # no temporaries beside them
    assert other["leftovers"] == [] and not [n for n in os.listdir(temps[1]) if n.startswith("stratkit-save")]
    # What Keras prints names the path the user gave, once it holds the export (before: the chief printed its
    # private temporary, out/.stratkit-tmp-*/exported, as where it saved)
    exported = os.path.join(out, "exported")
    for result in results:
        assert f"Saved artifact at '{exported}'." in result.stdout, result.stdout[-3000:]
        assert ".stratkit-tmp" not in result.stdout, result.stdout[-3000:]
