"""The flags of `stratkit launch --nnodes N|MIN:MAX --rdzv-endpoint HOST:PORT`, checked (`node_settings`).

Every ConfigError names the flag, the value and the fix; nothing starts before they pass.

Imports no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from stratkit.cluster import layout
from stratkit.errors import ConfigError
from stratkit.launch.rendezvous import TOKEN_VAR, check_token

DEFAULT_RDZV_TIMEOUT = 300.0
#: --rdzv-last-call: seconds an elastic rendezvous waits for more nodes once MIN are in.
DEFAULT_LAST_CALL = 3.0

@dataclass(frozen=True)
class NodeSettings:
    """The multi-node flags, checked."""

    nnodes: int
    host: str
    port: int
    workers_per_node: int
    join_timeout: float
    token: bytes
    chief: bool = False
    ps: int = 0
    min_nodes: int = 0  # --nnodes MIN:MAX's MIN (nnodes is MAX); 0: a fixed --nnodes N
    last_call: float = DEFAULT_LAST_CALL

    @property
    def elastic(self) -> bool:
        return 0 < self.min_nodes < self.nnodes

    @property
    def slots(self) -> int:
        """Ports each node holds: as many tasks as the busiest node runs (`layout.node_tasks`)."""
        return max(len(tasks) for tasks in layout.node_tasks(self.nnodes, self.workers_per_node, self.chief, self.ps))

    @property
    def endpoint(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_nnodes(value: int | str) -> tuple[int, int]:
    """--nnodes N or MIN:MAX as (MIN, MAX); a ConfigError naming the flag otherwise."""
    text = str(value).strip()
    low, sep, high = text.partition(":")
    fix = "Fix: the number of machines, e.g. --nnodes 2, or a range --nnodes 1:4 (elastic: MIN <= MAX)"
    if isinstance(value, bool) or not low.isdigit() or (sep and not high.isdigit()):
        raise ConfigError(f"--nnodes must be a whole number >= 1 or MIN:MAX, got {text or value!r}. {fix}")
    nmin, nmax = int(low), int(high) if sep else int(low)
    if nmin < 1 or nmax < nmin:
        raise ConfigError(f"--nnodes must be a whole number >= 1 or MIN:MAX with 1 <= MIN <= MAX, got {text}. {fix}")
    return nmin, nmax


def parse_endpoint(text: str) -> tuple[str, int]:
    """HOST:PORT (or [IPv6]:PORT) of --rdzv-endpoint; a ConfigError naming the flag otherwise."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"--rdzv-endpoint {text!r} is not HOST:PORT. Fix: the address of the node that serves "
                          "the rendezvous and a free port, the same on every node, e.g. --rdzv-endpoint "
                          "10.0.0.1:29400")
    return host, int(port)


def node_settings(nnodes: int | str, endpoint: str | None, workers_per_node: int, join_timeout: float,
                  environ: Mapping[str, str], chief: bool = False, ps: int = 0,
                  last_call: float = DEFAULT_LAST_CALL) -> NodeSettings:
    """The multi-node flags checked, with the token from STRATKIT_RDZV_TOKEN (ConfigErrors name the flag)."""
    min_nodes, nnodes = parse_nnodes(nnodes)
    if not (isinstance(last_call, (int, float)) and not isinstance(last_call, bool) and 0 <= last_call < 3600):
        raise ConfigError(f"--rdzv-last-call must be seconds in 0..3600, got {last_call!r}. Fix: e.g. "
                          f"--rdzv-last-call {DEFAULT_LAST_CALL:g}")
    if min_nodes < nnodes and (chief or ps):
        raise ConfigError(f"--nnodes {min_nodes}:{nnodes} with --chief/--ps: a parameter-server layout does not "
                          "change size between rounds. Fix: a fixed --nnodes N with --chief --ps, or drop --chief/--ps "
                          "(workers only) to be elastic")
    if not endpoint:
        raise ConfigError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT, the address of the node that serves "
                          "the rendezvous. Fix: e.g. --rdzv-endpoint 10.0.0.1:29400 on every node")
    if isinstance(workers_per_node, bool) or not isinstance(workers_per_node, int) or workers_per_node < 1:
        raise ConfigError(f"--workers-per-node must be a whole number >= 1, got {workers_per_node!r}. Fix: e.g. "
                          "--workers-per-node 1 (the default)")
    if not join_timeout > 0:
        raise ConfigError(f"--rdzv-timeout must be > 0 seconds, got {join_timeout!r}. Fix: e.g. --rdzv-timeout "
                          f"{DEFAULT_RDZV_TIMEOUT:g}")
    host, port = parse_endpoint(endpoint)
    return NodeSettings(nnodes, host, port, workers_per_node, float(join_timeout), check_token(environ.get(TOKEN_VAR)),
                        bool(chief), int(ps), min_nodes=min_nodes, last_call=float(last_call))
