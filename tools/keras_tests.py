"""Keras's own tests, plain and with stratkit's patches: none that passes plain may fail patched.

    python tools/keras_tests.py [--jobs 2] [--group NAME ...] [--out out/keras-tests]
    python tools/keras_tests.py --select keras/src/losses/loss_test.py ...    # other tests, as one group

`make test-keras` runs it (and CI, after `make test`). The installed Keras wheel ships its own tests
(``keras/src/**/*_test.py``); :data:`GROUPS` picks those that exercise what stratkit patches
(``stratkit/strategy/keras_compat/``: the TensorFlow trainer, losses, optimizers, BatchNorm,
``SeedGenerator``, ``add_loss``, variables, saving, the tf.distribute paths). Each group runs as one
pytest process per pass, twice, in the same order:

* **plain**: Keras as installed;
* **patched**: the same, with ``stratkit.strategy.keras_compat.apply()`` installed at configure time,
  before any test module is imported, by ``tools/keras_tests_plugin.py`` (which refuses to run if the
  patches are not really in place).

A test that passed plain and did not pass patched (failed, errored, skipped, crashed the process or
never ran) is a **regression**: each one is named with the first lines of its failure, and the exit
status is 1. Tests that fail plain are listed, not counted. A group's files share one process (a
process costs ~9 s of TensorFlow import); the tf.distribute files, which reset TensorFlow's context and
set logical devices, run in their own. The processes run under the test suite's network guard
(``tests/netguard``): a test that tries to reach anything but loopback fails the run.

Output: a table per file, the regressions, and ``<out>/result.json`` (every test's outcome in both
passes, per-file counts and seconds); each process's own output is in ``<out>/<pass>-<group>.log``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from stratkit.process.children import kill_group, start_child  # noqa: E402 - TF-free
from stratkit.strategy import keras_compat  # noqa: E402 - TF-free

TOOLS = Path(__file__).resolve().parent
NETGUARD = REPO / "tests" / "netguard"
NETGUARD_LOG_VARIABLE = "TESTS_NETGUARD_LOG"          # tests/netguard/sitecustomize.py LOG_VARIABLE
PLUGIN = "keras_tests_plugin"                           # tools/keras_tests_plugin.py
DEFAULT_OUT = REPO / "out" / "keras-tests"
PASSES = ("plain", "patched")

#: Which of Keras's tests run, as pytest arguments relative to the directory holding ``keras/``: a file, a
#: directory, or node ids to take part of a file. A group is one pytest process per pass, its files in order.
#: Chosen for what stratkit patches (the comment says which patch a file reaches) and for time: both passes
#: of all groups take ~8 min of CPU. Left out, and why: docs/keras3.md#the-keras-test-suite-with-the-patches.
GROUPS: dict[str, tuple[str, ...]] = {
    # tf.distribute itself; these reset TensorFlow's context and make 2 logical CPUs: their own process
    "tf_distribute": (
        "keras/src/backend/tensorflow/distribute_test.py",              # Mirrored fit, strategy.run, seeds
        "keras/src/backend/tensorflow/optimizer_distribute_test.py",    # apply, clipping, EMA, accumulation
        "keras/src/callbacks/swap_ema_weights_test.py",                 # EMA swap in a Mirrored fit
        # BatchNorm's moments (batchnorm.py), also synchronized under Mirrored; the rest of nn_test is ops
        "keras/src/ops/nn_test.py::NNOpsDynamicShapeTest::test_moments",
        "keras/src/ops/nn_test.py::NNOpsStaticShapeTest::test_moments",
        "keras/src/ops/nn_test.py::NNOpsCorrectnessTest::test_moments",
        "keras/src/ops/nn_test.py::NNOpsCorrectnessTest::test_moments_sync",
        "keras/src/ops/nn_test.py::NNOpsCorrectnessTest::test_moments_sync_with_distribution_strategy0",
        "keras/src/ops/nn_test.py::NNOpsCorrectnessTest::test_moments_sync_with_distribution_strategy1",
    ),
    # what global_gradient.py, layer_losses.py, batchnorm.py, replica_seeds.py, metric_guard.py and
    # variable_scalars.py replace or wrap, on one device (the replacements must then be Keras's own behaviour)
    "core": (
        "keras/src/losses/loss_test.py",                                # reduce_weighted_values, scaling
        "keras/src/losses/losses_test.py",
        "keras/src/optimizers",                                         # apply, update step, loss scaling
        "keras/src/trainers/compile_utils_test.py",                     # CompileLoss.call
        "keras/src/layers/layer_test.py",                               # add_loss, the layer's losses
        "keras/src/layers/normalization/batch_normalization_test.py",   # _moments
        "keras/src/layers/regularization/dropout_test.py",              # SeedGenerator.next
        "keras/src/random",
        "keras/src/metrics/metric_test.py",                             # Metric.add_variable
        "keras/src/metrics/reduction_metrics_test.py",                  # Mean/Sum: the loss trackers
        "keras/src/metrics/accuracy_metrics_test.py",
        "keras/src/models/functional_test.py",                          # building, add_loss in a model
        "keras/src/models/sequential_test.py",
        "keras/src/layers/core/wrapper_test.py",
        "keras/src/layers/core/dense_test.py",                          # float8's _float8_call (float8.py)
        "keras/src/layers/core/einsum_dense_test.py",
        # Variable assignment and float(); VariableOpsDTypeTest is left out: it needs jax
        "keras/src/backend/common/variables_test.py::VariableInitializationTest",
        "keras/src/backend/common/variables_test.py::VariablePropertiesTest",
        "keras/src/backend/common/variables_test.py::VariableNumpyValueAndAssignmentTest",
        "keras/src/backend/common/variables_test.py::VariableDtypeShapeNdimRepr",
        "keras/src/backend/common/variables_test.py::VariableOpsCorrectnessTest",
        "keras/src/backend/common/variables_test.py::VariableOpsBehaviorTest",
    ),
    # the guards on fit/evaluate/predict/*_on_batch (fit_guards.py, on_batch.py), save_guards.py, callbacks
    "models_saving": (
        "keras/src/models/model_test.py",
        "keras/src/saving/saving_api_test.py",                          # Model.save / save_weights
        "keras/src/backend/tensorflow/saved_model_test.py",             # tf.saved_model.save of Keras models
        "keras/src/export/saved_model_test.py",                         # Model.export
        "keras/src/callbacks/backup_and_restore_test.py",
        "keras/src/callbacks/callback_test.py",
        "keras/src/callbacks/csv_logger_test.py",
        "keras/src/callbacks/early_stopping_test.py",
        "keras/src/callbacks/lambda_callback_test.py",
        "keras/src/callbacks/learning_rate_scheduler_test.py",          # float(learning_rate)
        "keras/src/callbacks/model_checkpoint_test.py",
        "keras/src/callbacks/monitor_callback_test.py",
        "keras/src/callbacks/reduce_lr_on_plateau_test.py",
        "keras/src/callbacks/tensorboard_test.py",
        "keras/src/callbacks/terminate_on_nan_test.py",
    ),
}

#: Outcomes that count as "passed" in either pass.
PASSED = "passed"


# ----------------------------------------------------------------------------------------------
# Reading one process's record (tools/keras_tests_plugin.py writes it)
# ----------------------------------------------------------------------------------------------


def describe_exit(returncode: int | None) -> str:
    """How a pytest process ended, in words."""
    if returncode is None:
        return "the pytest process was killed after the group timeout (--group-timeout)"
    if returncode < 0:
        return f"the pytest process was killed by {signal.Signals(-returncode).name}"
    return f"the pytest process ended (exit status {returncode})"


def read_record(path: Path, returncode: int | None, output_tail: str = "") -> dict[str, Any]:
    """Outcomes of one pytest process from its JSON-lines record.

    Returns ``{"tests": {nodeid: {"outcome", "seconds", "message"}}, "collect_errors": {...},
    "start": {...}, "end": {...} or None}``. A test that started and never finished is ``crashed`` (the
    process died in it: ``returncode`` and the output's tail say how); one collected and never started is
    ``not run``.
    """
    tests: dict[str, dict[str, Any]] = {}
    collected: list[str] = []
    begun: list[str] = []
    collect_errors: dict[str, str] = {}
    start: dict[str, Any] = {}
    end: dict[str, Any] | None = None
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue                                   # a line cut short by a killed process
        event = record.get("event")
        if event == "start":
            start = record
        elif event == "collected":
            collected = record["nodeids"]
        elif event == "collect_error":
            collect_errors[record["nodeid"]] = record["message"]
        elif event == "begin":
            begun.append(record["nodeid"])
        elif event == "test":
            tests[record["nodeid"]] = {"outcome": record["outcome"], "seconds": record["seconds"],
                                       "cpu_seconds": record.get("cpu_seconds", 0.0), "message": record["message"]}
        elif event == "end":
            end = record
    ended = describe_exit(returncode)
    died = f"{ended} during this test" + (f"; its output ends:\n{output_tail}" if output_tail else "")
    for nodeid in begun:
        if nodeid not in tests:
            tests[nodeid] = {"outcome": "crashed", "seconds": 0.0, "message": died}
    for nodeid in collected:
        if nodeid not in tests:
            tests[nodeid] = {"outcome": "not run", "seconds": 0.0, "message": f"{ended} before this test"}
    return {"tests": tests, "collect_errors": collect_errors, "start": start, "end": end}


# ----------------------------------------------------------------------------------------------
# Comparing the passes
# ----------------------------------------------------------------------------------------------


def compare(plain: dict[str, dict[str, Any]], patched: dict[str, dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per-test outcomes of both passes -> regressions, tests failing plain, tests only the patches pass.

    A regression is a test that passed plain and did not pass patched, whatever the patched outcome
    (failed, error, skipped, crashed, not run, or missing from the patched pass altogether).
    """
    regressions, failing_plain, fixed = [], [], []
    for nodeid in sorted(set(plain) | set(patched)):
        before = plain.get(nodeid, {"outcome": "missing", "message": "not in the plain pass"})
        after = patched.get(nodeid, {"outcome": "missing", "message": "not in the patched pass"})
        row = {"nodeid": nodeid, "plain": before["outcome"], "patched": after["outcome"]}
        if before["outcome"] == PASSED and after["outcome"] != PASSED:
            regressions.append({**row, "message": after.get("message", "")})
        elif before["outcome"] in ("failed", "error", "crashed", "not run"):
            failing_plain.append({**row, "message": before.get("message", "")})
            if after["outcome"] == PASSED:
                fixed.append(row)
    return {"regressions": regressions, "failing_plain": failing_plain, "passing_only_patched": fixed}


def per_file(plain: dict[str, dict[str, Any]], patched: dict[str, dict[str, Any]],
             regressions: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Counts, wall and CPU seconds of each test file in both passes (its tests' own, not the process start)."""
    files: dict[str, dict[str, Any]] = defaultdict(lambda: {
        "tests": 0, "passed_plain": 0, "passed_patched": 0, "failing_plain": 0, "skipped_plain": 0,
        "regressions": 0, **{f"{kind}_{name}": 0.0 for kind in ("seconds", "cpu_seconds") for name in PASSES}})
    for name, outcomes in (("plain", plain), ("patched", patched)):
        for nodeid, test in outcomes.items():
            row = files[nodeid.split("::", 1)[0]]
            row["passed_" + name] += test["outcome"] == PASSED
            row["seconds_" + name] += test.get("seconds", 0.0)
            row["cpu_seconds_" + name] += test.get("cpu_seconds", 0.0)
    for nodeid, test in plain.items():
        row = files[nodeid.split("::", 1)[0]]
        row["tests"] += 1
        row["failing_plain"] += test["outcome"] in ("failed", "error", "crashed", "not run")
        row["skipped_plain"] += test["outcome"] in ("skipped", "xfailed")
    for regression in regressions:
        files[regression["nodeid"].split("::", 1)[0]]["regressions"] += 1
    for row in files.values():
        for key, value in row.items():
            if isinstance(value, float):
                row[key] = round(value, 1)
    return dict(sorted(files.items()))


# ----------------------------------------------------------------------------------------------
# Running one group in one pass
# ----------------------------------------------------------------------------------------------


def keras_root() -> Path:
    """The directory holding the installed ``keras`` package (its tests' paths are relative to it)."""
    spec = importlib.util.find_spec("keras")                # finds it without importing it (no TensorFlow)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("keras_tests: Keras is not installed in this interpreter. Fix: make install")
    return Path(next(iter(spec.submodule_search_locations))).parent


def child_env(guard_log: Path) -> dict[str, str]:
    """The pytest processes' environment: the TensorFlow backend, stratkit and the plugin importable, guarded."""
    env = dict(os.environ)
    for name in ("TF_CONFIG", keras_compat.ENV_VAR, "TF_USE_LEGACY_KERAS", "PYTEST_ADDOPTS", "PYTEST_PLUGINS"):
        env.pop(name, None)                             # each would change what either pass tests
    env["KERAS_BACKEND"] = "tensorflow"
    given = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(NETGUARD), str(TOOLS), str(REPO), *given])
    env[NETGUARD_LOG_VARIABLE] = str(guard_log)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["CUDA_VISIBLE_DEVICES"] = ""                    # both passes on the same CPU devices
    env["PYTHONUNBUFFERED"] = "1"
    return env


#: TensorFlow's start-up lines (absl's "I0000 00:00:..." and its preamble): never why a process died.
_STARTUP_NOISE = re.compile(
    r"^([IW]\d{4} \d\d:\d\d:|WARNING: All log messages before absl|\$ |To enable the following)")


def _tail(path: Path, lines: int = 8) -> str:
    """The last lines of a process's output, without the command line and TensorFlow's start-up noise."""
    text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
    kept = [line for line in text.strip().splitlines() if not _STARTUP_NOISE.match(line)]
    return "\n".join(kept[-lines:])


def run_group(name: str, args: tuple[str, ...], which: str, root: Path, out: Path, *, test_timeout: float,
              group_timeout: float) -> dict[str, Any]:
    """One pytest process: the group's tests in pass ``which`` ("plain" or "patched"); its read record."""
    record, log = out / f"{which}-{name}.jsonl", out / f"{which}-{name}.log"
    record.unlink(missing_ok=True)
    ini = out / "pytest.ini"                            # run() writes it: not the repository's pyproject
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-p", PLUGIN, "-c", str(ini),
           "--rootdir", str(root), f"--timeout={test_timeout:.0f}", "--keras-tests-record", str(record),
           *(["--stratkit-patches"] if which == "patched" else []), *(str(root / arg) for arg in args)]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="keras-tests-") as cwd, log.open("w", encoding="utf-8") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        # a scratch working directory: Keras's tests may write there, and the test files must not be
        # importable from it under the standard library's names (keras/src/random shadows `random`)
        proc = start_child(cmd, child_env(out / "netguard.log"), stdout=fh, stderr=subprocess.STDOUT, cwd=cwd)
        try:
            returncode: int | None = proc.wait(timeout=group_timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            proc.wait()
            returncode = None
            with log.open("a", encoding="utf-8") as tail:
                tail.write(f"\n[keras_tests] killed after {group_timeout:.0f} s\n")
    result = read_record(record, returncode, _tail(log))
    result.update(returncode=returncode, seconds=round(time.monotonic() - started, 1), log=str(log))
    return result


def _say_pass(name: str, which: str, result: dict[str, Any]) -> None:
    tests = result["tests"].values()
    counts = defaultdict(int)
    for test in tests:
        counts[test["outcome"]] += 1
    detail = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
    print(f"[keras-tests] {which:7s} {name}: {len(result['tests'])} tests ({detail or 'none'}) "
          f"in {result['seconds']:.0f} s", flush=True)


# ----------------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------------


def harness_errors(groups: dict[str, tuple[str, ...]], runs: dict[str, dict[str, dict[str, Any]]],
                   guard_log: Path) -> list[str]:
    """What makes the comparison itself void: the list out of date, the patches absent, the network touched."""
    errors = []
    for name, passes in runs.items():
        plain, patched = passes["plain"], passes["patched"]
        if not plain["tests"]:
            errors.append(f"group {name}: the plain pass ran no test ({plain['log']}); is {groups[name]} still in "
                          f"this Keras? Fix: update GROUPS in tools/keras_tests.py")
        for nodeid, message in plain["collect_errors"].items():
            first = message.splitlines()[0] if message else ""
            errors.append(f"group {name}: {nodeid} does not collect plain: {first}")
        if not (patched["start"].get("patches") or {}).get("status") == "patched":
            errors.append(f"group {name}: the patched pass did not start with stratkit's patches in place "
                          f"(see {patched['log']}):\n{_tail(Path(patched['log']), 5)}")
        at_end = (patched["end"] or {}).get("patches_at_end")
        if at_end is not None and not all(at_end.values()):
            errors.append(f"group {name}: stratkit's patches were no longer installed at the end: {at_end}")
    if guard_log.exists() and guard_log.read_text().strip():
        errors.append(f"a test tried to reach outside loopback (refused by tests/netguard):\n"
                      f"{_tail(guard_log, 10)}\nFix: drop that test from GROUPS")
    return errors


def render_table(files: dict[str, dict[str, Any]]) -> str:
    """The summary: one row per test file, and the totals."""
    counts = ("tests", "passed_plain", "passed_patched", "failing_plain", "regressions")
    times = ("seconds_plain", "seconds_patched", "cpu_seconds_plain", "cpu_seconds_patched")
    head = ("file", "tests", "passed plain", "passed patched", "failing plain", "regressions",
            "s plain", "s patched", "cpu s plain", "cpu s patched")
    rows = [(path, *(str(r[k]) for k in counts), *(f"{r[k]:.0f}" for k in times)) for path, r in files.items()]
    total = ["total", *(str(sum(r[k] for r in files.values())) for k in counts),
             *(f"{sum(r[k] for r in files.values()):.0f}" for k in times)]
    widths = [max(len(row[i]) for row in [head, total, *rows]) for i in range(len(head))]

    def line(cells: tuple[str, ...] | list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, rows), line(total)])


def _indented(text: str, lines: int = 6) -> str:
    return "\n".join("      " + line for line in text.strip().splitlines()[:lines])


def report(result: dict[str, Any]) -> str:
    """The text `main` prints: the table, the failures plain (not counted), the regressions, the verdict."""
    parts = ["", render_table(result["files"]), ""]
    def seconds(run: dict[str, Any]) -> str:
        cpu = "?" if run["cpu_seconds"] is None else f"{run['cpu_seconds']:.0f}"   # a process that died says none
        return f"{run['seconds']:.0f} s ({cpu} s CPU)"

    parts.append("each group's process, plain / patched: " + "; ".join(
        f"{name} {seconds(g['plain'])} / {seconds(g['patched'])}" for name, g in result["groups"].items()))
    if result["failing_plain"]:
        parts.append(f"\nfailing plain (not counted): {len(result['failing_plain'])}")
        parts += [f"  {t['nodeid']} ({t['plain']}; patched: {t['patched']})\n{_indented(t['message'], 2)}"
                  for t in result["failing_plain"]]
    if result["passing_only_patched"]:
        parts.append("\npassing only with the patches: " +
                     ", ".join(t["nodeid"] for t in result["passing_only_patched"]))
    for error in result["errors"]:
        parts.append(f"\nHARNESS ERROR: {error}")
    if result["regressions"]:
        parts.append(f"\nREGRESSIONS: {len(result['regressions'])} test(s) pass plain and not with stratkit's patches")
        parts += [f"  {t['nodeid']}: {t['patched']}\n{_indented(t['message'], 10)}" for t in result["regressions"]]
    verdict = "FAIL" if result["regressions"] or result["errors"] else "OK"
    parts.append(f"\n[keras-tests] {verdict}: {len(result['regressions'])} regression(s), "
                 f"{len(result['errors'])} harness error(s), {result['seconds']:.0f} s; details: {result['json']}")
    return "\n".join(parts)


def _clear(out: Path) -> None:
    """Remove what an earlier run wrote into ``out`` (only that: ``--out`` may name a directory in use)."""
    out.mkdir(parents=True, exist_ok=True)
    for pattern in ("plain-*.jsonl", "plain-*.log", "patched-*.jsonl", "patched-*.log", "netguard.log",
                    "result.json", "pytest.ini"):
        for path in out.glob(pattern):
            path.unlink()


def _not_collected_patched(plain: dict[str, dict[str, Any]], patched: dict[str, dict[str, Any]],
                           collect_errors: dict[str, str]) -> None:
    """Tests of a file that collects plain and not patched: an error each, with the file's collect error."""
    for nodeid in plain:
        cause = next((message for where, message in collect_errors.items() if nodeid.startswith(where)), None)
        if nodeid not in patched and cause is not None:
            patched[nodeid] = {"outcome": "error", "seconds": 0.0, "message": f"does not collect: {cause}"}


def run(groups: dict[str, tuple[str, ...]], root: Path, out: Path, *, jobs: int = 1, test_timeout: float = 300,
        group_timeout: float = 1800) -> dict[str, Any]:
    """Run every group in both passes and compare; the result ``main`` writes to ``<out>/result.json``."""
    started = time.monotonic()
    _clear(out)
    (out / "pytest.ini").write_text("[pytest]\n")     # every process's config: empty, whatever holds the tests
    missing = [arg for args in groups.values() for arg in args if not (root / arg.split("::")[0]).exists()]
    if missing:
        raise SystemExit(f"keras_tests: not in the installed Keras ({root}): {missing}. "
                         f"Fix: update GROUPS in tools/keras_tests.py")
    runs: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    # in list order: with 2 jobs a group's plain and patched passes run side by side
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(run_group, name, groups[name], which, root, out, test_timeout=test_timeout,
                               group_timeout=group_timeout): (name, which) for name in groups for which in PASSES}
        for future in as_completed(futures):
            name, which = futures[future]
            runs[name][which] = future.result()
            _say_pass(name, which, runs[name][which])
    plain: dict[str, dict[str, Any]] = {}
    patched: dict[str, dict[str, Any]] = {}
    for name in groups:
        plain.update(runs[name]["plain"]["tests"])
        patched.update(runs[name]["patched"]["tests"])
        _not_collected_patched(runs[name]["plain"]["tests"], patched, runs[name]["patched"]["collect_errors"])
    compared = compare(plain, patched)

    def process(name: str, which: str) -> dict[str, Any]:
        one = runs[name][which]
        return {"returncode": one["returncode"], "seconds": one["seconds"],
                "cpu_seconds": (one["end"] or {}).get("cpu_seconds"), "log": one["log"]}

    return {
        "keras_root": str(root),
        "groups": {name: {"args": list(groups[name]), **{which: process(name, which) for which in PASSES},
                          "patches": runs[name]["patched"]["start"].get("patches")} for name in groups},
        "files": per_file(plain, patched, compared["regressions"]),
        **compared,
        "errors": harness_errors(groups, runs, out / "netguard.log"),
        "tests": {nodeid: {which: outcomes.get(nodeid, {}).get("outcome", "missing")
                           for which, outcomes in (("plain", plain), ("patched", patched))}
                  for nodeid in sorted(set(plain) | set(patched))},
        "seconds": round(time.monotonic() - started, 1),
        "json": str(out / "result.json"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/keras_tests.py", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="where the logs and result.json go "
                                                                "(emptied first; default %(default)s)")
    parser.add_argument("--group", action="append", choices=sorted(GROUPS), help="run only this group (repeatable)")
    parser.add_argument("--select", nargs="+", metavar="ARG",
                        help="instead of GROUPS: these pytest arguments (files or node ids, relative to --root), "
                             "as one group")
    parser.add_argument("--root", help="the directory the arguments are relative to (default: the one holding the "
                                       "installed keras package)")
    parser.add_argument("--jobs", type=int, default=1, help="pytest processes at a time (default %(default)s)")
    parser.add_argument("--test-timeout", type=float, default=300.0, help="seconds per test (default %(default)s)")
    parser.add_argument("--group-timeout", type=float, default=1800.0,
                        help="seconds per pytest process (default %(default)s)")
    args = parser.parse_args(argv)
    groups = {"select": tuple(args.select)} if args.select else {
        name: GROUPS[name] for name in GROUPS if not args.group or name in args.group}
    root = Path(args.root).resolve() if args.root else keras_root()
    out = Path(args.out).resolve()
    result = run(groups, root, out, jobs=args.jobs, test_timeout=args.test_timeout, group_timeout=args.group_timeout)
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(report(result), flush=True)
    return 1 if result["regressions"] or result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
