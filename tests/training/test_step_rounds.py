"""The out-of-band step agreement (`stratkit/training/checkpoint/agreement.py` `Rounds`), worker by worker.

Each worker is a thread with its own `Rounds` and `Notice`, training "steps" (a barrier, as each step's
all-reduce, then a sleep) and calling `decide` at every boundary as `Backup` does; they share a key-value store with the contract measured of TensorFlow's
coordination service (an insert of an existing key is refused; a get blocks until the key is inserted or
its timeout passes; a get for a key a dead worker would have written never returns by itself). The real
store between real processes: `test_notice_within_a_step.py`.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from stratkit.strategy.keras_compat.coordination import StoreError
from stratkit.training.checkpoint import agreement
from stratkit.training.checkpoint.agreement import Rounds
from stratkit.training.checkpoint.preemption import Notice


class MemoryStore:
    """A key-value store shared by threads, with the coordination service's contract."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.changed = threading.Condition()
        self.down = False

    def insert(self, key: str, value: str) -> bool:
        with self.changed:
            if self.down:
                raise StoreError("Socket closed")
            if key in self.values:
                return False
            self.values[key] = value
            self.changed.notify_all()
            return True

    def get(self, key: str, timeout: float | None = None) -> str | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.changed:
            while key not in self.values:
                if self.down:
                    raise StoreError("Socket closed")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self.changed.wait(left)
            return self.values[key]

    def fail(self) -> None:
        with self.changed:
            self.down = True
            self.changed.notify_all()


def _notify(notice: Notice) -> None:
    """What the signal handler does at a SIGTERM (the handler itself, without installing it)."""
    notice._on_signal(signal.SIGTERM, None)


def _train(rounds: Rounds, notice: Notice, steps: int, step_seconds, notice_at: int | None, out: dict,
           rank: int, due_at: int | None, allreduce: threading.Barrier) -> None:
    rounds.start(notice)
    stopped, backups = None, []
    for step in range(steps):
        stop, backup = rounds.decide(notice.noticed, due_at is not None and step >= due_at and not backups)
        if backup:
            backups.append(step)
        if stop:
            stopped = step
            break
        allreduce.wait(timeout=30)   # the step's all-reduce: no worker finishes a step before every one began it
        if notice_at is not None and step == notice_at:
            _notify(notice)          # the notice arrives during this step
        time.sleep(step_seconds(step) if callable(step_seconds) else step_seconds)
    out[rank] = {"stopped": stopped, "backups": backups}
    rounds.close()


def _run(workers: int, steps: int, step_seconds, notices: dict[int, int], store=None, due_at=None,
         count: int | None = None, namespace: str = "fit") -> tuple[dict, list[Rounds]]:
    store = store or MemoryStore()
    rounds = [Rounds(store, rank, count or workers, namespace=namespace) for rank in range(workers)]
    out: dict = {}
    allreduce = threading.Barrier(workers)
    threads = [threading.Thread(target=_train, args=(rounds[rank], Notice((signal.SIGTERM,)), steps, step_seconds,
                                                     notices.get(rank), out, rank, due_at if rank == 0 else None,
                                                     allreduce))
               for rank in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    return out, rounds


def test_a_notice_stops_every_worker_at_one_boundary_within_a_step_of_it():
    # 20 ms steps, then 0.3 s steps once worker 1 was told: the boundary comes one step later, not many
    out, rounds = _run(2, 200, lambda step: 0.3 if step >= 40 else 0.02, {1: 40})
    assert out[0]["stopped"] == out[1]["stopped"] in (41, 42), out
    for each in rounds:   # the watcher and the notice thread ended with the fit
        assert not any(thread.is_alive() for thread in each._threads)


def test_notices_on_every_worker_at_once_make_one_stop_round():
    store = MemoryStore()
    out, _ = _run(3, 200, 0.01, {0: 30, 1: 30, 2: 30}, store=store)
    assert out[0]["stopped"] == out[1]["stopped"] == out[2]["stopped"] in (31, 32), out
    stops = [key for key, value in store.values.items() if value.startswith("stop ")]
    assert len(stops) == 1, store.values


def test_the_chiefs_timed_backup_is_written_by_every_worker_at_one_boundary_once():
    out, _ = _run(2, 60, 0.005, {}, due_at=25)
    assert out[0]["backups"] == out[1]["backups"] and len(out[0]["backups"]) == 1, out
    assert out[0]["backups"][0] in (25, 26), out


def test_a_notice_after_the_last_step_stops_nothing_and_the_fit_ends():
    out, _ = _run(2, 10, 0.01, {1: 9})
    assert out[0]["stopped"] is None and out[1]["stopped"] is None, out


def test_a_worker_that_never_answers_does_not_hang_the_noticed_worker(monkeypatch, caplog):
    monkeypatch.setattr(agreement, "REPLY_TIMEOUT", 0.5)
    caplog.set_level(logging.WARNING)
    started = time.monotonic()
    out, _ = _run(1, 200, 0.01, {0: 20}, count=2)   # worker 1 of 2 is gone: it never answers
    assert 21 <= out[0]["stopped"] <= 30, out         # it stops alone, at a boundary soon after (no peer)
    assert time.monotonic() - started < 10
    assert "worker 1 did not answer within" in caplog.text and "stops alone" in caplog.text


def test_a_coordination_service_that_stops_answering_leaves_a_noticed_worker_to_stop_alone(caplog):
    store = MemoryStore()
    store.fail()
    caplog.set_level(logging.WARNING)
    out, _ = _run(1, 100, 0.01, {0: 10}, store=store, count=2)
    assert out[0]["stopped"] == 11, out
    assert "coordination service stopped answering" in caplog.text or "round failed" in caplog.text


def test_a_second_fit_in_the_process_uses_keys_of_its_own():
    assert Rounds(MemoryStore(), 0, 2).namespace != Rounds(MemoryStore(), 0, 2).namespace   # one per fit
    store = MemoryStore()
    first, _ = _run(2, 100, 0.005, {1: 20}, store=store, namespace="fit-1")
    second, _ = _run(2, 100, 0.005, {}, store=store, namespace="fit-2")   # the first fit's stop round is not its
    assert first[0]["stopped"] in (21, 22) and second[0]["stopped"] is None and second[1]["stopped"] is None
