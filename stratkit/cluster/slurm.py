"""Slurm job steps (`srun`) -> a worker-only TF_CONFIG cluster.

TensorFlow's `SlurmClusterResolver` divides by `gpus_per_node` and crashes on
CPU-only nodes, so the host list and task layout are expanded here instead.
Tasks are numbered the way Slurm's default block distribution numbers them:
all tasks of the first node, then the next node, and so on.
"""

from __future__ import annotations

import re
from typing import Mapping

from stratkit.errors import ConfigError

DEFAULT_PORT = 8888
PORT_VAR = "STRATKIT_SLURM_PORT"


def is_slurm_step(env: Mapping[str, str]) -> bool:
    """True inside an `srun` job step with more than one task.

    A batch script itself (no `SLURM_STEP_NUM_TASKS`) is not a step: running
    `python train.py` there is one process, not a cluster.
    """
    return "SLURM_PROCID" in env and _num_tasks(env) > 1


def _num_tasks(env: Mapping[str, str]) -> int:
    raw = env.get("SLURM_STEP_NUM_TASKS")
    if raw is None:
        return 0
    return _int(raw, "SLURM_STEP_NUM_TASKS")


def _int(raw: str, var: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{var} must be an integer: got {raw!r}. Fix: run under srun, which sets it, "
                          f"or set STRATKIT_CLUSTER_ENV=none to ignore Slurm") from None


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm host list: "gpu[01-03,07],cpu-a[1-2]x,login" -> individual hosts.

    Handles zero padding, several bracket groups per name (a cartesian
    product, as Slurm does) and commas inside brackets.
    """
    hosts: list[str] = []
    for item in _split_top_level(hostlist.strip()):
        if item:
            hosts.extend(_expand_one(item, hostlist))
    return hosts


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return parts


def _expand_one(item: str, whole: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", item)
    if match is None:
        if "[" in item or "]" in item:
            raise _bad_hostlist(whole)
        return [item]
    prefix, suffix = item[: match.start()], item[match.end():]
    expanded = []
    for chunk in match.group(1).split(","):
        if re.fullmatch(r"\d+", chunk):
            values = [chunk]
        elif re.fullmatch(r"\d+-\d+", chunk):
            low, high = chunk.split("-")
            if int(high) < int(low):
                raise _bad_hostlist(whole)
            width = len(low)
            values = [str(n).zfill(width) for n in range(int(low), int(high) + 1)]
        else:
            raise _bad_hostlist(whole)
        for value in values:
            expanded.extend(_expand_one(prefix + value + suffix, whole))
    return expanded


def _bad_hostlist(value: str) -> ConfigError:
    return ConfigError(f"SLURM_STEP_NODELIST is not a Slurm host list: got {value!r}. "
                       "Fix: run under srun, which sets it (e.g. node[01-04]), "
                       "or set STRATKIT_CLUSTER_ENV=none to ignore Slurm")


def expand_tasks_per_node(value: str) -> list[int]:
    """Expand "2(x3),1" -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for chunk in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", chunk)
        if match is None:
            raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE is not in Slurm's format: got {value!r}. "
                              "Fix: run under srun, which sets it (e.g. 2(x3),1)")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def slurm_cluster(env: Mapping[str, str]) -> tuple[dict[str, list[str]], int]:
    """The worker-only cluster of this Slurm step and this task's index in it.

    Task i on a node listens on port base + (its local rank on that node), so
    several tasks per node never collide.
    """
    num_tasks = _num_tasks(env)
    rank = _int(env["SLURM_PROCID"], "SLURM_PROCID")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ConfigError("SLURM_STEP_NODELIST is not set in a Slurm step with "
                          f"SLURM_STEP_NUM_TASKS={num_tasks}. Fix: launch with srun, or set "
                          "STRATKIT_CLUSTER_ENV=none to ignore Slurm")
    hosts = expand_hostlist(nodelist)
    per_node_raw = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if per_node_raw:
        per_node = expand_tasks_per_node(per_node_raw)
    else:  # even block distribution
        per_node = [num_tasks // len(hosts) + (1 if i < num_tasks % len(hosts) else 0) for i in range(len(hosts))]
    if len(per_node) != len(hosts) or sum(per_node) != num_tasks:
        raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE={per_node_raw!r} does not match "
                          f"SLURM_STEP_NODELIST={nodelist!r} ({len(hosts)} hosts) and "
                          f"SLURM_STEP_NUM_TASKS={num_tasks}. Fix: launch with srun so Slurm sets all three")
    base_port = _int(env.get(PORT_VAR, str(DEFAULT_PORT)), PORT_VAR)
    if not 1 <= base_port <= 65536 - max(per_node):  # ports base .. base + max - 1 must be <= 65535
        raise ConfigError(f"{PORT_VAR} must leave room for {max(per_node)} ports below 65536: got "
                          f"{base_port}. Fix: use a port such as {DEFAULT_PORT}")
    workers = [f"{host}:{base_port + local}" for host, count in zip(hosts, per_node) for local in range(count)]
    if not 0 <= rank < num_tasks:
        raise ConfigError(f"SLURM_PROCID={rank} is out of range for SLURM_STEP_NUM_TASKS={num_tasks}. "
                          "Fix: launch with srun, which sets both consistently")
    return {"worker": workers}, rank
