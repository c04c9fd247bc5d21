"""Smoke test: every benchmark script runs with --quick, exits 0 and writes its JSON with the expected keys.

No performance assertion anywhere: --quick sizes are far too small to mean
anything, and the machine running the tests is shared. (One rate is checked:
a TCP stream inside bench_allreduce's tc-shaped namespace runs at 0.3-1.2x
the rate set on it, which shows the shaping is in force; a CPU this machine's
size moves loopback TCP at several times that rate.) This only proves that
`make bench` will get through each script and produce the fields the plots
and the README read. Budget: about 4 minutes for the whole file on 2 cores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
RESULTS = BENCH / "results"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# name -> (top-level keys, keys of each row (None: no rows list), extra markers)
# Not here: bench_ray.py. Its --quick starts a local Ray twice and a SparkSession once (three engines, cold and
# warm) and took 5 min 45 s on the shared 2 cores (load 13-18), most of it Ray Train importing TensorFlow in its
# controller and workers: over this file's budget. `python benchmarks/bench_ray.py --quick` checks it by hand.
# Nor bench_inference.py: its --quick starts a SparkSession whose Python workers import TensorFlow, and scores
# with three UDFs (~1 min on the shared 2 cores); `python benchmarks/bench_inference.py --quick` checks it.
# Nor bench_lake.py: its --quick starts moto, writes five tables and runs three TensorFlow processes and a 2-worker
# launch (~3 min at load 20 on the shared 2 cores); `python benchmarks/bench_lake.py --quick` checks it, and
# tests/data runs the reader itself.
# Nor bench_spark_lake.py: its --quick starts a 2-executor SparkSession and runs four 2-worker trainings (~2 min on
# the shared 2 cores); `python benchmarks/bench_spark_lake.py --quick` checks it, and tests/spark/test_spark_lake.py
# trains both ways' code paths.
# Marked bench_long (`make test-bench`, not `make test` nor CI): scaling, spark and ps, 1.4-2.8 min each on the
# shared 2 cores (CPU 68-137 s); the rest stay in `make test`.
EXPECTED = {
    "overhead": ({"benchmark", "machine", "quick", "rows", "goal_ratio"},
                 {"strategy", "replicas", "stratkit steps/s", "hand steps/s", "ratio"}, ()),
    "ps": ({"benchmark", "machine", "quick", "runs", "median_examples_per_sec", "ratio_2_vs_1"}, None,
           (pytest.mark.multiworker, pytest.mark.bench_long)),
    "scaling": ({"benchmark", "machine", "quick", "model", "goal_efficiency", "rows", "definition", "rounds",
                 "loadavg_before", "loadavg_after"},
                {"setting", "2-worker ex/s", "pair ex/s", "alone ex/s", "efficiency", "naive", "vs default", "raw"},
                (pytest.mark.multiworker, pytest.mark.bench_long)),
    "allreduce": ({"benchmark", "machine", "quick", "workers", "bus_factor", "tcp_bandwidth_Bps", "rows",
                   "tcp_before", "tcp_after", "peak_busbw_over_tcp", "gradient_rows", "bf16_over_float32"},
                  {"size", "bytes", "time_ms", "algbw_MBps", "busbw_MBps", "tcp_same_size_MBps", "busbw/TCP",
                   "bound_ms", "correct"}, (pytest.mark.multiworker,)),
    "spark": ({"benchmark", "machine", "quick", "job", "master", "rows", "raw"},
              {"way", "master", "session s", "cold wall s", "warm wall s", "to first step s", "training s",
               "status"}, (pytest.mark.spark, pytest.mark.multiworker, pytest.mark.bench_long)),
    "input": ({"benchmark", "machine", "quick", "goal_ratio", "rows"},
              {"model", "reader", "reader rows/s", "model ex/s", "ratio", "goal met"}, ()),
    "backups": ({"benchmark", "machine", "quick", "rows", "two_workers", "rounds", "backup_every"},
                {"model", "variant", "step ms", "step min ms", "step max ms", "vs none", "writes", "write ms",
                 "load before", "load after"}, (pytest.mark.multiworker,)),
    "elastic": ({"benchmark", "machine", "quick", "rows", "flags", "loadavg_before", "loadavg_after"},
                {"event", "median s", "min s", "max s", "runs", "raw"}, (pytest.mark.hosts, pytest.mark.multiworker)),
}


def run_quick(name: str) -> dict:
    script = BENCH / f"bench_{name}.py"
    if not script.exists():
        pytest.skip(f"{script.name} does not exist (yet)")
    started = time.time()
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    env.pop("TF_CONFIG", None)
    out = subprocess.run([sys.executable, str(script), "--quick"], check=False, capture_output=True, text=True,
                         env=env, timeout=540)
    assert out.returncode == 0, f"{script.name} --quick exited {out.returncode}:\n{out.stdout[-3000:]}\n" \
                                f"{out.stderr[-5000:]}"
    path = RESULTS / f"{name}-quick.json"
    assert path.exists(), f"{script.name} --quick wrote no {path.name}"
    assert path.stat().st_mtime >= started - 1, f"{path.name} was not rewritten by this run"
    assert not (RESULTS / f"{name}.json").exists() or (RESULTS / f"{name}.json").stat().st_mtime < started, \
        f"--quick overwrote the full result {name}.json"
    return json.loads(path.read_text())


@pytest.mark.parametrize("name", [pytest.param(n, marks=list(EXPECTED[n][2]), id=n) for n in EXPECTED])
def test_quick_run_writes_expected_json(name):
    data = run_quick(name)
    top, row_keys, _ = EXPECTED[name]
    assert top <= set(data), f"missing keys: {sorted(top - set(data))}"
    assert data["quick"] is True
    assert data["benchmark"] == f"{name}-quick"
    assert {"cores", "tensorflow", "keras"} <= set(data["machine"])
    if row_keys is not None:
        assert data["rows"], "no rows"
        for row in data["rows"]:
            assert row_keys <= set(row), f"row missing keys: {sorted(row_keys - set(row))}"
    if name == "scaling":
        assert data["rows"][0]["efficiency"] is not None  # the headline configuration ran
    if name == "allreduce":
        assert all(row["correct"] for row in data["rows"])  # the collective summed correctly
        # The gradient list in each wire dtype; the 16-bit sums are within their rounding of float32's.
        assert [r["dtype"] for r in data["gradient_rows"]] == ["float32", "bfloat16", "float16"]
        assert [r["max rel error"] <= tol for r, tol in zip(data["gradient_rows"], (1e-6, 1e-2, 1e-3))] == [True] * 3
        # Both lists (the scaling model's, the dense MLP's), each in every wire dtype, on loopback and
        # on the 1 GbE shaped link -- or that link's record says why this machine cannot shape one.
        sets = {(r["list"], r["link"], r["dtype"]) for r in data["gradient_sets"]}
        links = ["loopback"] + [record["link"] for record in data["links"] if "skipped" not in record]
        assert sets == {(name, on, d) for name in ("scaling model", "dense MLP") for on in links
                        for d in ("float32", "bfloat16", "float16")}
        for record in data["links"]:
            assert "skipped" in record or 0.3 < record["tcp_one_way_MBps"] / (2 * record["node_mbit"] / 8) < 1.2, \
                f"the shaped link does not run at its rate: {record}"
    if name == "scaling":
        assert any("gradient_compression" in row["setting"] for row in data["rows"])
        # The row on the shaped 1 GbE link ran, or the JSON says why this machine cannot shape one.
        assert data["links_skipped"] or any(row["link"] == "1 GbE" and row["efficiency"] for row in data["rows"])
    if name == "overhead":
        assert not data["rows"][-1]["raw"]["compression_wrapper_installed"]  # one device: nothing to compress
    if name == "spark":
        assert data["rows"][0]["status"] == "ok"  # stratkit launch, no Spark
        for row in data["rows"][1:]:  # a runner is either measured or says why not
            assert row["status"] == "ok" or row["status"].startswith(("not available", "failed", "some runs"))


def test_plot_makes_a_png_per_quick_json(tmp_path):
    sources = [p for p in RESULTS.glob("*-quick.json") if p.stem.removesuffix("-quick") in EXPECTED]
    if not sources:
        pytest.skip("no -quick results to plot (run the benchmark smoke tests first)")
    for source in sources:
        shutil.copy(source, tmp_path / source.name)
    out = subprocess.run([sys.executable, str(BENCH / "plot.py"), "--quick", "--results", str(tmp_path)],
                         check=False, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    for source in sources:
        png = tmp_path / f"{source.stem}.png"
        assert png.exists() and png.stat().st_size > 10_000, f"no plot for {source.name}:\n{out.stdout}{out.stderr}"


def test_plot_skips_missing_results(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH / "plot.py"), "--results", str(tmp_path)], check=False,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "skip scaling" in out.stdout
    assert not list(tmp_path.glob("*.png"))
