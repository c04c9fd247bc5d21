"""A preemption notice when the steps slow down: where every worker stops, and what a restart trains again.

Issue 44's acceptance, measured: `stratkit launch --workers 2` runs the step-backup tests' script
(`tests/training/checkpoint_script.py`: `backup_every=7`, epochs of 10 steps, EarlyStopping,
ReduceLROnPlateau, ModelCheckpoint, CSVLogger) with 20 ms steps; worker 1 signals itself SIGTERM before global
step 23 and from then on its steps take 1 s (the chief waits for it in each step's all-reduce), and 5 s
after the SIGTERM it gets SIGKILL, as a platform's grace period ends. The launcher restarts the cluster
(a preemption is not counted against `--max-restarts 0`) and the second attempt trains to the end.

Per run, from the runs' own records (each worker logs every step it trained with the time it ended; the
launcher's events.jsonl has every exit): each worker's exit status in the first attempt (75: saved and
exited; -9: the grace period ended first), the boundary it stopped at, the seconds from the SIGTERM to the
last exit, and the steps trained in both attempts. A run passes when both workers exit 75 at the same
boundary, one step after the notice's step or two (the end of the step it came in, or of the next), and at
most one step is trained again.

`--base REF` also runs a git ref of stratkit (a temporary worktree, its `stratkit` on the tasks' PYTHONPATH),
alternating with this tree run by run: today's code against the change. The 1-minute load average is
recorded before and after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_result
from jobs import clean_env, python

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "training" / "checkpoint_script.py"
NOTICE_AT = 23


def one_run(tree: Path, out: Path, after_notice: float, timeout: float) -> dict:
    """One launch: the notice on worker 1 before step NOTICE_AT, then the restart to the end."""
    env = clean_env(OUT=str(out), BACKUP_DIR=str(out / "backup"), KILL_AT=str(NOTICE_AT), KILL_RANK="1",
                    KILL_SIGNAL="TERM", STEP_SECONDS="0.02", AFTER_NOTICE_SECONDS=str(after_notice),
                    PYTHONUNBUFFERED="1")
    for name in [n for n in env if n.startswith(("STRATKIT_", "SLURM_"))]:
        env.pop(name)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(REPO / "tests")])
    logs = out / "logs"
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    done = subprocess.run([python(), "-m", "stratkit.cli", "launch", "--workers", "2", "--max-restarts", "0",
                           "--log-dir", str(logs), "--", python(), str(SCRIPT)], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=str(out), check=False)
    wall = time.monotonic() - started
    events = [json.loads(line) for line in (logs / "events.jsonl").read_text().splitlines()]
    first = [e for e in events if e["event"] in ("exit", "stopped") and e["attempt"] == 0]
    sent = json.loads((out / "signal-1.json").read_text())
    workers = []
    for rank in (0, 1):
        lines = [line.split() for line in (out / f"steps-{rank}.log").read_text().splitlines()]
        attempts = {a: [int(s) for b, s in lines if b == a] for a in {b for b, _ in lines}}
        trained = attempts.get("0", [])
        later = {s for a, steps in attempts.items() if a != "0" for s in steps}
        again = len(set(trained) & later) if later else None   # None: no restart ran (the launch failed)
        workers.append({"stopped_at": max(trained) + 1 if trained else None, "retrained": again})
    codes = sorted(e["returncode"] for e in first)
    stops = [w["stopped_at"] for w in workers]
    row = {"exit codes": codes, "notice step": sent["step"], "stopped at": stops,
           "s to last exit": round(max(e["time"] for e in first) - sent["time"], 2) if first else None,
           "retrained": None if None in [w["retrained"] for w in workers] else max(w["retrained"] for w in workers),
           "launch ok": done.returncode == 0,
           "wall s": round(wall, 1), "load before": load_before, "load after": os.getloadavg()[0]}
    row["pass"] = (codes == [75, 75] and stops[0] == stops[1] and sent["step"] + 1 <= stops[0] <= sent["step"] + 2
                   and row["retrained"] is not None and row["retrained"] <= 1 and done.returncode == 0)
    if done.returncode:
        row["launcher tail"] = done.stderr[-1500:]
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--base", help="a git ref of stratkit to run alternately (today's code)")
    parser.add_argument("--after-notice", type=float, default=1.0, help="seconds per step after the notice")
    parser.add_argument("--quick", action="store_true", help="one run (proves the machinery)")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args(argv)
    runs = 1 if args.quick else args.runs
    trees = {"this": REPO}
    worktree, base_commit = None, None
    if args.base:
        commit = subprocess.run(["git", "rev-parse", args.base], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.strip()
        worktree = Path(tempfile.mkdtemp(prefix="stratkit-base-"))
        subprocess.run(["git", "worktree", "add", "--detach", "-f", str(worktree), commit], cwd=REPO, check=True,
                       capture_output=True)
        trees["base"] = worktree
        base_commit = commit
    rows: list[dict] = []
    try:
        for index in range(runs):
            order = list(trees) if index % 2 == 0 else list(reversed(trees))
            for name in order:
                with tempfile.TemporaryDirectory(prefix="bench-notice-") as scratch:
                    row = {"tree": name, "run": index + 1, **one_run(trees[name], Path(scratch), args.after_notice,
                                                                     args.timeout)}
                print(f"[bench_notice] {row}", flush=True)
                rows.append(row)
    finally:
        if worktree is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, capture_output=True,
                           check=False)
    summary = {name: {"runs": sum(r["tree"] == name for r in rows), "passed": sum(r["pass"] for r in rows
                                                                                  if r["tree"] == name)}
               for name in trees}
    print_table("A notice on worker 1 before step 23, steps of 1 s after it, SIGKILL 5 s after it",
                [{k: v for k, v in r.items() if k != "launcher tail"} for r in rows])
    print(f"\npassed: {summary}")
    payload = {"quick": args.quick, "after_notice_s": args.after_notice, "notice_at": NOTICE_AT,
               "base": args.base, "base_commit": base_commit, "summary": summary, "rows": rows}
    write_result("notice-quick" if args.quick else "notice", payload)
    return payload


if __name__ == "__main__":
    main()
