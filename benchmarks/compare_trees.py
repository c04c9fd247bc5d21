"""Side by side: the same training jobs on two stratkit trees (a git ref vs this checkout), alternating rounds.

    python benchmarks/compare_trees.py --base REF [--rounds 4] [--jobs scaling,mirrored,graph]

For a change that must cost nothing measurable ("within 2% of today"): one
figure per tree from one run cannot tell 2% from the noise of 2 shared cores,
so each round runs every job on both trees, in alternating order, and the
result is the per-round ratio (this tree / base) with its mean, min, max and
spread, plus the load average around each job.

Jobs (the launcher and the task scripts come from this checkout; only the
`stratkit` the tasks import differs, through PYTHONPATH):

* ``scaling``: bench_scaling's 2-worker MultiWorkerMirrored job (ResNet-style
  net, 9 BatchNormalization layers, through `stratkit.Trainer` and `stratkit
  launch`), steady-state examples/s and CPU time per step (both workers);
* ``mirrored``: the same net through `model.fit` on a local MirroredStrategy over
  2 logical CPUs (one process), steady-state steps/s and CPU time per step (the
  process's, which the other load on a shared machine moves far less). Its thread
  pools are set (``--mirrored-threads``, default 1 intra-op, 2 inter-op): with
  TensorFlow's defaults the two replica threads and the pools' spinning threads
  share 2 cores in one of two ways, and both trees flip between ~4.5 and ~6.5
  steps/s from run to run (6 rounds on an idle machine: ratios 0.69-1.81), which
  hides any 2% difference; with the pools set, 6 runs stayed within 6.3-7.1.
* ``graph``: what the clock cannot settle: the ops in the mirrored job's traced
  train step (every op type counted, nested functions included) and how many
  times it was traced. The same count on both trees means the same work per
  step; a retrace or an added collective shows here whatever the load.
* ``backups``: 2 workers under `stratkit launch`, `Trainer.fit(backup_dir=...,
  backup_every=10)` of bench_backups' small MLP (256-512-512-10), 40 steps of
  global batch 64 per epoch, 3 epochs: steps/s over epochs 2-3 (the step backups
  and whatever agrees on notices included) and CPU time per step (both workers).

The base tree is a temporary `git worktree` of REF, removed afterwards.
Results: benchmarks/results/compare-trees.json (one entry per run, kept).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from bench_scaling import FULL, QUICK, TASK, _rates  # noqa: E402
from jobs import clean_env, python, thread_vars  # noqa: E402

#: What both one-process children start with: the Mirrored strategy over 2 logical CPUs and the compiled net.
MODEL_PROLOGUE = r"""
import collections, json, statistics, sys, time
import stratkit
strategy = stratkit.make_strategy(strategy="mirrored", logical_cpus=2)
import keras, numpy as np
sys.path.insert(0, sys.argv[2])
from resnet_synthetic import resnet
config = json.loads(sys.argv[1])
with strategy.scope():
    model = resnet(config["image"], config["classes"], config["width"], config["blocks"])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
batch = 2 * config["per_replica_batch"]
"""

MIRRORED_CHILD = MODEL_PROLOGUE + r"""
rng = np.random.default_rng(0)
x = rng.normal(size=(batch * config["steps"], config["image"], config["image"], 3)).astype("float32")
y = rng.integers(0, config["classes"], size=len(x))
times, cpu = [], []
class Clock(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None): self.start, self.cpu = time.perf_counter(), time.process_time()
    def on_epoch_end(self, epoch, logs=None):
        times.append(time.perf_counter() - self.start)
        cpu.append(time.process_time() - self.cpu)
model.fit(x, y, batch_size=batch, epochs=config["epochs"], shuffle=False, verbose=0, callbacks=[Clock()])
print(json.dumps({"steps_per_sec": statistics.median([config["steps"] / t for t in times[1:]]),
                  "cpu_ms_per_step": 1000 * statistics.median([c / config["steps"] for c in cpu[1:]])}))
"""


GRAPH_CHILD = MODEL_PROLOGUE + r"""
x = np.random.default_rng(0).normal(size=(batch * 4, config["image"], config["image"], 3)).astype("float32")
model.fit(x, np.arange(len(x)) % config["classes"], batch_size=batch, epochs=2, shuffle=False, verbose=0)

def traced(function, seen):  # the tf.function under whatever wraps Keras's train_function
    if id(function) in seen:
        return None
    seen.add(id(function))
    if hasattr(function, "experimental_get_tracing_count"):
        return function
    inner = [getattr(function, "__wrapped__", None)]
    inner += [cell.cell_contents for cell in getattr(function, "__closure__", None) or ()]
    return next((found for f in inner if callable(f) for found in [traced(f, seen)] if found is not None), None)

function = traced(model.train_function, set())
ops = collections.Counter()
for concrete in function._list_all_concrete_functions():   # a benchmark's look inside TF, not stratkit code
    graph = concrete.graph.as_graph_def()
    ops.update(node.op for node in graph.node)
    ops.update(node.op for library in graph.library.function for node in library.node_def)
print(json.dumps({"traces": function.experimental_get_tracing_count(), "ops": dict(sorted(ops.items()))}))
"""


BACKUPS_CHILD = r"""
import json, os, sys, tempfile, time
import stratkit
trainer = stratkit.Trainer()
import keras, numpy as np
config, result = json.loads(sys.argv[1]), sys.argv[2]
steps, batch = config["steps"], 64
rng = np.random.default_rng(0)
x = rng.normal(size=(steps * batch, 256)).astype("float32")
y = rng.integers(0, 10, size=steps * batch).astype("int32")
def build():
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"),
                              keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
model = trainer.build(build)
marks = []
class Clock(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        marks.append((time.perf_counter(), time.process_time()))
    def on_train_end(self, logs=None):
        marks.append((time.perf_counter(), time.process_time()))
trainer.fit(model, (x, y), epochs=config["epochs"], global_batch_size=batch, verbose=0, callbacks=[Clock()],
            backup_dir=os.path.join(result + ".backup"), backup_every=config["every"])
(wall0, cpu0), (wall1, cpu1) = marks[1], marks[-1]
counted = steps * (config["epochs"] - 1)
with open(f"{result}.{trainer.spec.worker_rank}", "w") as handle:
    json.dump({"steps_per_sec": counted / (wall1 - wall0), "cpu_s_per_step": (cpu1 - cpu0) / counted}, handle)
"""


def run_backups(tree: Path, model: dict, timeout: float) -> dict:
    from stratkit.launch import launch

    config = {"steps": 8, "epochs": 2, "every": 3} if model is QUICK else {"steps": 40, "epochs": 3, "every": 10}
    with tempfile.TemporaryDirectory(prefix="stratkit-compare-") as tmp:
        result = Path(tmp) / "two"
        script = Path(tmp) / "backups_child.py"
        script.write_text(BACKUPS_CHILD)
        out = io.StringIO()
        load = os.getloadavg()[0]
        outcome = launch([python(), str(script), json.dumps(config), str(result)], workers=2, env=_env(tree),
                         timeout=timeout, stdout=out, stderr=out, handle_signals=False)
        if not outcome.ok:
            raise RuntimeError(f"backups job on {tree} failed: {outcome.report}\n{out.getvalue()[-3000:]}")
        records = [json.loads(Path(f"{result}.{rank}").read_text()) for rank in (0, 1)]
        return {"value": min(r["steps_per_sec"] for r in records), "unit": "steps/s", "load": load,
                "cpu_ms_per_step": 1000 * sum(r["cpu_s_per_step"] for r in records)}


def _env(tree: Path, **extra: str) -> dict[str, str]:
    env = clean_env(**extra)
    env["PYTHONPATH"] = os.pathsep.join([str(tree)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def run_scaling(tree: Path, model: dict, timeout: float) -> dict:
    from stratkit.launch import launch

    with tempfile.TemporaryDirectory(prefix="stratkit-compare-") as tmp:
        result = Path(tmp) / "two"
        config = json.dumps({**model, "prefetch": True, "bytes_per_pack": None, "gradient_compression": None,
                             "barrier": False, "result": str(result)})
        out = io.StringIO()
        load = os.getloadavg()[0]
        outcome = launch([python(), str(TASK)], workers=2, env=_env(tree, **thread_vars(None, None),
                                                                     STRATKIT_BENCH_SCALING=config),
                         timeout=timeout, stdout=out, stderr=out, handle_signals=False)
        if not outcome.ok:
            raise RuntimeError(f"scaling job on {tree} failed: {outcome.report}\n{out.getvalue()[-3000:]}")
        records = [json.loads(Path(f"{result}.{rank}").read_text()) for rank in (0, 1)]
        rates, _ = _rates(records[0])
        # CPU time per step of both workers together (epoch 0 excluded): what the exact path adds in work,
        # which the other load on 2 shared cores moves far less than the wall clock
        cpu = sum(statistics.median([(end - start) / r["steps"] for start, end in r["cpu"][1:]]) for r in records)
        return {"value": statistics.median(rates), "unit": "examples/s", "load": load, "cpu_ms_per_step": 1000 * cpu}


MIRRORED_THREADS: tuple[int | None, int | None] = (1, 2)     # intra-op, inter-op (None: TensorFlow's default)


def run_mirrored(tree: Path, model: dict, timeout: float) -> dict:
    load = os.getloadavg()[0]
    done = subprocess.run([python(), "-c", MIRRORED_CHILD, json.dumps(model), str(REPO / "examples")],
                          env=_env(tree, **thread_vars(*MIRRORED_THREADS)), capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"mirrored job on {tree} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # CPU time per step too: on a shared 2-core machine the wall clock mostly measures the other load
    # (one configuration measured 2.0 and 6.1 steps/s in consecutive rounds), CPU time far less.
    return {"value": result["steps_per_sec"], "unit": "steps/s", "load": load,
            "cpu_ms_per_step": result["cpu_ms_per_step"]}


def run_graph(tree: Path, model: dict, timeout: float) -> dict:
    done = subprocess.run([python(), "-c", GRAPH_CHILD, json.dumps(model), str(REPO / "examples")],
                          env=_env(tree), capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"graph job on {tree} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"value": sum(result["ops"].values()), "unit": "ops in the traced step", "traces": result["traces"],
            "ops": result["ops"]}


JOBS = {"scaling": run_scaling, "mirrored": run_mirrored, "graph": run_graph, "backups": run_backups}


def _threads(text: str) -> tuple[int | None, int | None]:
    if text == "default":
        return (None, None)
    try:
        intra, inter = (int(part) for part in text.split(","))
        if intra < 1 or inter < 1:
            raise ValueError
    except ValueError:
        raise SystemExit(f"--mirrored-threads={text!r}: expected two positive integers INTRA,INTER (e.g. 1,2) "
                         "or 'default'") from None
    return (intra, inter)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="git ref of the tree to compare against")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--jobs", default="scaling,mirrored,graph")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--mirrored-threads", default="1,2", metavar="INTRA,INTER",
                        help="the mirrored job's TensorFlow thread pools ('default': TensorFlow's own)")
    args = parser.parse_args(argv)
    global MIRRORED_THREADS
    MIRRORED_THREADS = _threads(args.mirrored_threads)
    model = QUICK if args.quick else FULL
    jobs = args.jobs.split(",")
    base_commit = subprocess.run(["git", "rev-parse", args.base], cwd=REPO, capture_output=True, text=True,
                                 check=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    worktree = Path(tempfile.mkdtemp(prefix="stratkit-base-"))
    subprocess.run(["git", "worktree", "add", "--detach", "-f", str(worktree), base_commit], cwd=REPO, check=True,
                   capture_output=True)
    trees = {"base": worktree, "this": REPO}
    rounds: list[dict] = []
    try:
        for index in range(args.rounds):
            order = ["base", "this"] if index % 2 == 0 else ["this", "base"]
            row: dict = {}
            for job in jobs:
                for name in order:
                    row.setdefault(job, {})[name] = JOBS[job](trees[name], model, args.timeout)
                    print(f"[compare_trees] round {index + 1} {job} {name}: {row[job][name]}", flush=True)
            rounds.append(row)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, capture_output=True)
    summary = {}
    for job in jobs:
        ratios = [r[job]["this"]["value"] / r[job]["base"]["value"] for r in rounds]
        summary[job] = {"ratio_mean": statistics.mean(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                        "ratio_stdev": statistics.stdev(ratios) if len(ratios) > 1 else 0.0, "ratios": ratios}
        if all("cpu_ms_per_step" in r[job]["this"] for r in rounds):  # base CPU / this CPU: > 1 is faster
            cpu = [r[job]["base"]["cpu_ms_per_step"] / r[job]["this"]["cpu_ms_per_step"] for r in rounds]
            summary[job].update(cpu_ratio_mean=statistics.mean(cpu), cpu_ratio_min=min(cpu), cpu_ratio_max=max(cpu),
                                cpu_ratios=cpu)
            print(f"[compare_trees] {job}: CPU time per step, base/this = {statistics.mean(cpu):.3f} "
                  f"(min {min(cpu):.3f}, max {max(cpu):.3f})", flush=True)
        if job == "graph":   # deterministic: one round says it; name every op type whose count differs
            this, base = rounds[-1][job]["this"], rounds[-1][job]["base"]
            summary[job]["differences"] = {op: [base["ops"].get(op, 0), this["ops"].get(op, 0)]
                                           for op in sorted(set(base["ops"]) | set(this["ops"]))
                                           if base["ops"].get(op, 0) != this["ops"].get(op, 0)}
            summary[job]["traces"] = [base["traces"], this["traces"]]
            print(f"[compare_trees] graph: {base['value']} ops (base) vs {this['value']} (this), traced "
                  f"{base['traces']} vs {this['traces']} time(s); differing op types [base, this]: "
                  f"{summary[job]['differences']}", flush=True)
        print(f"[compare_trees] {job}: this/base = {summary[job]['ratio_mean']:.3f} "
              f"(min {summary[job]['ratio_min']:.3f}, max {summary[job]['ratio_max']:.3f}, "
              f"{len(ratios)} rounds)", flush=True)
    entry = {"when": _dt.datetime.now().isoformat(timespec="seconds"), "base": base_commit, "this": head,
             "dirty": bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                          capture_output=True, text=True).stdout.strip()),
             "model": model, "mirrored_threads": list(MIRRORED_THREADS), "summary": summary, "rounds": rounds}
    if not args.quick:
        path = HERE / "results" / "compare-trees.json"
        history = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(history + [entry], indent=1) + "\n")
    return entry


if __name__ == "__main__":
    main()
