"""Slurm job steps (`srun`) -> a worker-only TF_CONFIG cluster.

TensorFlow's `SlurmClusterResolver` divides by `gpus_per_node` and crashes on
CPU-only nodes, so the host list and task layout are expanded here instead.
Tasks are numbered the way Slurm's default block distribution numbers them:
all tasks of the first node, then the next node, and so on.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from stratkit.cluster import gpus
from stratkit.errors import ConfigError

DEFAULT_PORT = 8888
PORT_VAR = "STRATKIT_SLURM_PORT"
#: Set by srun when it binds each task's GPUs itself (--gpus-per-task, --gpu-bind): its assignment stands.
GPU_BINDING_VARS = ("SLURM_GPUS_PER_TASK", "SLURM_GPU_BIND")
#: The CUDA_VISIBLE_DEVICES value stratkit pinned this task to (so a second look does not split the share again).
PINNED_VAR = "STRATKIT_PINNED_GPUS"
#: How the GPU rule's refusals name Slurm's options.
GPU_SPELLING = gpus.Spelling(per_task="srun --gpus-per-task", per_ps="srun --gpus-per-task", share="",
                             tasks="srun --ntasks-per-node", where="this Slurm node")
#: Upper bounds checked before any list is built: a host list is a compact notation
#: (`n[0-999999999]` names a billion hosts). The largest Slurm machines have ~10,000 nodes.
MAX_HOSTS = 65_536
MAX_TASKS = 8 * MAX_HOSTS
_MAX_DIGITS = 18
_SATURATED = 10**18


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
    count = _int(raw, "SLURM_STEP_NUM_TASKS")
    if count > MAX_TASKS:
        raise ConfigError(f"SLURM_STEP_NUM_TASKS={count} is more than the {MAX_TASKS} tasks a TensorFlow cluster "
                          "from Slurm may have here. Fix: run under srun, which sets it to the step's task count, "
                          "or set STRATKIT_CLUSTER_ENV=none to ignore Slurm")
    return count


def _int(raw: str, var: str) -> int:
    # Python refuses to convert more than 4300 digits (ValueError); no count or port needs more than 18.
    if len(raw.strip()) > _MAX_DIGITS:
        raise ConfigError(f"{var} must be a small integer: got {_shown(raw)}. Fix: run under srun, which sets "
                          "it, or set STRATKIT_CLUSTER_ENV=none to ignore Slurm")
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{var} must be an integer: got {raw!r}. Fix: run under srun, which sets it, "
                          f"or set STRATKIT_CLUSTER_ENV=none to ignore Slurm") from None


def _shown(value: str) -> str:
    """repr() of a variable's value, cut short: a hostile value may be megabytes long."""
    return repr(value) if len(value) <= 200 else repr(value[:200]) + f"... ({len(value)} characters)"


# A host-list item ("gpu[01-03,07]x[1-2]") parsed once: literal text and bracket groups alternate.
# Each group is a list of (low, high, width) ranges; counting multiplies sizes, expanding takes the product.
_Range = tuple[int, int, int]
_Item = list[str | list[_Range]]


def count_hostlist(hostlist: str, var: str = "SLURM_STEP_NODELIST") -> int:
    """How many hosts `hostlist` names, computed without expanding it (`n[0-999999999]` -> 10**9)."""
    return _count(_parse_hostlist(hostlist, var))


def _count(items: list[_Item]) -> int:
    total = 0
    for item in items:
        size = 1
        for part in item:
            if not isinstance(part, str):  # saturate: many groups multiply into numbers too long to handle
                size = min(size * sum(high - low + 1 for low, high, _ in part), _SATURATED)
        total = min(total + size, _SATURATED)
    return total


def expand_hostlist(hostlist: str, max_hosts: int = MAX_HOSTS, var: str = "SLURM_STEP_NODELIST",
                    limit: str = "") -> list[str]:
    """Expand a Slurm host list: "gpu[01-03,07],cpu-a[1-2]x,login" -> individual hosts.

    Handles zero padding, several bracket groups per name (a cartesian
    product, as Slurm does) and commas inside brackets. The count is checked
    against `max_hosts` before a single name is built, so `n[0-999999999]`
    is a ConfigError at once rather than a MemoryError later.

    Args:
        var: the variable the list came from, named in errors.
        limit: where `max_hosts` comes from, for the error (default: stratkit's maximum).
    """
    items = _parse_hostlist(hostlist, var)
    count = _count(items)
    if count > max_hosts:
        amount = f"more than {_SATURATED:.0e}" if count >= _SATURATED else str(count)
        raise ConfigError(f"{var}={_shown(hostlist.strip())} names {amount} hosts, more than "
                          f"{limit or f'the {MAX_HOSTS} hosts a Slurm cluster may have here'}. Fix: run under "
                          "srun, which sets it to the step's nodes (e.g. node[01-04]), or set "
                          "STRATKIT_CLUSTER_ENV=none to ignore Slurm")
    hosts: list[str] = []
    for item in items:
        names = [""]
        for part in item:
            if isinstance(part, str):
                names = [name + part for name in names]
            else:
                values = [str(n).zfill(width) for low, high, width in part for n in range(low, high + 1)]
                names = [name + value for name in names for value in values]
        hosts.extend(names)
    return hosts


def _parse_hostlist(hostlist: str, var: str) -> list[_Item]:
    return [_parse_item(item, hostlist, var) for item in _split_top_level(hostlist.strip()) if item]


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


def _parse_item(item: str, whole: str, var: str) -> _Item:
    parts: _Item = []
    position = 0
    for match in re.finditer(r"\[([^\[\]]*)\]", item):
        parts.append(item[position:match.start()])
        parts.append([_parse_range(chunk, whole, var) for chunk in match.group(1).split(",")])
        position = match.end()
    parts.append(item[position:])
    if any(isinstance(part, str) and ("[" in part or "]" in part) for part in parts):
        raise _bad_hostlist(whole, var)
    return parts


def _parse_range(chunk: str, whole: str, var: str) -> _Range:
    digits = "[0-9]{1,%d}" % _MAX_DIGITS  # ASCII digits only; longer numbers name no real host
    match = re.fullmatch(f"({digits})(?:-({digits}))?", chunk)
    if match is None:
        raise _bad_hostlist(whole, var)
    low, high = match.group(1), match.group(2) or match.group(1)
    if int(high) < int(low):
        raise _bad_hostlist(whole, var)
    return int(low), int(high), len(low)


def _bad_hostlist(value: str, var: str = "SLURM_STEP_NODELIST") -> ConfigError:
    return ConfigError(f"{var} is not a Slurm host list: got {_shown(value)}. "
                       "Fix: run under srun, which sets it (e.g. node[01-04]), "
                       "or set STRATKIT_CLUSTER_ENV=none to ignore Slurm")


def expand_tasks_per_node(value: str, max_nodes: int = MAX_HOSTS,
                          var: str = "SLURM_STEP_TASKS_PER_NODE") -> list[int]:
    """Expand "2(x3),1" -> [2, 2, 2, 1]; more than `max_nodes` entries is a ConfigError (checked first)."""
    number = "([0-9]{1,%d})" % _MAX_DIGITS
    runs: list[tuple[int, int]] = []
    for chunk in value.split(","):
        match = re.fullmatch(rf"\s*{number}(?:\(x{number}\))?\s*", chunk)
        if match is None:
            raise ConfigError(f"{var} is not in Slurm's format: got {_shown(value)}. "
                              "Fix: run under srun, which sets it (e.g. 2(x3),1)")
        runs.append((int(match.group(1)), int(match.group(2) or 1)))
    nodes = sum(repeat for _, repeat in runs)
    if nodes > max_nodes:
        raise ConfigError(f"{var}={_shown(value)} describes {nodes} nodes, more than the {max_nodes} a Slurm "
                          "cluster may have here. Fix: run under srun, which sets it (e.g. 2(x3),1), or set "
                          "STRATKIT_CLUSTER_ENV=none to ignore Slurm")
    return [count for count, repeat in runs for _ in range(repeat)]


# Where the hosts come from, in order; and the node counts that bound each list (a step runs on a
# subset of the job's nodes, so the job's count bounds every list).
_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_NODE_COUNT_VARS = {
    "SLURM_STEP_NODELIST": ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"),
    "SLURM_JOB_NODELIST": ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"),
    "SLURM_NODELIST": ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"),
}


def _node_limit(env: Mapping[str, str], nodelist_var: str) -> dict[str, Any]:
    """expand_hostlist's `max_hosts` and `limit`: the first node count Slurm set, never above MAX_HOSTS."""
    for count_var in _NODE_COUNT_VARS[nodelist_var]:
        if env.get(count_var, "").strip():
            nodes = _int(env[count_var], count_var)
            if nodes < MAX_HOSTS:
                return {"max_hosts": nodes, "limit": f"{count_var}={nodes}"}
            break
    return {"max_hosts": MAX_HOSTS, "limit": ""}


def _step_layout(env: Mapping[str, str]) -> tuple[list[str], list[int]]:
    """The step's hosts and how many of its tasks run on each (checked against each other)."""
    num_tasks = _num_tasks(env)
    var = next((v for v in _NODELIST_VARS if env.get(v)), None)
    if var is None:
        raise ConfigError("SLURM_STEP_NODELIST is not set in a Slurm step with "
                          f"SLURM_STEP_NUM_TASKS={num_tasks}. Fix: launch with srun, or set "
                          "STRATKIT_CLUSTER_ENV=none to ignore Slurm")
    nodelist = env[var]
    hosts = expand_hostlist(nodelist, var=var, **_node_limit(env, var))
    if not hosts:
        raise _bad_hostlist(nodelist, var)
    per_node_var = next((v for v in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if env.get(v)), None)
    per_node_raw = env[per_node_var] if per_node_var else None
    if per_node_var:
        per_node = expand_tasks_per_node(env[per_node_var], var=per_node_var)
    else:  # even block distribution
        per_node = [num_tasks // len(hosts) + (1 if i < num_tasks % len(hosts) else 0) for i in range(len(hosts))]
    if len(per_node) != len(hosts) or sum(per_node) != num_tasks:
        raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE={_shown(per_node_raw or '')} does not match "
                          f"{var}={_shown(nodelist)} ({len(hosts)} hosts) and "
                          f"SLURM_STEP_NUM_TASKS={num_tasks}. Fix: launch with srun so Slurm sets all three")
    return hosts, per_node


def slurm_cluster(env: Mapping[str, str]) -> tuple[dict[str, list[str]], int]:
    """The worker-only cluster of this Slurm step and this task's index in it.

    Task i on a node listens on port base + (its local rank on that node), so
    several tasks per node never collide.
    """
    num_tasks = _num_tasks(env)
    rank = _int(env["SLURM_PROCID"], "SLURM_PROCID")
    hosts, per_node = _step_layout(env)
    base_port = _int(env.get(PORT_VAR, str(DEFAULT_PORT)), PORT_VAR)
    if not 1 <= base_port <= 65536 - max(per_node):  # ports base .. base + max - 1 must be <= 65535
        raise ConfigError(f"{PORT_VAR} must leave room for {max(per_node)} ports below 65536: got "
                          f"{base_port}. Fix: use a port such as {DEFAULT_PORT}")
    workers = [f"{host}:{base_port + local}" for host, count in zip(hosts, per_node) for local in range(count)]
    if not 0 <= rank < num_tasks:
        raise ConfigError(f"SLURM_PROCID={rank} is out of range for SLURM_STEP_NUM_TASKS={num_tasks}. "
                          "Fix: launch with srun, which sets both consistently")
    return {"worker": workers}, rank


def _local_tasks(env: Mapping[str, str]) -> tuple[int, int]:
    """(this task's SLURM_LOCALID, the step's task count on its node), from Slurm's block numbering."""
    _, per_node = _step_layout(env)
    rank = _int(env["SLURM_PROCID"], "SLURM_PROCID")
    start = 0
    for count in per_node:
        if rank < start + count:
            local = _int(env["SLURM_LOCALID"], "SLURM_LOCALID") if env.get("SLURM_LOCALID") else rank - start
            if not 0 <= local < count:
                raise ConfigError(f"SLURM_LOCALID={local} is out of range for the {count} task(s) of this node. "
                                  "Fix: launch with srun, which sets it")
            return local, count
        start += count
    raise ConfigError(f"SLURM_PROCID={rank} is out of range for SLURM_STEP_NUM_TASKS={sum(per_node)}. "
                      "Fix: launch with srun, which sets both consistently")


def gpu_share(env: Mapping[str, str]) -> str | None:
    """This task's CUDA_VISIBLE_DEVICES in a Slurm step whose tasks see every GPU of their node; None: leave it.

    `srun --ntasks-per-node 4` without `--gpus-per-task` shows each task all of
    its node's GPUs: task SLURM_LOCALID then gets its own share, as `stratkit
    launch` gives each local worker (`stratkit.cluster.gpus`). With
    `--gpus-per-task` or `--gpu-bind` Slurm's own assignment stands; one task
    per node keeps all of them.

    Raises:
        ConfigError: when the node's GPUs cannot be split evenly among its tasks.
    """
    if not is_slurm_step(env) or any(env.get(v) for v in GPU_BINDING_VARS):
        return None
    if PINNED_VAR in env and env.get("CUDA_VISIBLE_DEVICES") == env[PINNED_VAR]:
        return None  # pinned already (`stratkit.make_strategy` did, in this process)
    visible = gpus.visible_gpus(env)
    if not visible:
        return None
    local, count = _local_tasks(env)
    if count == 1:
        return None
    return gpus.assign(visible, ["worker"] * count, spelling=GPU_SPELLING)[local].visible
