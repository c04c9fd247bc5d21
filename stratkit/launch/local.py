"""`launch()`: the Python entry of `stratkit launch`, a local TF_CONFIG cluster of processes.

Where each step lives: checks and the plan in `plan.py` and `checks.py`, one
attempt in `attempt.py`, the restart loop in `supervisor.py`, the result types
and report in `results.py`, the launcher's output in `console.py`; the process
plumbing (ports, children, reaper, output pump, report format) is the shared
`stratkit.process` layer, which the Spark runner uses too.

One attempt, in the order it happens:

1. Plan the tasks (chief, workers, ps, evaluator) and reserve one port per
   task that serves gRPC, on `host`.
2. Build every task's TF_CONFIG and check it with `stratkit.detect()` -- the
   same rule every task applies to itself -- so a layout the tasks would
   reject fails here, once, with a flag-named error.
3. Start one process per task, each in its own session (its own process
   group), with its TF_CONFIG, `STRATKIT_LAUNCHER=launch`,
   `STRATKIT_RESTART_COUNT` and a share of the CPU threads.
4. Pump every line the tasks print to our stdout/stderr with a `[worker:1] `
   prefix (and to one log file per task), keeping each task's last lines.
5. Watch: the first task to fail (non-zero exit, a signal, or the attempt
   outliving `timeout`) stops the others -- SIGTERM to each process group, then
   SIGKILL after `stop_grace` -- and becomes the root cause in the report
   (failures within the next second are weighed too: a crash beats an
   exception, which is often a peer's reaction to it).

Then restart the whole cluster (fresh ports) up to `max_restarts` times; a
script that trains with `Trainer.fit(backup_dir=...)` resumes at the epoch
reached.

No orphans: children run in their own process groups, which are killed as
groups; SIGINT/SIGTERM/SIGHUP to the launcher stop the cluster; each child
gets PR_SET_PDEATHSIG=SIGKILL, so it dies with the launcher even when the
launcher is SIGKILLed; and a tiny reaper process kills the remaining process
groups (grandchildren included, which PDEATHSIG does not reach) when the
launcher's pipe to it closes, however the launcher ended.

Imports no TensorFlow.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from typing import IO

from stratkit.errors import ConfigError
from stratkit.launch.plan import DEFAULT_EXIT_GRACE, DEFAULT_HOST, DEFAULT_STOP_GRACE, plan_launch, reserve_ports
from stratkit.launch.results import LaunchResult
from stratkit.launch.supervisor import Supervisor
from stratkit.launch.tune import TunePlan
from stratkit.process.ports import listening_ports
from stratkit.strategy.server import RUN_DIR_VAR
from stratkit.tuning.environment import new_token

# Kept importable from here, where they used to live.
__all__ = ["launch", "listening_ports", "reserve_ports"]


def launch(command: Sequence[str], *, workers: int | str = 1, chief: bool = False, ps: int = 0, evaluator: bool = False,
           max_restarts: int = 0, log_dir: str | os.PathLike[str] | None = None, host: str = DEFAULT_HOST,
           base_port: int | None = None, timeout: float | None = None, exit_grace: float = DEFAULT_EXIT_GRACE,
           stop_grace: float = DEFAULT_STOP_GRACE, env: Mapping[str, str] | None = None,
           stdout: IO[str] | None = None, stderr: IO[str] | None = None, handle_signals: bool = True,
           private_network: bool | None = None, gpus_per_worker: int | None = None,
           gpus_per_ps: int | None = None, share_gpus: bool = False,
           preemption_signal: str | int | None = None, tune: bool = False, workers_per_trial: int = 1) -> LaunchResult:
    """Run `command` as every task of a local TF_CONFIG cluster and supervise it.

    Args:
        command: the program and its arguments, e.g. `["python", "train.py"]`.
        workers: worker tasks (as `stratkit launch --workers`); "gpu": one per GPU visible here.
        chief: add a chief task (required with `ps`).
        ps: parameter-server tasks.
        evaluator: add an evaluator task.
        max_restarts: restart the whole cluster up to this many times after a failure.
        log_dir: also write each task's output to `log_dir/<role>-<index>.log` (appended per
            attempt), plus `events.jsonl` (starts, pids, exits) and, on failure, `root-cause.txt`.
        host: the address every task binds and is reached at.
        base_port: use consecutive ports from here instead of free ones.
        timeout: seconds an attempt may run; then it counts as a failure (exit code 124 if final).
        exit_grace: seconds the other tasks get to exit after the chief (worker 0) finished; those
            still running are then stopped, which is not a failure (ps tasks and PS-cluster workers
            only serve, and nothing else can still be needed once the chief is done).
        stop_grace: seconds between SIGTERM and SIGKILL when stopping tasks.
        env: the tasks' base environment (default `os.environ`).
        stdout: where the tasks' prefixed stdout lines go (default `sys.stdout`).
        stderr: where the tasks' prefixed stderr lines, the launcher's messages and the
            failure report go (default `sys.stderr`).
        handle_signals: stop the cluster on SIGINT/SIGTERM/SIGHUP (main thread only).
        private_network: run the tasks in a private network namespace with loopback only, so
            their TensorFlow servers (which listen on all interfaces) cannot be reached from
            other machines. None (default): where the machine allows it and `host` is loopback,
            else warn at start; True: always, else ConfigError; False: never (with the warning).
        gpus_per_worker: GPUs each chief/worker/evaluator gets as its CUDA_VISIBLE_DEVICES; None: the
            visible GPUs split evenly (nothing set on a host without GPUs); 0: GPUs hidden ("").
            See `stratkit.cluster.gpus` for the rule and docs/gpu-hosts.md.
        gpus_per_ps: GPUs each ps task gets (default none: "" on a GPU host).
        share_gpus: let several tasks use one GPU (round robin) instead of refusing; those tasks
            get TF_FORCE_GPU_ALLOW_GROWTH=true.
        preemption_signal: a signal besides SIGTERM (e.g. "USR1") that means the job is preempted; the
            tasks get it as STRATKIT_PREEMPTION_SIGNAL. SIGTERM (or it) to the launcher stops the tasks
            with SIGTERM: with `backup_dir` they back up at the same step and exit 75, and the launcher
            returns 75 (no restart). A task that exits 75 in an attempt restarts the cluster without
            counting against `max_restarts`.
        tune: a tune run (`stratkit launch --tune`, docs/tuning.md): every worker is a tuner of one search
            (a script with `stratkit.tune(tuner)`), worker 0 also runs the search service (loopback, the
            run's token); no TF_CONFIG; a tuner other than worker 0 that dies once the search started is a
            lost lease (its trial runs again elsewhere), not a failure; no private network by default
            (no TensorFlow server listens).
        workers_per_trial: with `tune`, each group of this many workers is one tuner whose trials train on
            the whole group, a MultiWorkerMirrored cluster of its own (`stratkit.tuning.groups`); `workers`
            must be a multiple of it. A group's worker that dies takes its group with it.

    Returns:
        A `LaunchResult`: `returncode` 0 only when every task succeeded; else the failed task's
        exit code, 128 + N for a death by signal N, 124 for the timeout, 128 + N after the
        launcher received signal N (75 when that was a preemption signal and every task saved its
        backup and exited 75: `stratkit.status.EXIT_PREEMPTED`).

    Raises:
        ConfigError: on a bad layout, command, host or port, naming the flag and the fix.
    """
    # A private directory (0700) every task agrees on: the chief's "done" markers for ps/worker tasks, a tune
    # run's markers (`stratkit.tuning.environment`).
    run_dir = tempfile.mkdtemp(prefix="stratkit-run-")
    try:
        if workers_per_trial != 1 and not tune:
            raise ConfigError(f"--workers-per-trial {workers_per_trial} (workers_per_trial=) is for a search. Fix: add "
                              "--tune (tune=True), or drop it")
        tune_plan = TunePlan(new_token(), "stratkit launch --tune", os.path.join(run_dir, "tune"),
                             workers_per_trial=workers_per_trial) if tune else None
        plan = plan_launch(command, workers=workers, chief=chief, ps=ps, evaluator=evaluator,
                           max_restarts=max_restarts, log_dir=log_dir, host=host, base_port=base_port, timeout=timeout,
                           exit_grace=exit_grace, stop_grace=stop_grace, env=env, stdout=stdout, stderr=stderr,
                           handle_signals=handle_signals, private_network=private_network,
                           gpus_per_worker=gpus_per_worker, gpus_per_ps=gpus_per_ps, share_gpus=share_gpus,
                           preemption_signal=preemption_signal, tune=tune_plan)
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    plan.extra_env[RUN_DIR_VAR] = run_dir
    try:
        return Supervisor(plan).run()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
