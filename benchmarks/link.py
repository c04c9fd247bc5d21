"""A rate-limited link for the 2-worker benchmarks: a private network namespace whose loopback is shaped by tc.

Why: on this machine's loopback the workers exchange gradients far faster
than any network between two machines, so a benchmark here cannot show what
halving the bytes (`gradient_compression`) does where the wire is the
bottleneck. Inside a network namespace of its own (a user namespace makes it
unprivileged), `tc qdisc add dev lo root tbf rate R` limits every byte that
crosses `lo` to R, in the kernel, for real TCP: gRPC, the collective and
every retransmission go through it. Nothing is simulated in Python.

What it models: `lo` is ONE queue that carries both directions of every
connection. In a 2-worker ring all-reduce both workers send at once, so two
machines each with a full-duplex link of L move at most 2L in total: a
cluster of nodes with links of L is `lo` shaped to 2L. A single TCP stream
alone gets all 2L (the check below measures it). Only the rate is limited:
no latency is added (a LAN's ~0.1 ms round trip is below the collective's own
~2 ms on this machine), and `lo` keeps its 64 KiB MTU.

How: `unshare --user --map-root-user --net sh -c 'ip link set lo up; tc
qdisc add ...; exec "$@"' sh COMMAND`. Inside, the launcher runs with
`private_network=False` (the namespace is already private and loopback-only,
and a nested one would have an unshaped `lo` of its own). Where the machine
refuses user namespaces or has no `tc`/`ip`, `unavailable()` says why and the
benchmarks skip their shaped rows saying so.

As a script, `python link.py launch --workers N --timeout T -- CMD...` runs
`stratkit.launch.launch(CMD, ...)` in the current (shaped) namespace and exits
with its return code, printing its report on failure.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Link:
    """A per-node link rate from a real-world case; `lo` is shaped to twice it (see the module docstring)."""

    name: str
    node_mbit: int
    case: str

    @property
    def lo_mbit(self) -> int:
        return 2 * self.node_mbit

    @property
    def node_bytes_per_s(self) -> float:
        return self.node_mbit * 1e6 / 8


#: 1 Gigabit Ethernet: commodity on-premise clusters and small cloud VMs.
GBE_1 = Link("1 GbE", 1000, "1 Gigabit Ethernet between nodes (commodity clusters, small cloud VMs)")
#: 2.5 Gigabit Ethernet (IEEE 802.3bz, 2.5GBASE-T): the upgrade of 1 GbE over the same copper.
GBE_2_5 = Link("2.5 GbE", 2500, "2.5 Gigabit Ethernet between nodes (802.3bz over existing copper)")
# 10 GbE would need lo at 20 Gbit/s: more than loopback TCP moves on 2 shared cores (1.7-2.9 GB/s),
# so it would measure the CPU, not the link.
LINKS = {link.name: link for link in (GBE_1, GBE_2_5)}


def shape_script(link: Link) -> str:
    """The shell run first inside the namespace: lo up, then a token bucket of 2L on it."""
    rate_bytes = link.lo_mbit * 1e6 / 8
    # The bucket must hold at least one 64 KiB loopback packet, and ~1 ms of the rate so the
    # kernel's timer granularity does not cut the rate below R.
    burst = max(256 * 1024, int(rate_bytes / 1000))
    return (f"ip link set lo up && tc qdisc add dev lo root tbf rate {link.lo_mbit}mbit burst {burst} "
            f"latency 50ms && exec \"$@\"")


def wrap(argv: list[str], link: Link) -> list[str]:
    """`argv` run inside a new user + network namespace whose lo is shaped to `link`."""
    return ["unshare", "--user", "--map-root-user", "--net", "sh", "-c", shape_script(link), "sh", *argv]


@functools.lru_cache(maxsize=None)
def unavailable() -> str | None:
    """None when a shaped namespace works here, else why not (one sentence)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux only (this is {sys.platform})"
    missing = [tool for tool in ("unshare", "ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found on PATH (util-linux / iproute2)"
    try:
        out = subprocess.run(wrap(["tc", "qdisc", "show", "dev", "lo"], GBE_1), capture_output=True, text=True,
                             timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"could not run unshare: {exc}"
    if out.returncode != 0 or "tbf" not in out.stdout:
        return f"unshare + tc failed (exit {out.returncode}): {(out.stderr or out.stdout).strip()[-300:]}"
    return None


def launch_command(cmd: list[str], workers: int, timeout: float) -> list[str]:
    """This script's own `launch` mode: the launcher as a process, to be run inside the shaped namespace."""
    return [sys.executable, str(Path(__file__).resolve()), "launch", "--workers", str(workers),
            "--timeout", str(timeout), "--", *cmd]


def run_shaped(argv: list[str], link: Link, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Run `argv` in a shaped namespace; kills its whole session when `timeout` passes."""
    proc = subprocess.Popen(wrap(argv, link), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return subprocess.CompletedProcess(proc.args, -9, out + f"\n(timed out after {timeout:.0f}s)", None)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


def _launch_main(args: argparse.Namespace) -> int:
    import io

    from stratkit.launch import launch

    out = io.StringIO()
    # private_network=False: this namespace is already private and loopback-only (a nested one
    # would bring an unshaped lo of its own).
    outcome = launch(args.cmd, workers=args.workers, timeout=args.timeout, stdout=out, stderr=out,
                     handle_signals=False, private_network=False)
    if not outcome.ok:
        print(f"launch failed (exit {outcome.returncode}):\n{outcome.report}\n{out.getvalue()[-3000:]}")
    return outcome.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    run = sub.add_parser("launch", help="run stratkit.launch.launch(CMD) here (call through wrap())")
    run.add_argument("--workers", type=int, default=2)
    run.add_argument("--timeout", type=float, default=600.0)
    run.add_argument("cmd", nargs="+")
    sub.add_parser("check", help="say whether a shaped namespace works here")
    args = parser.parse_args(argv)
    if args.mode == "check":
        why = unavailable()
        print("shaped loopback available" if why is None else f"not available: {why}")
        return 0 if why is None else 1
    return _launch_main(args)


if __name__ == "__main__":
    sys.exit(main())
