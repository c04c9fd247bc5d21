"""A preemption notice is acted on within one step, whatever the step time (issue #44's acceptance, small).

Two real workers (`checkpoint_script.py`, `backup_every=7`, epochs of 10 steps): the steps take 20 ms, then
one worker signals itself SIGTERM before global step 23 and from then on its steps take 1 s (the other
worker waits for it in each step's all-reduce, so every step of the cluster takes 1 s); 5 s after the
SIGTERM that worker gets SIGKILL, as a platform's grace period ends. Every worker must stop at the same
step boundary, at the end of the step the notice came in or of the next one, write its backup there and
exit with 75 inside the grace period; the resume point then re-trains at most one step. Once with the
notice on the other worker, once on the chief (the coordination leader itself) with `backup_every="0.3s"`,
whose timed backups every worker must write at the chief's step. `benchmarks/bench_notice.py` runs the first
case 10 times.

The steps each worker trained come from its own log (`steps-<rank>.log`, written after each step); the
resume point from the backups on disk, read as a restart reads them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from procs import describe, free_ports, run_cluster, worker_tf_configs

pytestmark = [pytest.mark.slow, pytest.mark.multiworker]

SCRIPT = str(Path(__file__).with_name("checkpoint_script.py"))
NOTICE_AT = 23
STEPS_PER_EPOCH = 10


def run_noticed(out: Path, rank: int, after_notice: float = 1.0, every: str = "7") -> dict:
    """One first attempt with a SIGTERM to `rank` before step NOTICE_AT; what each worker did."""
    from stratkit.training.checkpoint import find_resume_point, read_metadata, worker_backup_dir

    out.mkdir(parents=True, exist_ok=True)
    env = {"OUT": str(out), "BACKUP_DIR": str(out / "backup"), "KILL_AT": str(NOTICE_AT), "KILL_RANK": str(rank),
           "KILL_SIGNAL": "TERM", "STEP_SECONDS": "0.02", "AFTER_NOTICE_SECONDS": str(after_notice),
           "BACKUP_EVERY": every, "STRATKIT_PREEMPTION_SIGNAL": None}
    results = run_cluster(SCRIPT, worker_tf_configs(free_ports(2)), env=env, timeout=240, grace_after_failure=30)
    sent = json.loads((out / f"signal-{rank}.json").read_text())
    workers = []
    for result in results:
        lines = [line.split() for line in (out / f"times-{result.index}.log").read_text().splitlines()]
        trained = [(int(step), float(at)) for attempt, step, at in lines if attempt == "0"]
        directory = worker_backup_dir(str(out / "backup"), result.index == 0, result.index)
        point = find_resume_point(directory)
        resume = point.position.epoch * STEPS_PER_EPOCH + point.position.step
        workers.append({"returncode": result.returncode, "last_step": max(s for s, _ in trained),
                        "last_step_ended": max(t for s, t in trained) - sent["time"], "resume": resume,
                        "retrained": max(s for s, _ in trained) + 1 - resume,
                        "backups": sorted(read_metadata(directory).backups)})
    return {"notice_step": sent["step"], "workers": workers, "results": results}


@pytest.mark.parametrize("rank,every", [(1, "7"), (0, "0.3s")],
                         ids=["notice-on-worker-1", "notice-on-the-chief-with-a-timed-schedule"])
def test_every_worker_stops_within_one_step_of_a_notice_when_steps_slow_down(tmp_path, rank, every):
    run = run_noticed(tmp_path, rank, every=every)
    workers, why = run["workers"], describe(run["results"])
    assert [w["returncode"] for w in workers] == [75, 75], (workers, why)  # both saved and exited, none SIGKILLed
    assert run["notice_step"] == NOTICE_AT
    # One boundary for every worker: the end of the notice's step (23) or of the next one, not an agreement later
    assert workers[0]["resume"] == workers[1]["resume"] in (NOTICE_AT + 1, NOTICE_AT + 2), (workers, why)
    for worker in workers:
        assert worker["last_step"] <= NOTICE_AT + 1, workers
        assert worker["retrained"] <= 1, workers  # a restart resumes where it stopped
    # the backups kept (the preemption's and the one before): the same steps on both workers; with "0.3s" the
    # one before is the chief's clock's, which reached the other worker the same way
    assert workers[0]["backups"] == workers[1]["backups"] and len(workers[0]["backups"]) == 2, workers
