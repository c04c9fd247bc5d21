"""The restart loop of a local launch: attempts until one succeeds, restarts run out, or we are stopped.

Around the attempts (`stratkit.launch.attempt`) it owns what lives for the
whole launch: the private network the tasks run in (or the warning that their
servers are exposed), the reaper, our signal handlers (SIGINT/SIGTERM/SIGHUP
stop the cluster; a second one skips the stop grace), events.jsonl, and the
final result with its root-cause report.

Preemption: an attempt whose tasks stopped on a preemption notice (exit 75,
after their backup) is restarted without counting against --max-restarts.
SIGTERM (or --preemption-signal) to the launcher itself stops the tasks with
SIGTERM, their preemption notice: they save and exit 75, and the launcher
exits 75 too, without a restart (the platform is taking the machine).

Imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from typing import Any

from stratkit.launch.attempt import AttemptRunner
from stratkit.launch.console import Console
from stratkit.launch.forward import Forward
from stratkit.launch.isolation import PrivateNetwork, PrivateNetworkUnavailable, is_loopback
from stratkit.launch.plan import DEFAULT_HOST, LaunchPlan
from stratkit.launch.results import (Attempt, LaunchResult, exit_code, failure_report, preempted_note,
                                     saved_and_exited)
from stratkit.status import EXIT_PREEMPTED
from stratkit.process.ports import is_listening, listening_ports
from stratkit.process.reaper import Reaper
from stratkit.process.report import signal_name
from stratkit.training.tracking.handoff import loopback_server


class Supervisor:
    """Runs a `LaunchPlan`: `run()` returns the `LaunchResult`."""

    def __init__(self, plan: LaunchPlan) -> None:
        self.plan = plan
        self.console = Console(plan.stdout, plan.stderr)
        self.signals: list[int] = []
        self.started = time.monotonic()
        self.network: PrivateNetwork | None = None
        self.forward: Forward | None = None

    def run(self) -> LaunchResult:
        if self.plan.log_dir:
            self.console.open_events(self.plan.log_dir)
        try:
            self.network = self._open_network()
        except BaseException:
            self.console.close()
            raise
        if self.plan.run_timeout is not None:
            self.plan = dataclasses.replace(self.plan, run_deadline=self.started + self.plan.run_timeout)
        previous = self._install_signals()
        reaper = Reaper()
        try:
            return self._result(self._attempts(reaper))
        finally:
            reaper.close()
            if self.forward is not None:
                self.forward.close()
            if self.network is not None:
                self.network.close()
            self.console.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _attempts(self, reaper: Reaper) -> list[Attempt]:
        """Start the cluster, and again after each failure while restarts are left (a preemption is not one)."""
        attempts: list[Attempt] = []
        allowed = self.plan.max_restarts  # failures only; the plan's count grows by each preemption's restart
        failures = 0
        while not self.signals:  # e.g. Ctrl-C while a failed attempt was being stopped: no restart
            number = len(attempts)
            attempt = AttemptRunner(self.plan, number, self.console, reaper, self.network, self.signals).run()
            attempts.append(attempt)
            if attempt.outcome in ("succeeded", "interrupted") or attempt.after_success or self.signals:
                break
            failure = attempt.failure
            assert failure is not None
            if attempt.outcome == "preempted":
                self.plan = dataclasses.replace(self.plan, max_restarts=self.plan.max_restarts + 1)
                self.console.say(f"attempt {number + 1} was preempted: {failure.task} {failure.reason}")
                self.console.say(f"restarting the whole cluster (a preemption is not counted against --max-restarts: "
                                 f"{allowed - failures} of {allowed} restart(s) left); it resumes at the step its "
                                 "preemption backup holds")
                self.console.event("preempted", attempt=number, task=failure.task)
                continue
            failures += 1
            if failures > allowed or attempt.outcome == "timed_out" and self.plan.run_deadline is not None:
                break  # (a runner's timeout covers the whole run: nothing is left for a restart)
            self.console.say(f"attempt {number + 1} of {self.plan.attempts} failed: {failure.task} {failure.reason}")
            self.console.say(f"restarting the whole cluster (restart {failures} of {allowed}); a script using "
                             "Trainer.fit(backup_dir=...) resumes at its newest backup (epoch, or step with "
                             "backup_every)")
            time.sleep(0.5)
        return attempts

    # -- signals ----------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signals.append(signum)

    def _install_signals(self) -> dict[int, Any]:
        previous: dict[int, Any] = {}
        if not self.plan.handle_signals or threading.current_thread() is not threading.main_thread():
            return previous
        for sig in dict.fromkeys((signal.SIGINT, signal.SIGTERM, signal.SIGHUP, *self.plan.preemption_signals)):
            current = signal.getsignal(sig)
            if current == signal.SIG_IGN:  # e.g. nohup: the user asked us to ignore it
                continue
            previous[sig] = current
            signal.signal(sig, self._on_signal)
        return previous

    # -- the network ------------------------------------------------------------------------------
    def _open_network(self) -> PrivateNetwork | None:
        """The private network the tasks run in, or None -- then say, once, that their servers are exposed."""
        wanted, host = self.plan.private_network, self.plan.host
        if self.plan.tune is not None and self.plan.tune.workers_per_trial == 1 and not wanted:
            self.console.say("a tune run starts no TensorFlow server (each tuner trains alone; the search service "
                             "listens on loopback and takes only the run's token): the tasks use this machine's "
                             "network (--private-network isolates them anyway)")
            return None
        if wanted is False:
            self._warn_exposed("you asked for the machine's network (--no-private-network, or "
                               "STRATKIT_PRIVATE_NETWORK=0). Fix: drop --no-private-network (and the variable): the "
                               "tasks then share a private, loopback-only network; or "
                               "block the task ports from other machines with a firewall")
            return None
        if not is_loopback(host):  # launch() refused this combination with private_network=True
            self._warn_exposed(f"--host {host} is not a loopback address, so the tasks use the machine's network. "
                               f"Fix: --host {DEFAULT_HOST} (the default), which runs them in a private, loopback-only "
                               "network; or block the task ports from other machines with a firewall")
            return None
        try:
            network = PrivateNetwork.start()
        except PrivateNetworkUnavailable as exc:
            if wanted:
                raise
            self._warn_exposed(f"stratkit could not give the tasks a private network: {exc.why}. Fix: allow user "
                               "namespaces to this user (then every launch is isolated: see docs/security.md)"
                               ", or block the task ports from other machines with a firewall; "
                               "--private-network turns this warning into an error")
            return None
        kind = "in a user namespace of its own" if network.user_namespace else "as root"
        self.console.say(f"tasks run in a private network namespace, loopback only ({kind}, held by pid "
                         f"{network.pid}): their TensorFlow servers cannot be reached from other machines, and the "
                         "tasks cannot reach the network either (--no-private-network gives it back, and exposes "
                         "the servers)")
        self.console.event("private_network", pid=network.pid, namespaces=network.namespaces)
        self._forward_tracking(network)
        return network

    def _forward_tracking(self, network: PrivateNetwork) -> None:
        """Make the MLflow server the tasks' tracking URI names on this machine's loopback reachable inside."""
        server = loopback_server({**self.plan.env, **self.plan.extra_env})
        if server is None:
            return
        try:
            self.forward = Forward(network.listen(*server), server).start()
        except OSError as exc:
            self.console.say(f"could not make the MLflow server at {server[0]}:{server[1]} reachable from the "
                             f"private network ({exc.strerror or exc}): the tasks cannot log to it")
            return
        self.console.say(f"the MLflow server at {server[0]}:{server[1]} (MLFLOW_TRACKING_URI) is relayed into the "
                         "private network: the tasks reach it, and only it"
                         + ("" if is_listening(server[0], server[1], listening_ports()) else
                            " (nothing listens there now: start the server, or the tasks cannot log to it)"))
        self.console.event("forward", host=server[0], port=server[1])

    def _warn_exposed(self, why_and_fix: str) -> None:
        self.console.say("WARNING: every task's TensorFlow gRPC server listens on all interfaces (0.0.0.0), not only "
                         f"on {self.plan.host}: TensorFlow has no setting to bind it to one address. It has no "
                         "authentication or TLS and runs any graph a client sends, so anyone who can reach this "
                         f"machine can run code as you while the cluster runs. Here {why_and_fix}.")
        self.console.event("exposed", host=self.plan.host)

    # -- the result -------------------------------------------------------------------------------
    def _result(self, attempts: list[Attempt]) -> LaunchResult:
        seconds = time.monotonic() - self.started
        total = self.plan.attempts
        if attempts and attempts[-1].outcome == "succeeded":
            self.console.say(f"done: every task succeeded (attempt {attempts[-1].number + 1} of {total}, "
                             f"{seconds:.1f} s)")
            self.console.event("done", returncode=0)
            return LaunchResult(0, tuple(attempts))
        if self.signals and self.signals[0] in self.plan.preemption_signals and attempts \
                and saved_and_exited(attempts[-1]):
            self.console.say(preempted_note(attempts[-1], signal_name(self.signals[0]), seconds))
            self.console.event("done", returncode=EXIT_PREEMPTED, signal=signal_name(self.signals[0]), preempted=True)
            return LaunchResult(EXIT_PREEMPTED, tuple(attempts), interrupted_by=self.signals[0])
        if attempts and attempts[-1].outcome == "preempted" and not self.signals:
            # --nnodes: another node's launcher was preempted, and every task saved at one step; no restart
            # (that node is gone): this node ends with 75 as well, so the job is started again and resumes there.
            failure = attempts[-1].failure
            assert failure is not None
            self.console.say(f"preempted: {failure.task} {failure.reason}; exiting {EXIT_PREEMPTED} (preempted) "
                             f"after {seconds:.1f} s so the job is started again, and it resumes from the backup")
            self.console.event("done", returncode=EXIT_PREEMPTED, preempted=True, task=failure.task)
            return LaunchResult(EXIT_PREEMPTED, tuple(attempts))
        if self.signals:
            signum = self.signals[0]
            self.console.say(f"stopped every task after {signal_name(signum)} ({seconds:.1f} s)")
            self.console.event("done", returncode=128 + signum, signal=signal_name(signum))
            return LaunchResult(128 + signum, tuple(attempts), interrupted_by=signum)
        last = attempts[-1]
        failure = last.failure
        assert failure is not None
        report = failure_report(attempts, total, self.plan.primary.name, self.plan.stop_grace,
                                private_network=self.network is not None, title=self.plan.report_title)
        if self.plan.print_report:
            self.console.report(report)
        if self.plan.log_dir:
            with open(os.path.join(self.plan.log_dir, "root-cause.txt"), "w") as handle:
                handle.write(report + "\n")
        code = exit_code(last)
        self.console.event("done", returncode=code, root_cause=failure.task, reason=failure.reason)
        return LaunchResult(code, tuple(attempts), report=report)
