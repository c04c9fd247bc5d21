"""Parse and validate TF_CONFIG (plain, Kubeflow TFJob, SageMaker, AI Platform, Ray, ...).

TensorFlow accepts a malformed TF_CONFIG silently and then hangs or fails deep
inside a collective; here every shape error becomes a `ConfigError` that names
the variable, the bad value and the fix.
"""

from __future__ import annotations

import json
import re
import reprlib
import sys
from dataclasses import dataclass
from typing import Any

from stratkit.cluster.spec import ROLES
from stratkit.errors import ConfigError

VAR = "TF_CONFIG"

# SageMaker's parameter-server mode calls the chief "master"; TensorFlow rejects
# that job name, so it is renamed before anything else looks at the cluster.
ROLE_ALIASES = {"master": "chief"}

_HOST_PORT = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[^\s:\[\]/]+):(?P<port>[^:]*)$")

EXAMPLE = '{"cluster": {"worker": ["host1:2222", "host2:2222"]}, "task": {"type": "worker", "index": 0}}'


@dataclass(frozen=True)
class ParsedTFConfig:
    """A validated TF_CONFIG: roles renamed, addresses checked."""

    cluster: dict[str, list[str]]
    task_type: str | None
    task_index: int | None
    renamed_master: bool
    raw_keys: tuple[str, ...]


def _fail(problem: str, value: Any, fix: str) -> ConfigError:
    try:
        shown = value if isinstance(value, str) else json.dumps(value, default=repr)
    except (RecursionError, ValueError):  # absurdly deep JSON: show a bounded repr instead
        shown = reprlib.repr(value)
    if len(shown) > 300:
        shown = shown[:300] + "..."
    return ConfigError(f"{VAR} {problem}: got {shown}. Fix: {fix}")


def parse_tf_config(text: str) -> ParsedTFConfig | None:
    """Validate the TF_CONFIG string.

    Returns None when TF_CONFIG describes no cluster (empty, `{}`, or only
    top-level keys such as "environment"), so detection falls through to the
    other environments exactly as TensorFlow treats it as "no cluster".

    Raises:
        ConfigError: on any malformed or inconsistent content.
    """
    if text is None or not text.strip():
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _fail(f"is not valid JSON ({exc.msg} at char {exc.pos})", text,
                    f"set {VAR} to a JSON object such as {EXAMPLE}") from None
    except RecursionError:
        raise _fail("is nested too deeply to be a cluster description", text,
                    f"set {VAR} to a JSON object such as {EXAMPLE}") from None
    except ValueError:  # an integer longer than Python converts (sys.get_int_max_str_digits())
        raise _fail(f"has an integer with more than the {sys.get_int_max_str_digits()} digits Python reads", text,
                    f"write indices and ports as ordinary integers, e.g. {EXAMPLE}") from None
    if not isinstance(config, dict):
        raise _fail("must be a JSON object", config, f"set {VAR} to a JSON object such as {EXAMPLE}")

    raw_cluster = config.get("cluster", {})
    if raw_cluster is None:
        raw_cluster = {}
    if not isinstance(raw_cluster, dict):
        raise _fail('"cluster" must be an object mapping each role to a list of "host:port"',
                    raw_cluster, f"use the shape {EXAMPLE}")
    task = config.get("task")

    if not raw_cluster:
        if task not in (None, {}):
            raise _fail('has a "task" but no "cluster"', config,
                        'list every task\'s "host:port" under "cluster", or unset TF_CONFIG on a single host')
        return None

    cluster, renamed = _parse_cluster(raw_cluster)
    task_type, task_index = _parse_task(task, cluster)
    return ParsedTFConfig(cluster, task_type, task_index, renamed, tuple(config))


def _parse_cluster(raw: dict) -> tuple[dict[str, list[str]], bool]:
    cluster: dict[str, list[str]] = {}
    renamed = False
    for raw_role, addresses in raw.items():
        if not isinstance(raw_role, str):  # pragma: no cover - JSON keys are always str
            raise _fail("has a non-string role", raw_role, "use chief, worker, ps or evaluator")
        role = ROLE_ALIASES.get(raw_role, raw_role)
        renamed = renamed or role != raw_role
        if role not in ROLES:
            raise _fail(f'has unknown role "{raw_role}" in "cluster"', sorted(raw),
                        'use only the roles "chief", "worker", "ps" and "evaluator" '
                        '(SageMaker\'s "master" is accepted as "chief")')
        if role in cluster:
            raise _fail(f'lists role "{role}" twice (as "{raw_role}" and another alias)', sorted(raw),
                        'keep either "master" or "chief", not both: a cluster has one chief')
        if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
            raise _fail(f'cluster["{raw_role}"] must be a list of "host:port" strings', addresses,
                        'write it as ["host1:2222", "host2:2222"]')
        if not addresses:
            raise _fail(f'cluster["{raw_role}"] is an empty list', addresses,
                        f'give at least one "host:port" for "{raw_role}" or remove the role')
        for address in addresses:
            _check_address(address, raw_role)
        cluster[role] = list(addresses)

    for role in ("chief", "evaluator"):
        if len(cluster.get(role, [])) > 1:
            raise _fail(f'has {len(cluster[role])} "{role}" tasks', cluster[role],
                        f'a cluster has at most one {role}: move the others to "worker"')
    _check_unique(cluster)
    if "chief" not in cluster and "worker" not in cluster:
        raise _fail('has no training task ("chief" or "worker")', sorted(raw),
                    'add a "worker" list (and optionally one "chief")')
    if "ps" in cluster:
        if "worker" not in cluster:
            raise _fail('has "ps" tasks but no "worker" to run the steps', sorted(raw),
                        'add a "worker" list; parameter-server training needs at least one worker')
        if "chief" not in cluster:
            raise _fail('has "ps" tasks but no "chief" to coordinate them', sorted(raw),
                        'add one "chief" (the coordinator); for synchronous training remove "ps"')
    return cluster, renamed


def _check_address(address: str, role: str) -> None:
    match = _HOST_PORT.match(address.strip())
    if match is None or address != address.strip():
        raise _fail(f'cluster["{role}"] has an address without a port', address,
                    'write every address as "host:port", e.g. "10.0.0.2:2222"')
    port = match.group("port")
    # isascii(): str.isdigit() also accepts "²" (int() then fails) and non-ASCII digits such as "١٢".
    if not (port.isascii() and port.isdigit()) or not 1 <= _port_number(port) <= 65535:
        shown = port if len(port) <= 12 else f"{port[:12]}...({len(port)} characters)"
        raise _fail(f'cluster["{role}"] has port "{shown}" outside 1..65535', address,
                    'use a TCP port between 1 and 65535, e.g. "10.0.0.2:2222"')


def _port_number(digits: str) -> int:
    """The port of a digit string; 0 (invalid) for more than 5 digits, zeros included ("02222" is 2222).

    The length test comes before int(): Python refuses to convert more than 4300 digits, and every
    consumer of the address (TensorFlow, our reachability checks) gets a port it can parse.
    """
    return int(digits) if len(digits) <= 5 else 0


def _check_unique(cluster: dict[str, list[str]]) -> None:
    seen: dict[tuple[str, int], str] = {}
    for role, addresses in cluster.items():
        for index, address in enumerate(addresses):
            where = f"{role}[{index}]"
            host, _, port = address.rpartition(":")
            key = (host.lower(), _port_number(port))  # "H:02222" and "h:2222" are the same endpoint
            if key in seen:
                raise _fail(f"uses address {address} for both {seen[key]} and {where}", cluster,
                            "give every task its own host:port (a second task on a host needs another port)")
            seen[key] = where


def _parse_task(task: Any, cluster: dict[str, list[str]]) -> tuple[str, int]:
    if task is None:
        raise _fail('has a "cluster" but no "task"', cluster,
                    'add "task": {"type": "worker", "index": N} naming this process\'s role and index')
    if not isinstance(task, dict):
        raise _fail('"task" must be an object {"type": ..., "index": ...}', task,
                    'write "task": {"type": "worker", "index": 0}')
    raw_type = task.get("type")
    if not isinstance(raw_type, str) or not raw_type:
        raise _fail('"task.type" is missing or not a string', task,
                    'set "task": {"type": "worker", "index": N} (type is chief, worker, ps or evaluator)')
    task_type = ROLE_ALIASES.get(raw_type, raw_type)
    if task_type not in ROLES:
        raise _fail(f'"task.type" is the unknown role "{raw_type}"', task,
                    'use "chief", "worker", "ps" or "evaluator"')
    if "index" not in task:
        raise _fail('"task.index" is missing', task, 'add "index": N, this task\'s position in its role list')
    index = task["index"]
    if isinstance(index, bool) or not isinstance(index, int):
        raise _fail('"task.index" must be a non-negative integer', task,
                    'write the index as a JSON integer, e.g. "index": 0 (not "0", 0.0 or true)')
    if index < 0:
        raise _fail('"task.index" is negative', task, "indices count from 0")

    if task_type not in cluster:
        # AI Platform runs the evaluator outside the listed cluster.
        if task_type == "evaluator":
            if index != 0:
                raise _fail('"task.index" of the evaluator must be 0', task, "a cluster has one evaluator")
            return task_type, index
        raise _fail(f'"task.type" "{raw_type}" is not a role in "cluster"', {"task": task, "roles": sorted(cluster)},
                    f'list this task\'s address under cluster["{raw_type}"] or fix "task.type"')
    if index >= len(cluster[task_type]):
        raise _fail(f'"task.index" {index} is out of range for {len(cluster[task_type])} "{raw_type}" task(s)',
                    task, f"use an index from 0 to {len(cluster[task_type]) - 1}")
    return task_type, index
