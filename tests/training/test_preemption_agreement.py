"""The per-step agreement of step backups (stratkit/training/checkpoint/agreement.py `Agreement`, used where no coordination service runs) on several workers.

Two workers are two threads here, each with its own `Agreement`, and their collective is a real exchange between
them (a barrier and a shared sum), so what is tested is the agreement's own rule: both take the same interval from
their timings, run the collective only every `interval` boundaries after the warm-up, and act on a notice one of
them saw at the same boundary, within `LATENCY` seconds of training.
"""

from __future__ import annotations

import threading
import time

from stratkit.training.checkpoint.agreement import Agreement


class TwoWorkers:
    """A SUM over two threads: each contributes its vector, both get the sum (a collective's contract)."""

    def __init__(self, cost: float) -> None:
        self.barrier = threading.Barrier(2)
        self.parts: dict[int, list[int]] = {}
        self.cost = cost
        self.calls = 0

    def reduce_for(self, rank: int):
        def reduce(values: list[int]) -> list[int]:
            self.parts[rank] = list(values)
            self.barrier.wait()
            total = [a + b for a, b in zip(self.parts[0], self.parts[1])]
            time.sleep(self.cost)            # the collective's fixed cost
            self.barrier.wait()
            if rank == 0:
                self.calls += 1
            return total
        return reduce


def _train(rank: int, agreement: Agreement, steps: int, step_seconds: float, notice_at: int | None,
           out: dict) -> None:
    decided = []
    for step in range(steps):
        noticed, _ = agreement.decide(notice_at is not None and step >= notice_at, False)
        if noticed:
            decided.append(step)
            break
        time.sleep(step_seconds)            # the step's training
    out[rank] = {"stopped": decided[0] if decided else None, "interval": agreement.interval}


def test_both_workers_take_one_interval_and_stop_at_the_same_boundary():
    workers = TwoWorkers(cost=0.004)
    agreements = [Agreement(workers.reduce_for(rank)) for rank in (0, 1)]
    out: dict = {}
    threads = [threading.Thread(target=_train, args=(rank, agreements[rank], 400, 0.002, 60 if rank == 1 else None,
                                                     out)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert out[0]["interval"] == out[1]["interval"] > 1, out        # a 4 ms collective on 2 ms steps: not each step
    # every boundary until the warm-up ends, then every `interval`-th one: far fewer collectives than boundaries
    assert workers.calls < Agreement.WARMUP + 60 // out[0]["interval"] + 2, (workers.calls, out)
    # the notice on worker 1 at boundary 60 stops both at the same, next agreed boundary, within LATENCY of training
    assert out[0]["stopped"] == out[1]["stopped"], out
    assert 60 <= out[0]["stopped"] < 60 + out[0]["interval"], out
    assert out[0]["interval"] * 0.002 <= Agreement.LATENCY


def test_one_process_decides_at_every_boundary_without_a_collective():
    agreement = Agreement(None)
    assert agreement.decide(False, False) == (False, False)
    assert agreement.decide(True, False) == (True, False)
    assert agreement.decide(False, True) == (False, True)
