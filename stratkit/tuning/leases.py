"""Trials as leases: who runs which trial, until when, and what happens to a lease that is not renewed.

A tuner that takes a trial holds a lease on it: (trial, run, tuner, deadline).
Its heartbeats push the deadline `timeout` seconds ahead; a tuner that dies
(SIGKILL: its connection closes, the lease then lives only `reconnect_grace`
more seconds) or hangs (SIGSTOP: no heartbeat) loses the lease when the
deadline passes. The trial then waits in the queue to run again, on whichever
tuner asks next, as run number `run + 1` (its files and backups are per run, so
a late message of the old run never mixes with the new one: `current` is the
fence). After `max_losses` lost leases the trial is given up (its planner ends
it as failed), so a trial that kills every tuner it runs on cannot stall the
search.

A pure data structure: the service (`stratkit.tuning.service`) calls it under
its lock and decides what a loss means to the planner.

Imports no TensorFlow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stratkit.tuning.planner import Proposal

#: Lost leases after which a trial is given up.
MAX_LOSSES = 3
#: Seconds a lease outlives its tuner's closed connection (time to reconnect after a network blip).
RECONNECT_GRACE = 3.0


@dataclass
class Lease:
    """One run of one trial on one tuner."""

    proposal: Proposal
    run: int
    tuner: int
    deadline: float
    #: The search's first trial: no other trial starts before its model built (`service.SearchService`).
    first: bool = False

    @property
    def trial_id(self) -> str:
        return self.proposal.trial_id

    def to_message(self, heartbeat: float) -> dict[str, Any]:
        return {"trial": self.trial_id, "run": self.run, "payload": self.proposal.payload,
                "seed": self.proposal.seed, "first": self.first, "heartbeat": heartbeat}


def proposal_to_json(proposal: Proposal) -> dict[str, Any]:
    return {"trial": proposal.trial_id, "payload": proposal.payload, "seed": proposal.seed}


def proposal_from_json(data: dict[str, Any]) -> Proposal:
    return Proposal(str(data["trial"]), dict(data.get("payload") or {}), int(data.get("seed") or 0))


class Leases:
    """The running trials (`active`), the trials waiting to run again (`queue`), and each trial's history."""

    def __init__(self, timeout: float, max_losses: int = MAX_LOSSES, reconnect_grace: float = RECONNECT_GRACE) -> None:
        self.timeout = float(timeout)
        self.max_losses = int(max_losses)
        self.reconnect_grace = float(reconnect_grace)
        self.active: dict[str, Lease] = {}
        self.queue: list[Proposal] = []
        #: Runs handed out per trial (the next run's number is this + 1, also after a restart).
        self.runs: dict[str, int] = {}
        #: Leases lost per trial.
        self.losses: dict[str, int] = {}

    def busy(self) -> bool:
        """Whether any trial runs or waits to run again."""
        return bool(self.active or self.queue)

    def held_by(self, tuner: int) -> Lease | None:
        """The lease `tuner` holds (the processes of one multi-worker trial share their tuner's lease)."""
        return next((lease for lease in self.active.values() if lease.tuner == tuner), None)

    def hand_out(self, proposal: Proposal, tuner: int, now: float, *, first: bool = False) -> Lease:
        run = self.runs.get(proposal.trial_id, 0) + 1
        self.runs[proposal.trial_id] = run
        lease = Lease(proposal, run, tuner, now + self.timeout, first)
        self.active[proposal.trial_id] = lease
        return lease

    def current(self, trial_id: str, run: int) -> Lease | None:
        """The active lease of `trial_id` if it is run `run` (else a stale run, or a trial not running)."""
        lease = self.active.get(trial_id)
        return lease if lease is not None and lease.run == run else None

    def beat(self, trial_id: str, run: int, now: float) -> bool:
        lease = self.current(trial_id, run)
        if lease is None:
            return False
        lease.deadline = max(lease.deadline, now + self.timeout)
        return True

    def close(self, trial_id: str, run: int) -> Lease | None:
        """End the lease (its trial's result arrived); None when it is not the current run."""
        lease = self.current(trial_id, run)
        if lease is not None:
            del self.active[trial_id]
        return lease

    def disconnected(self, tuner: int, now: float) -> None:
        """`tuner`'s last connection closed: its lease lives `reconnect_grace` s more, unless renewed."""
        for lease in self.active.values():
            if lease.tuner == tuner:
                lease.deadline = min(lease.deadline, now + self.reconnect_grace)

    def expire(self, now: float) -> list[Lease]:
        """Remove and return the leases past their deadline (oldest trial first)."""
        lost = [lease for lease in self.active.values() if lease.deadline <= now]
        for lease in lost:
            del self.active[lease.trial_id]
            self.losses[lease.trial_id] = self.losses.get(lease.trial_id, 0) + 1
        return lost

    def requeue(self, proposal: Proposal) -> bool:
        """Queue the trial to run again; False when it lost `max_losses` leases (give it up)."""
        if self.losses.get(proposal.trial_id, 0) >= self.max_losses:
            return False
        if all(p.trial_id != proposal.trial_id for p in self.queue):
            self.queue.append(proposal)
        return True

    def take(self) -> Proposal | None:
        """The trial that waited longest to run again."""
        return self.queue.pop(0) if self.queue else None

    def shift(self, seconds: float) -> None:
        """Move every deadline `seconds` later (the service's own process was stopped that long)."""
        for lease in self.active.values():
            lease.deadline += seconds

    # -- state ----------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """JSON: what a restarted service needs (the running trials become trials to run again)."""
        return {"runs": dict(self.runs), "losses": dict(self.losses),
                "queue": [proposal_to_json(p) for p in self.queue],
                "active": [proposal_to_json(lease.proposal) for lease in self.active.values()]}

    def restore(self, state: dict[str, Any]) -> None:
        self.runs = {str(k): int(v) for k, v in (state.get("runs") or {}).items()}
        self.losses = {str(k): int(v) for k, v in (state.get("losses") or {}).items()}
        self.active = {}
        self.queue = []
        for item in list(state.get("active") or []) + list(state.get("queue") or []):
            self.requeue(proposal_from_json(item))


__all__ = ["MAX_LOSSES", "RECONNECT_GRACE", "Lease", "Leases", "proposal_from_json", "proposal_to_json"]
