"""Non-chief workers' private directories never outlive the worker, however it ends.

Real 2-worker MultiWorkerMirroredStrategy runs on 127.0.0.1, each worker with
the same private TMPDIR, calling plain `model.fit` with TensorBoard,
ModelCheckpoint and BackupAndRestore: worker 1 writes its copies to
`stratkit-{tb,ckpt,backup}-worker-*` directories there. Then the worker is
SIGKILLed (no `finally`, no exit handler runs), before or after the chief is
gone; nothing else of stratkit is alive to clean up (no launcher). The
directories must still disappear.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from procs import child_env, free_ports, worker_tf_configs

from stratkit.process.children import start_child
from stratkit.strategy import scratch

WORKER_DIRS = "stratkit-*-worker-*"

SCRIPT = r"""
import sys, time
import numpy as np
import stratkit

strategy = stratkit.make_strategy()
import keras

with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
out = sys.argv[1]


class Slow(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        time.sleep(0.2)  # keep training (and the directories in use) until the test kills us


x, y = np.zeros((64, 4), "float32"), np.zeros((64, 1), "float32")
model.fit(x, y, batch_size=16, epochs=10000, verbose=0,
          callbacks=[keras.callbacks.TensorBoard(out + "/tb"), keras.callbacks.ModelCheckpoint(out + "/ckpt/m.keras"),
                     keras.callbacks.BackupAndRestore(out + "/backup"), Slow()])
"""


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group, as a launcher or a test harness does
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _wait_for(condition, timeout: float, what: str, procs) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; exit codes {[p.poll() for p in procs]}")
        time.sleep(0.2)


def test_the_sweeper_removes_what_is_still_listed_when_its_pipe_closes(tmp_path):
    kept, left = tmp_path / "removed-by-the-worker", tmp_path / "left-behind"
    for path in (kept, left):
        (path / "sub").mkdir(parents=True)
    sweeper = subprocess.Popen([sys.executable, "-I", "-S", scratch.__file__], stdin=subprocess.PIPE)
    sweeper.communicate(f"+{kept}\n+{left}\n-{kept}\n".encode(), timeout=30)  # then EOF, as when the worker dies
    assert sweeper.returncode == 0
    assert kept.is_dir() and not left.exists()


def test_a_directory_is_private_and_gone_after_remove(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(scratch.tempfile, "tempdir", None)  # re-read TMPDIR
    path = scratch.make("stratkit-tb-worker-")
    assert os.path.dirname(path) == str(tmp_path) and os.stat(path).st_mode & 0o777 == 0o700
    scratch.remove([path])
    assert not os.path.exists(path)


@pytest.mark.slow
@pytest.mark.multiworker
@pytest.mark.parametrize("order", ["worker killed while training", "chief gone first, then the worker killed"])
def test_a_killed_workers_private_dirs_are_removed(tmp_path, order):
    tmpdir, out = tmp_path / "tmp", tmp_path / "out"
    tmpdir.mkdir()
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    procs = []
    try:
        for tf_config in worker_tf_configs(free_ports(2)):
            procs.append(start_child(
                [sys.executable, str(script), str(out)], child_env(tf_config, {"TMPDIR": str(tmpdir)}),
                stdout=open(tmp_path / f"w{len(procs)}.log", "wb"), stderr=subprocess.STDOUT))
        chief, worker = procs
        # tb, ckpt and backup: worker 1's private copies exist, training runs.
        _wait_for(lambda: len(list(tmpdir.glob(WORKER_DIRS))) >= 3, 180, "worker 1's private directories", procs)
        made = sorted(p.name for p in tmpdir.glob(WORKER_DIRS))
        assert {name.split("-")[1] for name in made} == {"tb", "ckpt", "backup"}, made
        first, second = (worker, chief) if order.startswith("worker") else (chief, worker)
        _kill(first)
        _kill(second)
        _wait_for(lambda: not list(tmpdir.rglob(WORKER_DIRS)), 15, f"{made} to be removed", procs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                _kill(proc)
