"""`stratkit launch --nnodes N --rdzv-endpoint HOST:PORT`: this node's share of a cluster across machines.

The same command runs on every node. `launch_node` checks everything that can
be checked before anything starts (the layout of all N*K workers through
`plan_launch`, the token, the endpoint), then `NodeSupervisor`:

1. serves the rendezvous when this machine can bind the endpoint's address
   (`stratkit.launch.rendezvous.RendezvousServer`: node 0), and joins it like
   every node (`stratkit.launch.nodelink.NodeLink`): its task address is the local address of that
   connection, its ports are held (`stratkit.process.ports`) until its tasks
   listen, and the rendezvous hands back its node rank and the one cluster;
2. runs this node's tasks as one local attempt (`NodeAttemptRunner`, the local
   launcher's `AttemptRunner`: prefixed output, logs, stopping, the report),
   which also ends when the rendezvous decides that another node failed or the
   rendezvous is lost;
3. reports how its tasks ended, waits for the decision, and ends with the
   exit status every node ends with (the root-cause report names the node).

The tasks run on the machine's network (they must reach the other hosts), so
the private network is off, and the launcher says once what that exposes.
With `--max-restarts R` every node joins the next round after a task failed
(each node's own attempt counter; the rendezvous decides for all of them).
A preemption is not counted (as locally, `stratkit.launch.supervisor`): tasks
that saved at one step and exited 75 restart every node; a node whose own
launcher got the preemption signal reports it once its tasks saved, and
every node then ends with 75 (elastic: that node leaves, the others resume at
that step).

Imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from stratkit import timeline
from stratkit.cluster import layout
from stratkit.cluster.environments.tf_config import ELASTIC_VAR
from stratkit.launch.attempt import AttemptRunner, TaskProcess, _Watch
from stratkit.launch.elastic import ElasticRendezvous
from stratkit.launch.isolation import PrivateNetwork
from stratkit.launch.plan import (
    CROSS_HOST_SECURITY,
    LaunchPlan,
    Task,
    plan_launch,
    reserve_ports,
    resolve_workers,
    thread_env,
)
from stratkit.launch.nodeflags import (  # noqa: F401 - DEFAULT_*, parse_*: this module's API too
    DEFAULT_LAST_CALL,
    DEFAULT_RDZV_TIMEOUT,
    NodeSettings,
    node_settings,
    parse_endpoint,
    parse_nnodes,
)
from stratkit.launch.nodelink import NodeLink
from stratkit.launch.rendezvous import LOST_AFTER, SETTLE, RendezvousServer
from stratkit.launch.results import Attempt, saved_and_exited
from stratkit.launch.standby import STANDBY_VAR, TaskStandby, shared_env
from stratkit.launch.supervisor import Supervisor
from stratkit.process.reaper import Reaper
from stratkit.process.report import TaskFailure, is_preempted, signal_name
from stratkit.status import EXIT_PREEMPTED
from stratkit.strategy.server import RUN_DIR_VAR

#: After a node vanished, seconds this node's tasks get between SIGTERM and SIGKILL (at most --stop-grace).
#: Their peer is gone, so they cannot reach the next step boundary (its agreement is a collective) and cannot
#: save there: the grace only lets a backup write already under way finish (a write is local once the replica
#: check's collective passed; measured 0.3-1.3 s). The full --stop-grace would be waited out for nothing.
VANISHED_GRACE = 2.0
#: Longest wait for the standby's imports before this node joins anyway (its tasks then start as new processes
#: until it is ready).
STANDBY_WAIT = 120.0


class _Remote:
    """The root cause of another node (or the rendezvous' loss), in the place of a local task."""

    def __init__(self, failure: TaskFailure) -> None:
        self._failure = failure

    def failure(self, attempt: int, timed_out_after: float | None, timeout_setting: str = "--timeout") -> TaskFailure:
        return self._failure

    def join_output(self, timeout: float = 0.0) -> None:
        pass


@dataclass
class NodeAttemptRunner(AttemptRunner):
    """One attempt of this node's tasks, with the cluster from the rendezvous; ends on another node's failure too."""

    link: NodeLink | None = None
    holds: Sequence[socket.socket] = ()
    reported: TaskFailure | None = None
    standby: TaskStandby | None = None

    def _start_process(self, env: dict[str, str]):  # type: ignore[no-untyped-def]
        forked = self.standby.fork(env) if self.standby is not None else None
        return forked if forked is not None else super()._start_process(env)

    def _place_tasks(self) -> list[TaskProcess]:
        assert self.link is not None
        cluster = self.link.cluster
        return [TaskProcess(t, self.number, cluster[t.role][t.index], h) for t, h in zip(self.plan.tasks, self.holds)]

    def _cluster(self, children: list[TaskProcess]) -> dict[str, list[str]]:
        assert self.link is not None
        return self.link.cluster

    def _verdict(self, running: list[TaskProcess], watch: _Watch, now: float):  # type: ignore[override]
        assert self.link is not None
        verdict = super()._verdict(running, watch, now)
        if verdict is not None:
            outcome, culprit, _ = verdict
            if outcome in ("failed", "timed_out", "preempted") and culprit is not None and self.reported is None:
                failure = culprit.failure(self.number, self.plan.timeout if outcome == "timed_out" else None)
                self.reported = self.named(failure)
                # now, before the stop grace: the other nodes stop at once (final: worker 0 had finished);
                # a preemption (75) too: the rendezvous restarts every node without counting it
                self.link.report(self.reported, final=verdict[2])
            return verdict
        if self.link.resize:  # the membership changed: stop this round's tasks; every node joins the next one
            # SIGTERM is their preemption notice: they save at the next step boundary and exit 75, and the next
            # round resumes there (after a node vanished they cannot: see VANISHED_GRACE)
            self._stop(running, "resize", grace=min(VANISHED_GRACE, self.plan.stop_grace) if self.link.vanished
                       else None)
            timeline.mark("tasks stopped")
            return "resized", None, False
        if self.link.decision is False:  # node 0's worker 0 finished and the rest had --exit-grace: stop, a success
            names = ", ".join(c.task.name for c in running)
            self.console.say(f"{names} still running {self.plan.exit_grace:g} s after worker:0 (on node 0) finished: "
                             "stopping them (not a failure: training is done; raise --exit-grace to wait longer)")
            self._stop(running, "after_success")
            return "succeeded", None, True
        remote = self.link.decision if isinstance(self.link.decision, TaskFailure) else None
        if remote is None and self.link.lost:
            remote = self.link.lost_failure()
        if remote is not None:
            return "failed", _Remote(remote), watch.primary_done is not None  # type: ignore[return-value]
        return None

    def named(self, failure: TaskFailure) -> TaskFailure:
        assert self.link is not None
        return dataclasses.replace(failure, task=f"{failure.task} on node {self.link.node} ({self.link.address})")


class NodeSupervisor(Supervisor):
    """The supervisor of one node: the rendezvous around the local attempt (see the module docstring)."""

    def __init__(self, plan: LaunchPlan, settings: NodeSettings) -> None:
        super().__init__(plan)
        self.settings = settings
        self.server: RendezvousServer | None = None
        self.standby: TaskStandby | None = None

    def run(self):  # type: ignore[no-untyped-def]
        s = self.settings
        try:
            if s.elastic:  # the survivors stop their tasks (up to --stop-grace) before they rejoin
                self.server = ElasticRendezvous(s.host, s.port, s.token, s.min_nodes, s.nnodes, s.workers_per_node,
                                                max_restarts=self.plan.max_restarts, last_call=s.last_call,
                                                rejoin_grace=self.plan.stop_grace + LOST_AFTER,
                                                exit_grace=self.plan.exit_grace, gpus=len(self.plan.gpu.visible))
            else:
                self.server = RendezvousServer(s.host, s.port, s.token, s.nnodes, s.workers_per_node,
                                               attempts=self.plan.attempts, exit_grace=self.plan.exit_grace,
                                               chief=s.chief, ps=s.ps, gpus=len(self.plan.gpu.visible))
        except OSError:
            self.server = None  # the endpoint is another machine's address (or another launcher's here): join it
        try:
            # elastic: TensorFlow imported once, while this node connects, and every round's tasks forked from it
            if s.elastic:
                self.standby = TaskStandby.start(self.plan.command, shared_env(self.plan.env, self.plan.extra_env))
            return super().run()
        finally:
            if self.server is not None:
                self.server.close()
            if self.standby is not None:
                self.standby.close()

    def _open_network(self) -> PrivateNetwork | None:
        role = (f"serving the rendezvous on {self.settings.endpoint}" if self.server is not None
                else f"joining the rendezvous at {self.settings.endpoint}")
        extra = (" (node 0 also runs the chief" + (f"; ps tasks: node (j + 1) mod {self.settings.nnodes})"
                                                   if self.settings.ps else ")")) if self.settings.chief else ""
        nodes = (f"{self.settings.min_nodes} to {self.settings.nnodes} nodes (elastic; --rdzv-last-call "
                 f"{self.settings.last_call:g} s)" if self.settings.elastic else f"{self.settings.nnodes} nodes")
        self.console.say(f"{nodes}, {self.settings.workers_per_node} worker(s) each{extra}; {role}. "
                         f"WARNING: the tasks use the machine's network (TensorFlow's gRPC servers cannot be "
                         f"protected across hosts): {CROSS_HOST_SECURITY}")
        self.console.event("exposed", host=self.settings.host)
        return None

    def _attempts(self, reaper: Reaper) -> list[Attempt]:
        """Join the round of each attempt, run this node's tasks, follow the decision (restart or end)."""
        attempts: list[Attempt] = []
        number = 0
        while number < self.plan.attempts or self.settings.elastic:
            if self.signals:
                break
            attempt, restart = self._attempt(number, reaper)
            number += 1
            attempts.append(attempt)
            if not restart or self.signals:
                break
            if attempt.outcome == "resized":  # not a failure: not counted against --max-restarts
                continue
            failure = attempt.failure
            assert failure is not None
            if attempt.outcome == "preempted":  # every task saved at one step: not counted either
                if not self.settings.elastic:  # one more round (the rendezvous allows it too)
                    self.plan = dataclasses.replace(self.plan, max_restarts=self.plan.max_restarts + 1)
                self.console.say(f"attempt {len(attempts)} was preempted: {failure.task} {failure.reason}")
                self.console.say("restarting the whole cluster on every node (a preemption is not counted against "
                                 "--max-restarts); it resumes at the step its preemption backup holds")
                self.console.event("preempted", attempt=attempt.number, task=failure.task)
                continue
            restarts = sum(a.outcome not in ("resized", "preempted") for a in attempts)
            of = "" if self.settings.elastic else f" of {self.plan.attempts}"
            self.console.say(f"attempt {len(attempts)}{of} failed: {failure.task} {failure.reason}")
            self.console.say(f"restarting the whole cluster on every node (restart {restarts} of "
                             f"{self.plan.max_restarts}); a script using Trainer.fit(backup_dir=...) on storage "
                             "every node shares resumes at its newest backup (epoch, or step with backup_every)")
        if self.settings.elastic:  # the final "attempt N of M" counts the rounds this node ran
            self.plan = dataclasses.replace(self.plan, max_restarts=max(self.plan.max_restarts, len(attempts) - 1))
        return attempts

    def _attempt(self, number: int, reaper: Reaper) -> tuple[Attempt, bool]:
        s = self.settings
        link = NodeLink(s.host, s.port, s.token, serving=self.server is not None,
                        workers_per_node=s.workers_per_node, join_timeout=s.join_timeout, say=self.console.say,
                        chief=s.chief, ps=s.ps, gpus=len(self.plan.gpu.visible))
        holds: list[socket.socket] = []
        try:
            address = link.connect(number)
            holds = reserve_ports(address, s.slots)
            self._await_standby()
            if self.signals:  # stopped while the standby imported: nothing started yet
                return Attempt(number, "interrupted", (), 0.0), False
            link.join([h.getsockname()[1] for h in holds])
            if isinstance(link.decision, TaskFailure):  # an elastic rendezvous ended below MIN before forming
                self.console.event("attempt_end", attempt=number, outcome="failed", seconds=0.0, tasks=[])
                return Attempt(number, "failed", (), 0.0, link.decision), False
            tasks = [Task(t.role, t.index) for t in link.tasks]  # the launcher's Task: it names the log file
            for hold in holds[len(tasks):]:  # a node with fewer tasks than the busiest frees the rest
                hold.close()
            holds = holds[:len(tasks)]
            plan = dataclasses.replace(self.plan, tasks=tasks, extra_env={**self.plan.extra_env,
                                                                          RUN_DIR_VAR: link.run_dir})
            if s.elastic:  # the rendezvous numbers the rounds (a late node's first is not round 0)
                number = link.round
                plan = dataclasses.replace(plan, max_restarts=max(plan.max_restarts, number))
                self._membership(link)
            self.console.say(f"node {link.node} of {len(link.hosts)} ({address}): "
                             f"{', '.join(t.name for t in tasks)}")
            runner = NodeAttemptRunner(plan, number, self.console, reaper, None, self.signals, link=link, holds=holds,
                                       standby=self.standby)
            attempt = self._decided(runner.run(), runner, link)
            return attempt, link.restart and attempt.outcome != "succeeded"
        finally:
            for hold in holds:
                hold.close()
            link.close()
            if link.run_dir:
                shutil.rmtree(link.run_dir, ignore_errors=True)

    def _await_standby(self) -> None:
        """Before this node joins a round: its standby's imports done, so the round's tasks fork at once (an
        arriving node keeps the running ones training meanwhile). A standby that failed is dropped, said once."""
        standby = self.standby
        if standby is None or standby.ready:
            return
        if standby.error is None:
            self.console.say("importing TensorFlow in this node's standby before joining (every round's tasks are "
                             f"forked from it; {STANDBY_VAR}=0 starts each task as a new process instead)")
        deadline = time.monotonic() + STANDBY_WAIT
        while not standby.wait_ready(0.2) and standby.error is None and not self.signals \
                and time.monotonic() < deadline:
            pass  # (in slices: a signal to the launcher is not kept waiting)
        if standby.ready:
            self.console.event("standby", pid=standby.pid, import_seconds=standby.import_seconds)
        elif standby.error is not None:
            self.console.say(f"this node's standby cannot fork tasks: {standby.error}; starting each task as a new "
                             "process")
            standby.close()
            self.standby = None

    def _membership(self, link: NodeLink) -> None:
        """Say (and record) the membership change that led to this round, on every node alike."""
        size = len(link.cluster.get("worker", []))
        if link.change:
            self.console.say(link.change)
        self.console.event("membership", round=link.round, world_size=size, nodes=len(link.hosts),
                           change=link.change, node=link.node)

    def _resized(self, attempt: Attempt, link: NodeLink) -> Attempt:
        self.console.say(f"membership change ({link.resize}): this node's tasks stopped; joining the next round "
                         "(not a failure: not counted against --max-restarts)")
        self.console.event("resize", attempt=attempt.number, why=link.resize)
        return attempt

    def _decided(self, attempt: Attempt, runner: NodeAttemptRunner, link: NodeLink) -> Attempt:
        """This node's attempt as every node reports it: with the rendezvous' decision."""
        if attempt.outcome == "resized":
            return self._resized(attempt, link)
        if attempt.outcome == "interrupted":
            signum = self.signals[0] if self.signals else 0
            node = f"node {link.node} ({link.address})"
            if signum in self.plan.preemption_signals and saved_and_exited(attempt):
                # The machine is being taken: every worker saved at one step. Elastic: this node leaves and the
                # others go on from that step; else every node ends with 75 and the job's restart resumes there.
                link.report(TaskFailure(node, EXIT_PREEMPTED, ended=f"its launcher was preempted by "
                                        f"{signal_name(signum)}: every task saved at one step and exited "
                                        f"{EXIT_PREEMPTED}"), final=True)
                if self.server is not None:  # the decision must reach the others before this rendezvous closes
                    link.wait(SETTLE + 2.0)
            else:
                link.report(TaskFailure(node, None, ended=f"its launcher was stopped by {signal_name(signum)}"),
                            final=True)
            return attempt
        if runner.reported is None and link.decision is None and not link.lost:
            link.report(None, final=attempt.after_success)  # this node's tasks succeeded
        # Wait for the decision: after a success, as long as the other nodes train (heartbeats bound it).
        # (elastic: a failure waits for a silent node's verdict, up to LOST_AFTER more)
        bound = SETTLE + LOST_AFTER * (2 if self.settings.elastic else 1)
        while not link.wait(0.2 if attempt.outcome == "succeeded" else bound):
            if self.signals or attempt.outcome != "succeeded":
                break
        if link.resize:  # this node's tasks failed because a node was lost (or one arrived): not a failure
            return self._resized(dataclasses.replace(attempt, outcome="resized", failure=None), link)
        decision = link.decision
        if decision is False:
            return attempt
        failure = decision if isinstance(decision, TaskFailure) else (
            link.lost_failure() if link.lost else (runner.reported or attempt.failure))
        if failure is None:  # no decision (e.g. stopped while waiting): as this node saw it
            return attempt
        outcome = ("timed_out" if failure.timed_out_after is not None else
                   "preempted" if is_preempted(failure.returncode) else "failed")
        # This node's own root cause is the report's head, not one of its "other tasks".
        others = tuple(t for t in attempt.tasks if not (t.pid == failure.pid and failure.task.startswith(t.task + " ")))
        return dataclasses.replace(attempt, outcome=outcome, failure=failure, tasks=others)


def launch_node(command: Sequence[str], *, nnodes: int | str, rdzv_endpoint: str | None,
                workers_per_node: int | str = 1,
                chief: bool = False, ps: int = 0, rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT,
                rdzv_last_call: float = DEFAULT_LAST_CALL, max_restarts: int = 0,
                log_dir: str | os.PathLike[str] | None = None, timeout: float | None = None,
                exit_grace: float = 30.0, stop_grace: float = 10.0, env: Mapping[str, str] | None = None,
                stdout: IO[str] | None = None, stderr: IO[str] | None = None, handle_signals: bool = True,
                gpus_per_worker: int | None = None, gpus_per_ps: int | None = None, share_gpus: bool = False,
                preemption_signal: str | int | None = None):
    """Run this node's share of an `nnodes`-machine cluster (see the module docstring); returns a LaunchResult.

    Each node splits its own GPUs among its own tasks (`stratkit.launch.plan.GpuRequest`, as locally;
    `workers_per_node="gpu"`: one worker per GPU of the node) and reports its GPU count when it joins:
    the rendezvous refuses, on every node, a cluster whose nodes show different counts.

    Raises:
        ConfigError: on a bad flag, a missing token or a refused join, naming the flag and the fix.
    """
    base_env = dict(os.environ if env is None else env)
    workers_per_node = resolve_workers(workers_per_node, base_env, "--workers-per-node")  # node 0's chief: see docs
    settings = node_settings(nnodes, rdzv_endpoint, workers_per_node, rdzv_timeout, base_env, chief, ps,
                             rdzv_last_call)
    plan = plan_launch(command, workers=settings.nnodes * workers_per_node, chief=settings.chief, ps=settings.ps,
                       evaluator=False,
                       max_restarts=max_restarts,
                       log_dir=log_dir, host=settings.host, base_port=None, timeout=timeout, exit_grace=exit_grace,
                       stop_grace=stop_grace, env=base_env, stdout=stdout, stderr=stderr,
                       handle_signals=handle_signals, private_network=False, gpus_per_worker=gpus_per_worker,
                       gpus_per_ps=gpus_per_ps, share_gpus=share_gpus, preemption_signal=preemption_signal,
                       machines=layout.node_tasks(settings.nnodes, workers_per_node, settings.chief, settings.ps))
    for key, value in thread_env(settings.slots).items():  # this node's share of its cores
        if key not in base_env:
            plan.extra_env[key] = value
    if settings.elastic:  # Trainer keeps the global batch across these world sizes
        plan.extra_env[ELASTIC_VAR] = f"{settings.min_nodes * workers_per_node}:{settings.nnodes * workers_per_node}"
    # (each attempt's STRATKIT_RUN_DIR comes from the rendezvous: one path on every node)
    return NodeSupervisor(plan, settings).run()
