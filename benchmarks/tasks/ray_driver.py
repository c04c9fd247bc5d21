"""A Ray driver for bench_ray.py: start a local Ray, run one engine `repeats` times, time each run.

    python ray_driver.py raytrain|rayrunner CONFIG_JSON RESULT_PATH

"raytrain": Ray Train's `TensorflowTrainer` (2 workers) with
`spark_train.train_stratkit` (a `stratkit.Trainer`) in
`train_loop_per_worker`; rank 0 writes its result to a file (Ray Train drops
the loop's return value). "rayrunner": `stratkit.ray.RayRunner(num_workers=2)
.run(spark_train.train_stratkit, ...)`, which returns the chief's result.

Ray is started on 127.0.0.1 only, no dashboard, in a private temp dir (not
/tmp/ray: other Ray sessions on the machine stay apart); the parent sets the
environment (usage stats off, token authentication, proxies to a closed
loopback port). After `ray.shutdown()` every process the session started is
checked gone (SIGKILLed and recorded in the JSON if not). Exit 0 even when a
run fails (the failure is in the JSON).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import spark_train  # noqa: E402

engine, config, result_path = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
output = {"runner": engine, "runs": []}


def save() -> None:
    result_path.write_text(json.dumps(output))


def children_of(pid: int) -> list[int]:
    """Every live descendant of `pid` (from /proc), as tests/ray/ray_helpers.py checks."""
    parents: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in (b"Z", b"X"):
            parents.setdefault(int(fields[1]), []).append(int(name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def train_loop_per_worker(loop_config: dict) -> None:
    import ray.train

    import spark_train as job

    result = job.train_stratkit(loop_config["epochs"], loop_config["steps"])
    if ray.train.get_context().get_world_rank() == 0:
        Path(loop_config["out"]).write_text(json.dumps(result))


# A short temp dir: Ray's Unix sockets live under it (107-byte limit).
temp = tempfile.mkdtemp(prefix="skrb-")
import ray  # noqa: E402  (after the parent's environment, which Ray reads at import)
import ray.cloudpickle  # noqa: E402

ray.cloudpickle.register_pickle_by_value(spark_train)  # the actors cannot import benchmarks/tasks otherwise
started = time.time()
ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", _temp_dir=temp,
         configure_logging=False)
output["session_seconds"] = time.time() - started
output["ray"] = ray.__version__
try:
    if engine == "raytrain":
        from ray.train import RunConfig, ScalingConfig
        from ray.train.tensorflow import TensorflowTrainer

        def run(i: int) -> dict:
            out = Path(temp) / f"result{i}.json"
            trainer = TensorflowTrainer(
                train_loop_per_worker,
                train_loop_config={"epochs": config["epochs"], "steps": config["steps"], "out": str(out)},
                scaling_config=ScalingConfig(num_workers=config["workers"], use_gpu=False),
                run_config=RunConfig(name=f"bench{i}", storage_path=str(Path(temp) / "results")))
            result = trainer.fit()
            if result.error is not None:
                raise result.error
            return json.loads(out.read_text())
    else:
        from stratkit.ray import RayRunner

        runner = RayRunner(num_workers=config["workers"], timeout=config["timeout"])

        def run(i: int) -> dict:
            return runner.run(spark_train.train_stratkit, config["epochs"], config["steps"])

    for i in range(config["repeats"]):
        called = time.time()
        try:
            result = run(i)
            output["runs"].append({"called": called, "returned": time.time(), "result": result})
        except Exception as exc:  # noqa: BLE001 - recorded, the parent reports it
            output["runs"].append({"called": called, "returned": time.time(),
                                   "error": f"{type(exc).__name__}: {str(exc)[-3000:]}",
                                   "traceback": traceback.format_exc()[-3000:]})
        save()
finally:
    ray.shutdown()
    deadline = time.monotonic() + 30
    left = children_of(os.getpid())
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = children_of(os.getpid())
    for pid in left:  # nothing of this session may outlive the benchmark
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    output["left_after_shutdown"] = left
    shutil.rmtree(temp, ignore_errors=True)
    save()
