"""Parameter-server throughput: 2 workers vs 1 worker, same model, same global batch per step.

Each configuration is a real cluster of processes on 127.0.0.1 (chief, N
workers, 1 ps), every task running the same script through `stratkit.Trainer`
and `trainer.fit`. The figure is the chief's steady-state examples/sec (the
median over the epochs after the first, which includes tracing and connection
warm-up), and the ratio 2 workers / 1 worker (goal: >= 1.6) of the medians over
rounds that alternate the two configurations.

Read the ratio against the machine: every task is a process on this host, so
two workers only help when there are idle cores for them. On a 2-core machine
the chief, the ps and both workers share those 2 cores, and the ratio cannot
approach 2 whatever the framework does; the JSON records the core count and
the load average before and after each run for that reason.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_result  # noqa: E402

TASK_VAR = "STRATKIT_BENCH_PS_TASK"

# Every task runs this; ps and worker tasks serve inside Trainer() and exit when the chief is done.
TASK = r"""
import json, os, sys
import stratkit

config = json.loads(os.environ["STRATKIT_BENCH_PS_TASK"])
trainer = stratkit.Trainer()
import keras, tensorflow as tf

dim, hidden, batch = config["dim"], config["hidden"], config["batch"]

def data(input_context):
    # One fixed synthetic batch made on the worker, repeated: measures training, not input.
    per_replica = input_context.get_per_replica_batch_size(batch)
    x = tf.random.stateless_normal([per_replica, dim], seed=[1, 2])
    y = tf.random.stateless_uniform([per_replica], seed=[3, 4], maxval=10, dtype=tf.int32)
    return tf.data.Dataset.from_tensors((x, y)).repeat()

def build():
    model = keras.Sequential([keras.Input((dim,)), keras.layers.Dense(hidden, activation="relu"),
                              keras.layers.Dense(hidden, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model

model = trainer.build(build)
history = trainer.fit(model, data, epochs=config["epochs"], steps_per_epoch=config["steps"],
                      global_batch_size=batch, verbose=0)
with open(config["result"], "w") as handle:
    json.dump({"examples_per_sec": history.history["examples_per_sec"], "steps": history.steps,
               "steps_scheduled": history.steps_scheduled}, handle)
"""


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def run_cluster(workers: int, config: dict, timeout: float) -> dict:
    """Start chief + `workers` workers + 1 ps, wait for all, return the chief's measurements."""
    ports = iter(_free_ports(workers + 2))
    cluster = {"chief": [f"127.0.0.1:{next(ports)}"],
               "worker": [f"127.0.0.1:{next(ports)}" for _ in range(workers)],
               "ps": [f"127.0.0.1:{next(ports)}"]}
    tasks = [(role, i) for role in ("chief", "worker", "ps") for i in range(len(cluster[role]))]
    with tempfile.TemporaryDirectory(prefix="stratkit-bench-ps-") as tmp:
        script = Path(tmp) / "task.py"
        script.write_text(TASK)
        result = Path(tmp) / "result.json"
        procs = []
        load_before = os.getloadavg()
        start = time.monotonic()
        try:
            for role, index in tasks:
                env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="",
                           TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": role, "index": index}}))
                env[TASK_VAR] = json.dumps({**config, "result": str(result)})
                log = open(Path(tmp) / f"{role}-{index}.log", "w+")  # noqa: SIM115 - closed below
                procs.append((role, index, log, subprocess.Popen([sys.executable, str(script)], env=env,
                                                                 stdout=log, stderr=subprocess.STDOUT,
                                                                 stdin=subprocess.DEVNULL, start_new_session=True)))
            deadline = start + timeout
            while any(p.poll() is None for *_, p in procs) and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            for *_, p in procs:  # never leave a task behind (a hung cluster would skew the next run)
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        wall = time.monotonic() - start
        failed = [(role, index, p.returncode, log) for role, index, log, p in procs if p.returncode != 0]
        if failed or not result.exists():
            details = []
            for role, index, code, log in failed:
                log.seek(0)
                details.append(f"--- {role}:{index} exit {code}\n{log.read()[-3000:]}")
            raise SystemExit(f"PS benchmark with {workers} worker(s) failed:\n" + "\n".join(details))
        for *_, log, _p in procs:
            log.close()
        measured = json.loads(result.read_text())
    rates = measured["examples_per_sec"]
    steady = rates[1:] or rates
    return {"workers": workers, "examples_per_sec": statistics.median(steady), "per_epoch": rates,
            "steps": measured["steps"], "steps_scheduled": measured["steps_scheduled"], "wall_seconds": wall,
            "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg())}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    parser.add_argument("--rounds", type=int, default=None, help="alternating 1/2-worker rounds (default 3; 1 quick)")
    args = parser.parse_args(argv)
    if args.quick:
        config = {"dim": 16, "hidden": 16, "batch": 32, "epochs": 2, "steps": 5}
    else:
        config = {"dim": 256, "hidden": 1024, "batch": 256, "epochs": 5, "steps": 40}
    rounds = args.rounds or (1 if args.quick else 3)
    runs = []
    for round_index in range(rounds):
        # Alternate the order, so a change in the machine's load hits both configurations alike.
        for workers in ((1, 2) if round_index % 2 == 0 else (2, 1)):
            runs.append(run_cluster(workers, config, timeout=300 if args.quick else 900))
    median = {n: statistics.median(r["examples_per_sec"] for r in runs if r["workers"] == n) for n in (1, 2)}
    ratio = median[2] / median[1]
    print_table("parameter-server training: chief's steady-state examples/sec (1 ps, async)",
                [{"workers": r["workers"], "examples/sec": r["examples_per_sec"], "steps": r["steps"],
                  "wall s": r["wall_seconds"], "load before": r["loadavg_before"][0]} for r in runs])
    print(f"\nmedian over {rounds} round(s): 1 worker {median[1]:,.0f}, 2 workers {median[2]:,.0f} examples/sec; "
          f"2 workers / 1 worker: {ratio:.2f}x (goal 1.6x; cores on this machine: {os.cpu_count()})")
    payload = {"quick": args.quick, "config": config, "rounds": rounds, "runs": runs,
               "median_examples_per_sec": {"1": median[1], "2": median[2]}, "ratio_2_vs_1": ratio,
               "goal_ratio": 1.6, "goal_met": ratio >= 1.6,
               "note": "all tasks (chief, workers, ps) share this machine's cores; see the module docstring"}
    print(f"wrote {write_result('ps' + ('-quick' if args.quick else ''), payload)}")
    return payload


if __name__ == "__main__":
    main()
