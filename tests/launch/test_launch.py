"""`stratkit launch`: a user's script, unchanged, as a supervised TF_CONFIG cluster of real processes.

The fast tests check flags, messages and helpers in-process. The slow ones run
the real command (`python -m stratkit.cli launch ...`) with real child
processes -- plain Python where the behaviour under test is the supervisor's
(failure, signals, orphans), real TensorFlow where it is the cluster's
(MWMS, parameter servers, restart and resume). Every slow test checks, by PID,
that no process it started is left behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from procs import child_env

import stratkit
from stratkit.cli import main
from stratkit.launch import describe_returncode, plan_tasks, thread_env
from stratkit.launch.local import listening_ports, reserve_ports
from procs import alive as _alive  # noqa: E402

DIGITS_EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "digits.py")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No developer's TF_CONFIG or STRATKIT_* setting may change a launch under test."""
    for name in list(os.environ):
        if name == "TF_CONFIG" or name.startswith(("STRATKIT_", "SLURM_")):
            monkeypatch.delenv(name, raising=False)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _launch_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "stratkit.cli", "launch", *args]


def _run(args: list[str], env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    # On a test timeout subprocess.run SIGKILLs the launcher: its children then die by PDEATHSIG/reaper.
    return subprocess.run(_launch_argv(*args), env=child_env(None, env), capture_output=True, text=True,
                          timeout=timeout)


def _pids(launcher_stderr: str) -> dict[str, list[int]]:
    """task -> pids, from the launcher's "worker:0 started: pid 123" lines (one per attempt)."""
    found: dict[str, list[int]] = {}
    for task, pid in re.findall(r"(\w+:\d+) started: pid (\d+)", launcher_stderr):
        found.setdefault(task, []).append(int(pid))
    return found


def _assert_all_gone(pids: list[int], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while True:
        alive = [p for p in pids if _alive(p)]
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    for pid in alive:  # do not leak them into the next test, then fail
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not alive, f"processes left behind: {alive}"


def _script(tmp_path: Path, body: str, name: str = "task.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


# A task that reports its role and a grandchild it started, then waits (stands in for a blocked collective).
SLEEPER = """
    import json, os, subprocess, sys, time
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    print(f"ready {task['type']}:{task['index']} grandchild={child.pid}", flush=True)
    time.sleep(300)
"""


class _Launcher:
    """A launcher running in the background, its output collected line by line."""

    def __init__(self, args: list[str], env: dict | None = None, prefix: tuple[str, ...] = ()) -> None:
        # A Ctrl-C from a terminal: SIGINT at its default in the launcher, even when pytest itself runs as a
        # background job (a shell then starts it with SIGINT ignored, which the launcher rightly respects).
        self.proc = subprocess.Popen([*prefix, *_launch_argv(*args)], env=child_env(None, env), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.out: list[str] = []
        self.err: list[str] = []
        self._threads = [threading.Thread(target=self._read, args=(s, d), daemon=True)
                         for s, d in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for thread in self._threads:
            thread.start()

    @staticmethod
    def _read(stream, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    def wait_for(self, pattern: str, count: int, timeout: float = 60) -> list[re.Match]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            matches = [m for m in map(re.compile(pattern).search, list(self.out)) if m]
            if len(matches) >= count:
                return matches
            assert self.proc.poll() is None, f"launcher ended early:\n{''.join(self.out)}\n{''.join(self.err)}"
            time.sleep(0.1)
        raise AssertionError(f"no {count} x {pattern!r} within {timeout}s:\n{''.join(self.out)}{''.join(self.err)}")

    def finish(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout=timeout)
        for thread in self._threads:
            thread.join(5)
        return code

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------------------------------------
# fast: flags, messages, helpers
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, expected", [
    (["--workers", "0", "--", "python", "x.py"], r"--workers 0 without --chief.*Fix: --workers 1"),
    (["--workers", "-2", "--", "python", "x.py"], r"--workers must be a whole number >= 0: got -2"),
    (["--ps", "1", "--workers", "2", "--", "python", "x.py"], r"--ps 1 needs a coordinator.*Fix: add --chief"),
    (["--workers", "2"], r"missing the command to run\. Fix: put it after --"),
    (["--workers", "2", "--"], r"missing the command to run"),
    (["--", "no-such-program-xyz", "train.py"], r"'no-such-program-xyz' was not found on PATH\. Fix"),
    (["--max-restarts", "-1", "--", "python", "x.py"], r"--max-restarts must be a whole number >= 0: got -1"),
    (["--timeout", "0", "--", "python", "x.py"], r"--timeout must be a positive number of seconds: got 0"),
    (["--base-port", "65535", "--workers", "2", "--", "python", "x.py"], r"--base-port must leave room for 2"),
    (["--hosts", "h1,h2", "--", "python", "x.py"], r"--hosts h1,h2 names several machines.*--print-tf-config"),
    (["--hosts", "h1:2222,h2", "--print-tf-config", "--", "python", "x.py"], r"'h1:2222' has a port"),
    (["--log-dir", "s3://bucket/logs", "--", "python", "x.py"], r"--log-dir 's3://bucket/logs' is a store URL.*"
                                                               r"Fix: --log-dir with a local directory"),
    (["--log-dir", "gs:/bucket/logs", "--", "python", "x.py"], r"would be a local directory named 'gs:'"),
])
def test_bad_arguments_exit_2_naming_the_flag_and_the_fix(argv, expected, capsys):
    assert main(["launch", *argv]) == 2
    assert re.search(expected, capsys.readouterr().err), capsys.readouterr()


def test_a_non_number_for_a_count_flag_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["launch", "--workers", "two", "--", "python", "x.py"])
    assert exit_.value.code == 2
    assert "argument --workers: expected a whole number or 'gpu', got 'two'" in capsys.readouterr().err


def test_env_vars_fill_the_flags_and_a_flag_wins(monkeypatch, capsys):
    monkeypatch.setenv("STRATKIT_WORKERS", "3")
    monkeypatch.setenv("STRATKIT_BASE_PORT", "4000")
    assert main(["launch", "--print-tf-config", "--", "python", "train.py"]) == 0
    assert capsys.readouterr().out.count("export TF_CONFIG=") == 3
    assert main(["launch", "--workers", "2", "--print-tf-config", "--", "python", "train.py"]) == 0
    out = capsys.readouterr().out
    assert out.count("export TF_CONFIG=") == 2 and "127.0.0.1:4001" in out
    monkeypatch.setenv("STRATKIT_WORKERS", "two")
    assert main(["launch", "--", "python", "x.py"]) == 2
    assert "STRATKIT_WORKERS='two' is not a whole number" in capsys.readouterr().err


def test_a_strategy_that_contradicts_the_layout_fails_before_anything_starts(monkeypatch, capsys):
    monkeypatch.setenv("STRATKIT_STRATEGY", "mirrored")
    assert main(["launch", "--workers", "2", "--", sys.executable, "-c", "pass"]) == 2
    err = capsys.readouterr().err
    assert "STRATKIT_STRATEGY='mirrored' contradicts" in err and "started" not in err


def test_inside_a_multi_task_srun_step_the_launcher_refuses(monkeypatch, capsys):
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    assert main(["launch", "--workers", "2", "--", sys.executable, "-c", "pass"]) == 2
    assert "srun --ntasks=N python train.py" in capsys.readouterr().err


def test_multi_host_plan_gives_every_task_a_tf_config_detect_accepts(capsys):
    assert main(["launch", "--hosts", "h1,h2", "--chief", "--workers", "2", "--ps", "1", "--evaluator",
                 "--print-tf-config", "--", "python", "train.py", "--lr", "0.1"]) == 0
    out = capsys.readouterr().out
    blocks = re.findall(r"# --- (\S+): (\w+:\d+).*\nexport TF_CONFIG='(.*)'\n(.*)", out)
    assert [(host, task) for host, task, _, _ in blocks] == [
        ("h1", "chief:0"), ("h2", "worker:0"), ("h1", "worker:1"), ("h2", "ps:0"), ("h1", "evaluator:0")]
    for host, task, tf_config, command in blocks:
        spec = stratkit.detect({"TF_CONFIG": tf_config})
        assert f"{spec.task_type}:{spec.task_index}" == task
        assert spec.strategy == "parameter_server"
        assert command == "python train.py --lr 0.1"
    cluster = json.loads(blocks[0][2])["cluster"]
    # Round-robin placement; each host numbers its own ports; the evaluator is not in the cluster.
    assert cluster == {"chief": ["h1:2222"], "worker": ["h2:2222", "h1:2223"], "ps": ["h2:2223"]}


def test_without_workers_the_plan_runs_one_worker_per_host(capsys):
    assert main(["launch", "--hosts", "a,b,c", "--print-tf-config", "--", "python", "t.py"]) == 0
    tf_config = re.search(r"export TF_CONFIG='(.*)'", capsys.readouterr().out).group(1)
    assert json.loads(tf_config)["cluster"] == {"worker": ["a:2222", "b:2222", "c:2222"]}


def test_layout_order_and_thread_share():
    assert [t.name for t in plan_tasks(workers=2, chief=True, ps=1, evaluator=True)] == [
        "chief:0", "worker:0", "worker:1", "ps:0", "evaluator:0"]
    assert thread_env(4, cores=2) == {"TF_NUM_INTRAOP_THREADS": "1", "OMP_NUM_THREADS": "1"}
    assert thread_env(2, cores=8)["TF_NUM_INTRAOP_THREADS"] == "4"


def test_exit_codes_in_words():
    assert describe_returncode(3) == "exited with code 3"
    assert describe_returncode(-9).startswith("killed by SIGKILL (signal 9) -- often out of memory")
    assert "killed by SIGKILL" in describe_returncode(137)  # a shell wrapper's child was OOM-killed
    assert describe_returncode(-11).startswith("killed by SIGSEGV")


def test_a_held_port_refuses_plain_binds_but_admits_a_reuse_server():
    """The mechanism that lets a task's gRPC server take over the launcher's port (no bind-then-close race)."""
    (held,) = reserve_ports("127.0.0.1", 1)
    port = held.getsockname()[1]
    try:
        with socket.socket() as plain, pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
        with socket.socket() as ephemeral:  # the kernel never hands it out
            ephemeral.bind(("127.0.0.1", 0))
            assert ephemeral.getsockname()[1] != port
        assert port not in (listening_ports() or set())
        with socket.socket() as server:  # a SO_REUSEADDR server (TF sets only that; +SO_REUSEPORT is admitted too)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            server.bind(("127.0.0.1", port))
            server.listen()
            assert port in listening_ports()
            with socket.create_connection(("127.0.0.1", port), timeout=2):
                pass  # connections reach the server, not the (non-listening) holder
    finally:
        held.close()


# ---------------------------------------------------------------------------------------------
# slow, plain processes: failure, timeout, signals, orphans
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_task_exiting_3_stops_the_cluster_within_seconds_with_a_root_cause_report(tmp_path):
    task = _script(tmp_path, """
        import json, os, signal, sys, time
        index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        if index == 1:
            for i in range(60):
                print(f"step {i} of the failing task")
            print("ValueError: something broke", file=sys.stderr)
            sys.exit(3)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # a peer that will not stop politely
        time.sleep(300)
    """)
    started = time.monotonic()
    result = _run(["--workers", "2", "--stop-grace", "2", "--log-dir", str(tmp_path / "logs"), "--",
                   sys.executable, task], timeout=60)
    elapsed = time.monotonic() - started
    assert result.returncode == 3, result.stderr
    assert elapsed < 20
    report = result.stderr[result.stderr.index("root cause"):]
    assert "task:    worker:1" in report and "failure: exited with code 3" in report
    assert "ValueError: something broke" in report and "step 59 of the failing task" in report
    assert "step 9 of" not in report                       # the last 50 lines only
    assert "worker:0 (pid" in report and "(SIGTERM, then SIGKILL after --stop-grace 2 s)" in report
    assert (tmp_path / "logs" / "root-cause.txt").read_text().strip() in result.stderr
    assert "[worker:1] step 0 of the failing task" in result.stdout   # live, prefixed
    _assert_all_gone([p for pids in _pids(result.stderr).values() for p in pids])


@pytest.mark.slow
def test_a_crash_is_the_root_cause_even_when_its_peer_exits_a_moment_earlier(tmp_path):
    # worker:1 is SIGKILLed (say, by the OOM killer); worker:0 notices at once and raises -- and
    # may be observed first. The crash, not the reaction, is the root cause.
    task = _script(tmp_path, f"""
        import json, os, signal, sys, time
        flag = {str(tmp_path / "crashing")!r}
        if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
            open(flag, "w").close()
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGKILL)
        while not os.path.exists(flag):
            time.sleep(0.01)
        sys.exit("RuntimeError: my peer is gone")
    """)
    result = _run(["--workers", "2", "--", sys.executable, task], timeout=60)
    assert result.returncode == 128 + 9, result.stderr
    assert "task:    worker:1" in result.stderr and "killed by SIGKILL" in result.stderr
    assert re.search(r"worker:0 \(pid \d+\): exited with code 1", result.stderr)
    _assert_all_gone([p for pids in _pids(result.stderr).values() for p in pids])


@pytest.mark.slow
def test_an_attempt_past_timeout_is_stopped_and_reported(tmp_path):
    task = _script(tmp_path, "import time\nprint('waiting for a peer', flush=True)\ntime.sleep(300)\n")
    result = _run(["--workers", "2", "--timeout", "2", "--", sys.executable, task], timeout=60)
    assert result.returncode == 124, result.stderr
    assert "still running after --timeout 2 s" in result.stderr and "waiting for a peer" in result.stderr
    _assert_all_gone([p for pids in _pids(result.stderr).values() for p in pids])


@pytest.mark.slow
def test_tasks_still_running_after_the_chief_finished_are_stopped_without_failing(tmp_path):
    task = _script(tmp_path, """
        import json, os, time
        if json.loads(os.environ["TF_CONFIG"])["task"]["type"] != "chief":
            time.sleep(300)   # a server that nobody told to exit
    """)
    result = _run(["--chief", "--workers", "1", "--ps", "1", "--exit-grace", "1", "--", sys.executable, task],
                  timeout=60)
    assert result.returncode == 0, result.stderr
    assert "worker:0, ps:0 still running 1 s after chief:0 finished: stopping them (not a failure" in result.stderr
    _assert_all_gone([p for pids in _pids(result.stderr).values() for p in pids])


@pytest.mark.slow
def test_a_failed_attempt_restarts_the_whole_cluster_with_the_restart_count(tmp_path):
    task = _script(tmp_path, """
        import json, os, sys, time
        task = json.loads(os.environ["TF_CONFIG"])["task"]
        count, env = os.environ["STRATKIT_RESTART_COUNT"], os.environ
        print(f"attempt {count} launcher={env['STRATKIT_LAUNCHER']} threads={env['TF_NUM_INTRAOP_THREADS']}")
        if count == "0":
            if task["index"] == 1:
                sys.exit(1)
            time.sleep(60)   # worker 0 cannot finish without its peer (stopped by the launcher)
    """)
    result = _run(["--workers", "2", "--max-restarts", "2", "--log-dir", str(tmp_path / "logs"), "--",
                   sys.executable, task], timeout=60)
    assert result.returncode == 0, result.stderr
    assert "attempt 1 of 3 failed: worker:1 exited with code 1" in result.stderr
    assert "[worker:1] attempt 1 launcher=launch threads=1" in result.stdout
    assert (tmp_path / "logs" / "worker-1.log").read_text().count("===== stratkit launch: worker:1, attempt") == 2
    pids = _pids(result.stderr)
    assert [len(p) for p in pids.values()] == [2, 2]
    _assert_all_gone([p for ps in pids.values() for p in ps])


def _grandchildren(launcher: _Launcher) -> list[int]:
    return [int(m.group(1)) for m in launcher.wait_for(r"ready \w+:\d+ grandchild=(\d+)", 2)]


@pytest.mark.slow
def test_ctrl_c_to_the_launcher_stops_every_task_and_their_children(tmp_path):
    launcher = _Launcher(["--workers", "2", "--", sys.executable, _script(tmp_path, SLEEPER)])
    try:
        grandchildren = _grandchildren(launcher)
        launcher.proc.send_signal(signal.SIGINT)
        assert launcher.finish() == 130
        assert "stopped every task after SIGINT" in launcher.stderr
        _assert_all_gone([p for ps in _pids(launcher.stderr).values() for p in ps] + grandchildren)
    finally:
        launcher.kill()


@pytest.mark.slow
def test_sigkill_of_the_launcher_leaves_no_process_behind(tmp_path):
    launcher = _Launcher(["--workers", "2", "--", sys.executable, _script(tmp_path, SLEEPER)])
    try:
        grandchildren = _grandchildren(launcher)
        tasks = [p for ps in _pids(launcher.stderr).values() for p in ps]
        assert len(tasks) == 2
        launcher.proc.send_signal(signal.SIGKILL)
        launcher.finish()
        # the tasks get PDEATHSIG; their own children are killed by the reaper as the launcher's pipe closes
        _assert_all_gone(tasks + grandchildren, within=10)
    finally:
        launcher.kill()


# ---------------------------------------------------------------------------------------------
# slow, real TensorFlow clusters
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.multiworker
def test_two_worker_mwms_digits_example_trains_with_prefixed_logs(tmp_path):
    logs = tmp_path / "logs"
    result = _run(["--workers", "2", "--log-dir", str(logs), "--", sys.executable, DIGITS_EXAMPLE, "--epochs", "2",
                   "--save", str(tmp_path / "model.keras")])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    report = json.loads(re.search(r"^\[worker:0\] (\{.*\})$", result.stdout, re.M).group(1))
    assert report["strategy"] == "multi_worker_mirrored" and report["workers"] == 2 and report["replicas"] == 2
    assert report["held_out_accuracy"] > 0.5
    assert (tmp_path / "model.keras").exists()
    assert re.search(r"worker:1 started: pid", result.stderr)      # both tasks ran (worker:1 prints nothing:
    assert (logs / "worker-1.log").exists()                        # verbose=0 and TensorFlow's start-up lines hidden)
    assert "held_out_accuracy" in (logs / "worker-0.log").read_text()
    events = [json.loads(line) for line in (logs / "events.jsonl").read_text().splitlines()]
    # The launcher held each port until that worker's gRPC server listened on it, then let go.
    released = {e["task"] for e in events if e["event"] == "port_released" and e["reason"] == "listening"}
    assert released == {"worker:0", "worker:1"}
    _assert_all_gone([e["pid"] for e in events if e["event"] == "start"])


PS_SCRIPT = """
    import json, stratkit
    spec = stratkit.detect()
    if spec.task_type == "evaluator":          # not in the cluster; here it only says who it is
        print(json.dumps({"evaluator_sees": sorted(spec.cluster), "source": spec.source}))
        raise SystemExit(0)
    s = stratkit.make_strategy()               # ps and worker tasks serve here and exit 0 at the end
    import tensorflow as tf
    from stratkit.strategy.server import signal_done
    with s.scope():
        counter = tf.Variable(0, dtype=tf.int64)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(s)

    @tf.function
    def step():
        counter.assign_add(1)
        return counter.read_value()

    for _ in range(5):
        coordinator.schedule(step)
    coordinator.join()
    print(json.dumps({"type": type(s).__name__, "counter": int(counter.numpy())}), flush=True)
    signal_done(spec)
"""


@pytest.mark.slow
@pytest.mark.multiworker
def test_parameter_server_layout_with_an_evaluator_exits_0(tmp_path):
    script = _script(tmp_path, PS_SCRIPT)
    result = _run(["--chief", "--workers", "2", "--ps", "1", "--evaluator", "--", sys.executable, script])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    report = json.loads(re.search(r"^\[chief:0\] (\{.*\"counter\".*\})$", result.stdout, re.M).group(1))
    assert report["type"].startswith("ParameterServerStrategy") and report["counter"] == 5
    for task in ("ps:0", "worker:0", "worker:1"):
        assert f"[{task}] [stratkit] {task} done: the chief finished training" in result.stdout
    assert '[evaluator:0] {"evaluator_sees": ["chief", "ps", "worker"], "source": "launch"}' in result.stdout
    assert "still running" not in result.stderr    # the servers ended themselves, none was stopped
    _assert_all_gone([p for ps in _pids(result.stderr).values() for p in ps])


# A user's script that resumes through Trainer.fit(backup_dir=...); worker 1 is SIGKILLed right after
# epoch 2's backup, on the first attempt only (it reads STRATKIT_RESTART_COUNT).
RESUMABLE_SCRIPT = """
    import json, os, signal, sys
    import stratkit
    trainer = stratkit.Trainer()
    import keras
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = (digits.data / 16.0).astype("float32"), digits.target.astype("int32")

    class CrashOnFirstAttempt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):   # runs after the Trainer's backup of this epoch
            if epoch + 1 == 2 and trainer.spec.worker_rank == 1 and os.environ["STRATKIT_RESTART_COUNT"] == "0":
                os.kill(os.getpid(), signal.SIGKILL)

    def build():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    model = trainer.build(build)
    history = trainer.fit(model, (x, y), epochs=3, per_replica_batch_size=32, backup_dir=sys.argv[1],
                          callbacks=[CrashOnFirstAttempt()])
    print(json.dumps({"epochs_run": len(history.history["loss"])}), flush=True)
"""


@pytest.mark.slow
@pytest.mark.multiworker
def test_sigkilled_worker_is_restarted_and_training_resumes_at_the_epoch_reached(tmp_path):
    logs = tmp_path / "logs"
    result = _run(["--workers", "2", "--max-restarts", "1", "--stop-grace", "3", "--log-dir", str(logs), "--",
                   sys.executable, _script(tmp_path, RESUMABLE_SCRIPT), str(tmp_path / "backup")])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "attempt 1 of 2 failed: worker:1 killed by SIGKILL (signal 9) -- often out of memory" in result.stderr
    resumed = {task: int(epoch) for task, epoch in
               re.findall(r"^\[(worker:\d)\] \[stratkit\] resumed from .* at epoch (\d+)$", result.stdout, re.M)}
    assert set(resumed) == {"worker:0", "worker:1"} and min(resumed.values()) > 0, result.stdout[-3000:]
    assert f"at epoch {resumed['worker:1']}" in (logs / "worker-1.log").read_text()
    runs = [json.loads(m) for m in re.findall(r"^\[worker:\d\] (\{.*\})$", result.stdout, re.M)]
    assert [r["epochs_run"] for r in runs] == [3 - resumed["worker:0"]] * 2   # only the epochs after the backup
    pids = _pids(result.stderr)
    assert [len(p) for p in pids.values()] == [2, 2]
    _assert_all_gone([p for ps in pids.values() for p in ps])


# ---------------------------------------------------------------------------------------------
# input limits: seconds that are not numbers, task counts this machine cannot hold
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag, value", [
    ("--timeout", "nan"), ("--timeout", "inf"), ("--exit-grace", "nan"), ("--exit-grace", "-1"),
    ("--stop-grace", "inf"), ("--stop-grace", "-2"), ("--stop-grace", "nan"),
])
def test_seconds_that_are_not_finite_or_are_negative_exit_2_naming_flag_value_and_fix(flag, value, capsys):
    code = main(["launch", flag, value, "--", sys.executable, "-c", "pass"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert re.search(rf"{flag} must be a \w+ number of seconds.*got {value}\b.*Fix: e\.g\. {flag} \d", err), err
    assert "started" not in err


@pytest.mark.parametrize("var, value", [
    ("STRATKIT_TIMEOUT", "nan"), ("STRATKIT_EXIT_GRACE", "inf"), ("STRATKIT_STOP_GRACE", "-3"),
])
def test_seconds_from_env_vars_are_checked_too_naming_the_variable(var, value, monkeypatch, capsys):
    monkeypatch.setenv(var, value)
    code = main(["launch", "--", sys.executable, "-c", "pass"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert re.search(rf"{var}='{value}' is not a finite number of seconds >= 0\. Fix: e\.g\. {var}=\d", err), err


def test_more_workers_than_the_machine_can_hold_is_refused_first_with_the_limit(capsys):
    code = main(["launch", "--workers", "70000", "--", sys.executable, "-c", "pass"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert re.search(r"--workers 70000: .*at most \d+ tasks", err), err
    assert "Fix:" in err and "--print-tf-config" in err and "started" not in err


def test_the_task_limit_follows_the_open_file_limit(tmp_path):
    """With `ulimit -n 200` the launcher cannot hold pipes and ports for 100 tasks: it says so, naming the limit."""
    import resource

    def low_fd_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))

    result = subprocess.run(_launch_argv("--workers", "100", "--", sys.executable, "-c", "pass"),
                            env=child_env(None, None), capture_output=True, text=True, timeout=60,
                            preexec_fn=low_fd_limit)
    assert result.returncode == 2, result.stderr
    assert re.search(r"--workers 100: .*open files.*ulimit -n\) is 200.*at most \d+ tasks", result.stderr), \
        result.stderr
    assert "started" not in result.stderr


# ---------------------------------------------------------------------------------------------
# the failure report names the exception even when its traceback is longer than the tail
# ---------------------------------------------------------------------------------------------
# What a TensorFlow graph error looks like: the exception's type line, then a message of hundreds of
# lines ("Detected at node ... defined at (most recent call last):" and one line per frame), so the
# last 50 lines hold only frames.
LONG_TRACEBACK = """
    import json, os, sys, time
    if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0:
        time.sleep(300)
    print("epoch 1/3 ... loss 0.53")
    def fit():
        frames = "\\n".join(f"  File \\"/site-packages/keras/src/layer_{i}.py\\", line {i}, in call"
                           for i in range(120))
        raise InvalidArgumentError("Graph execution error:\\n\\nDetected at node 'loss/Log' defined at "
                                   "(most recent call last):\\n" + frames + "\\nlogits and labels must have "
                                   "the same first dimension, got 32 and 31\\n\\t [[{{node loss/Log}}]]")
    class InvalidArgumentError(Exception):
        pass
    try:
        fit()
    except InvalidArgumentError:
        sys.stdout.flush()
        raise
"""


@pytest.mark.slow
def test_the_report_shows_the_exception_type_and_message_of_a_traceback_longer_than_the_tail(tmp_path):
    result = _run(["--workers", "2", "--stop-grace", "1", "--", sys.executable, _script(tmp_path, LONG_TRACEBACK)],
                  timeout=60)
    assert result.returncode == 1, result.stderr
    report = result.stderr[result.stderr.index("root cause"):]
    tail = report[report.index("last 50 line(s)"):]
    assert "InvalidArgumentError" not in tail            # the case at hand: the tail alone loses the type
    exception = report[report.index("exception:"):report.index("last 50 line(s)")]
    assert "exception: InvalidArgumentError: Graph execution error:" in exception
    assert "Detected at node 'loss/Log'" in exception    # the message's first lines, as context
    assert "logits and labels must have the same first dimension" in tail
    _assert_all_gone([p for pids in _pids(result.stderr).values() for p in pids])


def test_the_exception_scanner_keeps_the_last_exception_of_a_chain_despite_interleaved_stdout():
    from stratkit.launch.tracebacks import ExceptionScanner

    scanner = ExceptionScanner(context_lines=2)
    stderr = ["Traceback (most recent call last):", '  File "a.py", line 1, in <module>', "    f()",
              "KeyError: 'x'", "", "During handling of the above exception, another exception occurred:", "",
              "Traceback (most recent call last):", '  File "a.py", line 3, in <module>', "    g()", "    ^^^",
              "tensorflow.python.framework.errors_impl.UnavailableError: Collective ops is aborted by: ...",
              "", "The error could be from a previous operation.", "Additional GRPC error information:",
              "  more detail that is past the context"]
    for i, line in enumerate(stderr):
        scanner.feed(line, "stderr")
        if i in (2, 9):
            scanner.feed("step 3/10 - loss 0.4", "stdout")   # stdout between traceback lines
    assert scanner.exception == (
        "tensorflow.python.framework.errors_impl.UnavailableError: Collective ops is aborted by: ...",
        "The error could be from a previous operation.", "Additional GRPC error information:")
    plain = ExceptionScanner()
    plain.feed("RuntimeError: my peer is gone")                 # what sys.exit("...") prints: no traceback
    plain.feed("2026-11-23 11:00:00 W tensorflow/core/x.cc:1] NotFoundError: a log line, not an exception")
    assert plain.exception[0] == "RuntimeError: my peer is gone"


# TensorFlow's start-up lines on a machine without a GPU (measured with TF 2.21): absl's pre-init notice,
# the oneDNN and cuda-driver INFO lines, the cuInit error.
_TF_STARTUP_NOISE = ("All log messages before absl::InitializeLog()", "oneDNN custom operations",
                     "Could not find cuda drivers", "failed call to cuInit")
_IMPORTS_TF = """
    import tensorflow as tf
    print("devices:", [d.device_type for d in tf.config.list_physical_devices()], flush=True)
"""


@pytest.mark.slow
def test_tasks_get_the_spark_runners_quiet_tensorflow_logging_unless_the_user_set_a_level(tmp_path):
    # As a user's shell: neither TF_CPP_MIN_LOG_LEVEL nor CUDA_VISIBLE_DEVICES set.
    script = _script(tmp_path, _IMPORTS_TF)
    logs = tmp_path / "logs"
    quiet = _run(["--workers", "1", "--log-dir", str(logs), "--", sys.executable, script],
                 env={"TF_CPP_MIN_LOG_LEVEL": None, "CUDA_VISIBLE_DEVICES": None}, timeout=120)
    assert quiet.returncode == 0, quiet.stderr
    assert "[worker:0] devices: [" in quiet.stdout
    shown = quiet.stdout + quiet.stderr + (logs / "worker-0.log").read_text()
    assert not [noise for noise in _TF_STARTUP_NOISE if noise in shown], shown

    loud = _run(["--workers", "1", "--", sys.executable, script],
                env={"TF_CPP_MIN_LOG_LEVEL": "0", "CUDA_VISIBLE_DEVICES": None}, timeout=120)
    assert loud.returncode == 0, loud.stderr
    assert "[worker:0] All log messages before absl::InitializeLog()" not in loud.stdout   # (it is on stderr)
    assert re.search(r"^\[worker:0\] WARNING: All log messages before absl::InitializeLog\(\)", loud.stderr, re.M)
    assert re.search(r"^\[worker:0\] I\d{4} .*\] ", loud.stderr, re.M), loud.stderr   # TF's own INFO lines
