"""`stratkit launch`: the command line around `stratkit.launch.launch`.

Every flag can also come from an environment variable (STRATKIT_WORKERS=2,
STRATKIT_CHIEF=1, ...), as torchrun's do, so a scheduler's job template can set
the layout once; a flag on the command line wins over its variable.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import shlex
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from stratkit.cluster.layout import build_cluster, format_address
from stratkit import status
from stratkit.errors import ConfigError
from stratkit.launch.local import launch
from stratkit.launch.multinode import DEFAULT_LAST_CALL, DEFAULT_RDZV_TIMEOUT, launch_node
from stratkit.launch.plan import (DEFAULT_EXIT_GRACE, DEFAULT_HOST, DEFAULT_STOP_GRACE, GPU_WORKERS, GRPC_EXPOSED,
                                  NETWORK_MUST_BE_PRIVATE, Task, plan_tasks, task_tf_config)

#: Port of the first task on each host in a printed multi-host plan (TensorFlow's documented default).
DEFAULT_PLAN_PORT = 2222

EXAMPLES = """\
examples:
  stratkit launch --workers 2 -- python train.py --epochs 3
  stratkit launch --chief --workers 2 --ps 1 --max-restarts 2 --log-dir logs -- python train.py
  stratkit launch --hosts h1,h2 --print-tf-config -- python train.py   # what to run on each machine
  STRATKIT_RDZV_TOKEN=<secret> stratkit launch --nnodes 2 --rdzv-endpoint h1:29400 -- python train.py  # on h1 and h2
  stratkit launch --tune --workers 4 [--workers-per-trial 2] -- python search.py   # a search: 4 (2) tuners

exit code: 0 when every task succeeded; else the failed task's code, 128+N when it died of signal N,
124 after --timeout, 130 after Ctrl-C, 75 when the launcher was preempted (SIGTERM or --preemption-signal)
and every task saved its backup, 2 for a usage error.
"""


@dataclass(frozen=True)
class _Flag:
    dest: str
    var: str
    parse: Callable[[str, str], Any]


def _int_value(text: str, name: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a whole number. Fix: e.g. {name}=2, or unset it") from None


def _float_value(text: str, name: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a number of seconds. Fix: e.g. {name}=600, or unset it") from None
    if not math.isfinite(value) or value < 0:  # named here: launch() would name the flag, not the variable
        raise ConfigError(f"{name}={text!r} is not a finite number of seconds >= 0. Fix: e.g. {name}=600, "
                          "or unset it")
    return value


def _bool_value(text: str, name: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={text!r} is not a yes/no value. Fix: {name}=1 or {name}=0, or unset it")


def _str_value(text: str, name: str) -> str:
    return text.strip()


def _signal_value(text: str, name: str) -> str:
    status.parse_signal(text, name)  # refused here, naming the variable
    return text.strip()


def _workers_value(text: str, name: str) -> int | str:
    """A whole number, or `gpu` (one per visible GPU)."""
    if text.strip().lower() == GPU_WORKERS:
        return GPU_WORKERS
    try:
        return int(text.strip())
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a whole number or 'gpu'. Fix: e.g. {name}=2 or {name}=gpu, or "
                          "unset it") from None


_FLAGS = (
    _Flag("workers", "STRATKIT_WORKERS", _workers_value),
    _Flag("chief", "STRATKIT_CHIEF", _bool_value),
    _Flag("ps", "STRATKIT_PS", _int_value),
    _Flag("evaluator", "STRATKIT_EVALUATOR", _bool_value),
    _Flag("max_restarts", "STRATKIT_MAX_RESTARTS", _int_value),
    _Flag("log_dir", "STRATKIT_LOG_DIR", _str_value),
    _Flag("host", "STRATKIT_HOST", _str_value),
    _Flag("base_port", "STRATKIT_BASE_PORT", _int_value),
    _Flag("timeout", "STRATKIT_TIMEOUT", _float_value),
    _Flag("exit_grace", "STRATKIT_EXIT_GRACE", _float_value),
    _Flag("stop_grace", "STRATKIT_STOP_GRACE", _float_value),
    _Flag("hosts", "STRATKIT_HOSTS", _str_value),
    _Flag("private_network", "STRATKIT_PRIVATE_NETWORK", _bool_value),
    _Flag("nnodes", "STRATKIT_NNODES", _str_value),
    _Flag("rdzv_endpoint", "STRATKIT_RDZV_ENDPOINT", _str_value),
    _Flag("workers_per_node", "STRATKIT_WORKERS_PER_NODE", _workers_value),
    _Flag("rdzv_timeout", "STRATKIT_RDZV_TIMEOUT", _float_value),
    _Flag("rdzv_last_call", "STRATKIT_RDZV_LAST_CALL", _float_value),
    _Flag("gpus_per_worker", "STRATKIT_GPUS_PER_WORKER", _int_value),
    _Flag("gpus_per_ps", "STRATKIT_GPUS_PER_PS", _int_value),
    _Flag("share_gpus", "STRATKIT_SHARE_GPUS", _bool_value),
    _Flag("preemption_signal", status.PREEMPTION_SIGNAL_VAR, _signal_value),
    _Flag("tune", "STRATKIT_TUNE", _bool_value),
    _Flag("workers_per_trial", "STRATKIT_WORKERS_PER_TRIAL", _int_value),
)


def _arg_type(kind: Callable[[str], Any], example: str) -> Callable[[str], Any]:
    """An argparse type whose error says what was expected (argparse adds the flag name)."""
    def parse(text: str) -> Any:
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {example}, got {text!r}") from None
    return parse


def add_launch_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `stratkit launch` on the `stratkit` command's subparsers."""
    parser = subparsers.add_parser(
        "launch", help="run a training script as a local TF_CONFIG cluster (like torchrun)",
        description="Start COMMAND once per task of a TF_CONFIG cluster on this machine, each task with its "
                    "own TF_CONFIG; prefix and log their output; on the first failure stop the others, report "
                    "the root cause and optionally restart the whole cluster. Each flag can also be set by "
                    "the environment variable shown in brackets.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    count, seconds = _arg_type(int, "a whole number"), _arg_type(float, "a number of seconds")
    workers = _arg_type(lambda text: _workers_value(text, "--workers"), "a whole number or 'gpu'")
    layout = parser.add_argument_group("cluster layout")
    layout.add_argument("--workers", type=workers, default=None, metavar="N|gpu",
                        help="worker tasks (default 1; with --hosts, one per host); gpu: one per GPU visible here "
                             "[STRATKIT_WORKERS]")
    layout.add_argument("--chief", action="store_true", default=None,
                        help="add a chief task (required with --ps) [STRATKIT_CHIEF]")
    layout.add_argument("--ps", type=count, default=None, metavar="M",
                        help="parameter-server tasks: parameter_server strategy (default 0) [STRATKIT_PS]")
    layout.add_argument("--evaluator", action="store_true", default=None,
                        help="add an evaluator task (not listed in the cluster) [STRATKIT_EVALUATOR]")
    layout.add_argument("--tune", action="store_true", default=None, help="every worker a tuner of one search "
                        "(stratkit.tune), worker 0 its service; no TF_CONFIG (docs/tuning.md) [STRATKIT_TUNE]")
    layout.add_argument("--workers-per-trial", type=count, default=None, metavar="K", help="with --tune: K workers "
                        "train each trial, as one MWMS cluster (default 1) [STRATKIT_WORKERS_PER_TRIAL]")
    devices = parser.add_argument_group("GPUs (each task's CUDA_VISIBLE_DEVICES; nothing set on a host without GPUs)")
    devices.add_argument("--gpus-per-worker", type=count, default=None, metavar="K",
                         help="GPUs each chief/worker/evaluator gets (default: the visible GPUs split evenly; the "
                              "number of workers must divide them); 0 hides GPUs [STRATKIT_GPUS_PER_WORKER]")
    devices.add_argument("--gpus-per-ps", type=count, default=None, metavar="K",
                         help="GPUs each ps task gets (default 0: none) [STRATKIT_GPUS_PER_PS]")
    devices.add_argument("--share-gpus", action="store_true", default=None,
                         help="let several tasks share a GPU (round robin) instead of refusing; they get "
                              "TF_FORCE_GPU_ALLOW_GROWTH=true [STRATKIT_SHARE_GPUS]")
    run = parser.add_argument_group("supervision")
    run.add_argument("--max-restarts", type=count, default=None, metavar="K",
                     help="restart the whole cluster up to K times after a failure (default 0) "
                          "[STRATKIT_MAX_RESTARTS]")
    run.add_argument("--log-dir", default=None, metavar="DIR",
                     help="also write <role>-<index>.log per task, events.jsonl and root-cause.txt here "
                          "[STRATKIT_LOG_DIR]")
    run.add_argument("--timeout", type=seconds, default=None, metavar="S",
                     help="stop an attempt that runs longer than S seconds, as a failure [STRATKIT_TIMEOUT]")
    run.add_argument("--exit-grace", type=seconds, default=None, metavar="S",
                     help=f"after the chief (or worker 0) finished, give the other tasks S seconds to exit, then "
                          f"stop them without failing (default {DEFAULT_EXIT_GRACE:g}) [STRATKIT_EXIT_GRACE]")
    run.add_argument("--stop-grace", type=seconds, default=None, metavar="S",
                     help=f"seconds between SIGTERM and SIGKILL when stopping tasks (default "
                          f"{DEFAULT_STOP_GRACE:g}) [STRATKIT_STOP_GRACE]")
    run.add_argument("--preemption-signal", type=_arg_type(lambda text: _signal_value(text, "--preemption-signal"),
                                                           "a signal name such as USR1"), default=None, metavar="SIG",
                     help="a signal besides SIGTERM that means the job is preempted (e.g. USR1 for Slurm's "
                          "--signal=B:USR1@120): the launcher stops the tasks with SIGTERM, they back up and exit "
                          "75, and so does the launcher; the tasks treat it as a notice too "
                          f"[{status.PREEMPTION_SIGNAL_VAR}]"),
    net = parser.add_argument_group("addresses")
    net.add_argument("--host", default=None, metavar="ADDR",
                     help=f"address the tasks bind and reach each other at (default {DEFAULT_HOST}) "
                          "[STRATKIT_HOST]")
    net.add_argument("--base-port", type=count, default=None, metavar="P",
                     help="consecutive ports from P instead of free ones picked (and held) by the launcher "
                          f"(with --print-tf-config: default {DEFAULT_PLAN_PORT}) [STRATKIT_BASE_PORT]")
    net.add_argument("--private-network", action=argparse.BooleanOptionalAction, default=None,
                     help="run the tasks in a private network namespace with loopback only, so their TensorFlow "
                          "servers (which listen on all interfaces, unauthenticated) cannot be reached from other "
                          "machines; the tasks cannot reach the network either. Default: on where Linux user "
                          "namespaces allow it (else a warning); --no-private-network: off "
                          "[STRATKIT_PRIVATE_NETWORK]")
    net.add_argument("--hosts", default=None, metavar="H1,H2,...",
                     help="several machines: with --print-tf-config, print what to run on each [STRATKIT_HOSTS]")
    nodes = parser.add_argument_group("several machines (the same command on every node)")
    nodes.add_argument("--nnodes", default=None, metavar="N|MIN:MAX",
                       help="run on N machines: the node that owns --rdzv-endpoint's address serves the rendezvous "
                            "(node 0), the others join it; every node presents STRATKIT_RDZV_TOKEN. MIN:MAX: "
                            "elastic, a lost node shrinks the cluster and a late one grows it, each time resuming "
                            "from backup_dir with the same global batch [STRATKIT_NNODES]")
    nodes.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                       help="the rendezvous: an address of node 0 and a free port [STRATKIT_RDZV_ENDPOINT]")
    nodes.add_argument("--workers-per-node", type=_arg_type(lambda text: _workers_value(text, "--workers-per-node"),
                                                             "a whole number or 'gpu'"), default=None, metavar="K|gpu",
                       help="worker tasks on each node (default 1; gpu: one per GPU of the node); with --chief and --ps M, node 0 also runs "
                            "the chief and ps task j runs on node (j+1) mod N [STRATKIT_WORKERS_PER_NODE]")
    nodes.add_argument("--rdzv-timeout", type=seconds, default=None, metavar="S",
                       help=f"seconds every node waits for all N to join (default {DEFAULT_RDZV_TIMEOUT:g}) "
                            "[STRATKIT_RDZV_TIMEOUT]")
    nodes.add_argument("--rdzv-last-call", type=seconds, default=None, metavar="S",
                       help=f"--nnodes MIN:MAX: once MIN nodes are in, seconds to wait for more before the cluster "
                            f"starts (default {DEFAULT_LAST_CALL:g}); after a node is lost, how long it has to come "
                            "back before the others go on without it [STRATKIT_RDZV_LAST_CALL]")
    net.add_argument("--print-tf-config", action="store_true",
                     help="print each task's `export TF_CONFIG=...` and command instead of running them")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                        help="the program to run as every task, e.g. -- python train.py --epochs 3")
    parser.set_defaults(func=run_launch)
    return parser


def resolve_options(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Flags, else their STRATKIT_* variables, else None: one dict keyed by flag dest."""
    env = os.environ if environ is None else environ
    options: dict[str, Any] = {}
    for flag in _FLAGS:
        value = getattr(args, flag.dest, None)
        if value is None and env.get(flag.var, "").strip():
            value = flag.parse(env[flag.var], flag.var)
        options[flag.dest] = value
    return options


def run_launch(args: argparse.Namespace) -> int:
    """`stratkit launch`: returns the launcher's exit code."""
    options = resolve_options(args)
    command = list(args.command or [])
    if command and command[0] == "--":
        command = command[1:]
    if options["nnodes"] is not None:
        return _run_nodes(command, options, bool(args.print_tf_config))
    for dest in ("rdzv_endpoint", "workers_per_node", "rdzv_timeout", "rdzv_last_call"):
        if options[dest] is not None:
            flag = "--" + dest.replace("_", "-")
            raise ConfigError(f"{flag} is for a launch on several machines. Fix: add --nnodes N (the number of "
                              f"machines), or drop {flag}")
    hosts = _parse_hosts(options["hosts"]) if options["hosts"] else None
    if options["tune"] and (args.print_tf_config or hosts):
        raise ConfigError("--tune runs one search's tuners on this machine, without TF_CONFIG. Fix: drop "
                          "--print-tf-config/--hosts (docs/tuning.md: several machines)")
    if args.print_tf_config:
        print(format_host_plan(command, hosts or [options["host"] or DEFAULT_HOST], options))
        return 0
    if hosts:
        raise ConfigError(f"--hosts {options['hosts']} names several machines, but stratkit launch starts "
                          "processes on this machine only. Fix: add --print-tf-config to print what to run on "
                          "each host (then start them with ssh, your scheduler or a Kubernetes TFJob), or drop "
                          "--hosts to run the whole cluster here")
    result = launch(
        command, workers=1 if options["workers"] is None else options["workers"], chief=bool(options["chief"]),
        ps=options["ps"] or 0, evaluator=bool(options["evaluator"]), max_restarts=options["max_restarts"] or 0,
        log_dir=options["log_dir"] or None, host=options["host"] or DEFAULT_HOST, base_port=options["base_port"],
        timeout=options["timeout"],
        exit_grace=DEFAULT_EXIT_GRACE if options["exit_grace"] is None else options["exit_grace"],
        stop_grace=DEFAULT_STOP_GRACE if options["stop_grace"] is None else options["stop_grace"],
        private_network=options["private_network"], preemption_signal=options["preemption_signal"],
        tune=bool(options["tune"]), workers_per_trial=options["workers_per_trial"] or 1, **_gpu_options(options))
    return result.returncode


def _gpu_options(options: Mapping[str, Any]) -> dict[str, Any]:
    return {"gpus_per_worker": options["gpus_per_worker"], "gpus_per_ps": options["gpus_per_ps"],
            "share_gpus": bool(options["share_gpus"])}


def _run_nodes(command: list[str], options: Mapping[str, Any], print_tf_config: bool) -> int:
    """`--nnodes N`: this node's share; the flags that have no meaning there are refused, each with the fix."""
    refused = {"workers": "--workers-per-node K (each node runs K workers)",
               "tune": "run `stratkit launch --tune --workers N` on one machine (docs/tuning.md: several machines)",
               "evaluator": "drop --evaluator (run an evaluator yourself, reading the chief's checkpoints)",
               "hosts": "drop --hosts: start the same command on every node",
               "host": "drop --host: each node's tasks use the address its connection to --rdzv-endpoint used",
               "base_port": "drop --base-port: every node picks free ports and the rendezvous shares them"}
    for dest, fix in refused.items():
        if options[dest]:
            raise ConfigError(f"--{dest.replace('_', '-')} {options[dest]} does not go with --nnodes. Fix: {fix}")
    if options["private_network"]:
        raise ConfigError("--private-network gives the tasks a loopback-only network, but with --nnodes they must "
                          "reach the other machines. Fix: drop --private-network, and keep the network between the "
                          "hosts private to the cluster (a firewall)")
    if print_tf_config:
        raise ConfigError("--print-tf-config prints a plan with fixed ports for --hosts; with --nnodes the "
                          "rendezvous picks the ports at start. Fix: drop --print-tf-config, or use --hosts instead "
                          "of --nnodes")
    result = launch_node(
        command, nnodes=options["nnodes"], rdzv_endpoint=options["rdzv_endpoint"],
        workers_per_node=1 if options["workers_per_node"] is None else options["workers_per_node"],
        chief=bool(options["chief"]), ps=options["ps"] or 0,
        rdzv_timeout=DEFAULT_RDZV_TIMEOUT if options["rdzv_timeout"] is None else options["rdzv_timeout"],
        rdzv_last_call=DEFAULT_LAST_CALL if options["rdzv_last_call"] is None else options["rdzv_last_call"],
        max_restarts=options["max_restarts"] or 0, log_dir=options["log_dir"] or None, timeout=options["timeout"],
        exit_grace=DEFAULT_EXIT_GRACE if options["exit_grace"] is None else options["exit_grace"],
        stop_grace=DEFAULT_STOP_GRACE if options["stop_grace"] is None else options["stop_grace"],
        preemption_signal=options["preemption_signal"], **_gpu_options(options))
    return result.returncode


def _parse_hosts(text: str) -> list[str]:
    hosts = [h.strip() for h in text.split(",")]
    for host in hosts:
        if not host:
            raise ConfigError(f"--hosts {text!r} has an empty entry. Fix: comma-separate host names, e.g. "
                              "--hosts h1,h2")
        if ":" in host and not _is_ipv6(host):
            raise ConfigError(f"--hosts entry {host!r} has a port. Fix: give host names only (--hosts h1,h2) and "
                              "set the first port with --base-port")
    return hosts


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).version == 6
    except ValueError:
        return False


def plan_hosts(tasks: list[Task], hosts: list[str], base_port: int) -> list[tuple[Task, str, str | None]]:
    """Place tasks on hosts round-robin, in task order (chief, workers, ps, evaluator).

    Round-robin spreads the roles (the ps tasks do not all land on one machine);
    each host numbers its own ports from `base_port`, so one task per host
    uses base_port everywhere. Returns (task, host, "host:port" or None for
    the evaluator, which is not in the cluster).
    """
    next_port: dict[str, int] = {}
    placed = []
    for i, task in enumerate(tasks):
        host = hosts[i % len(hosts)]
        address = None
        if task.serves:
            port = next_port.get(host, base_port)
            next_port[host] = port + 1
            address = format_address(host.strip("[]"), port)
        placed.append((task, host, address))
    return placed


def format_host_plan(command: list[str], hosts: list[str], options: Mapping[str, Any],
                     environ: Mapping[str, str] | None = None) -> str:
    """The shell text that starts the cluster by hand: per task, its host, TF_CONFIG export and command."""
    if not command:
        raise ConfigError("missing the command to run. Fix: put it after --, e.g. "
                          "`stratkit launch --hosts h1,h2 --print-tf-config -- python train.py`")
    workers = options.get("workers")
    if workers == GPU_WORKERS:
        raise ConfigError("--workers gpu counts the GPUs of the machine it runs on, but --print-tf-config plans other "
                          "machines. Fix: --workers N (the cluster's total)")
    tasks = plan_tasks(len(hosts) if workers is None else workers, bool(options.get("chief")),
                       options.get("ps") or 0, bool(options.get("evaluator")))
    base_port = options.get("base_port") or DEFAULT_PLAN_PORT
    placed = plan_hosts(tasks, hosts, base_port)
    if max(port_of(a) for _, _, a in placed if a) > 65535:
        raise ConfigError(f"--base-port {base_port} leaves no room for every task's port. Fix: a lower --base-port")
    cluster = build_cluster(tasks, [a for _, _, a in placed if a])
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if k != "TF_CONFIG"}
    roles = ", ".join(f"{len(a)} {r}" for r, a in cluster.items()) + (", 1 evaluator" if options.get("evaluator")
                                                                       else "")
    lines = [f"# stratkit launch plan: {roles} on {len(set(hosts))} host(s), ports from {base_port}.",
             "# Run each block on its host, in any order (the tasks wait for each other); the ports must be",
             "# reachable between the hosts. For restarts, start every task again (resume: Trainer.fit(backup_dir=...)",
             "# on storage every host shares).",
             *textwrap.wrap(f"Security: {GRPC_EXPOSED}:", 118, initial_indent="# ", subsequent_indent="# "),
             *textwrap.wrap(NETWORK_MUST_BE_PRIVATE, 118, initial_indent="# ", subsequent_indent="# ")]
    run = shlex.join(command)
    for task, host, address in placed:
        tf_config = task_tf_config(cluster, task, env)
        lines += ["", f"# --- {host}: {task.name}" + (f" ({address})" if address else " (not in the cluster)"),
                  f"export TF_CONFIG={shlex.quote(tf_config)}", run]
    return "\n".join(lines)


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])
