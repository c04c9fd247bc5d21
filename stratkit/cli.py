"""The `stratkit` command: info, tf-config (and launch, when installed).

`stratkit --help` and `stratkit info --json` never import TensorFlow, so they
answer in well under a second.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from importlib import metadata

from stratkit.cluster import ROLES, detect, gpus
from stratkit.errors import ConfigError


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _tested_versions() -> dict[str, frozenset[str]]:
    """Versions the test suites ran on, per distribution name.

    TensorFlow and Keras: the pairs `make compat` proved (the gate's own tables).
    tf-keras and pyspark: the versions `make test` ran with.
    """
    from stratkit.strategy import keras_compat  # TF-free

    return {
        "tensorflow": keras_compat.TESTED_TENSORFLOW_VERSIONS,
        "tensorflow-cpu": keras_compat.TESTED_TENSORFLOW_VERSIONS,
        "keras": keras_compat.TESTED_KERAS_VERSIONS,
        "tf-keras": frozenset({"2.21.0"}),
        "pyspark": frozenset({"4.3.0"}),
    }


def _versions() -> tuple[dict[str, str | None], dict[str, bool]]:
    """Installed versions (from package metadata: no import, so no TensorFlow start) and which are tested."""
    versions = {name: _version(name) for name in
                ("stratkit", "tensorflow", "tensorflow-cpu", "keras", "tf-keras", "pyspark")}
    tested = {name: version in allowed for name, allowed in _tested_versions().items()
              if (version := versions.get(name)) is not None}
    return versions, tested


def _gpu_plan(args: argparse.Namespace, visible: list[str]) -> dict[str, str | None] | None:
    """With --workers: which GPUs `stratkit launch` would give each worker here (the launcher's own rule)."""
    if args.workers is None:
        return None
    text = str(args.workers).strip().lower()
    if text == "gpu":
        count = len(visible)
    elif text.isdigit() and int(text) >= 1:
        count = int(text)
    else:
        raise ConfigError(f"--workers {args.workers!r} is not a number of workers. Fix: e.g. --workers 4, or "
                          "--workers gpu (one per visible GPU)")
    if count == 0:
        raise ConfigError("--workers gpu: no GPU is visible here. Fix: --workers N")
    names = [f"worker:{i}" for i in range(count)]
    assignments = gpus.assign(visible, ["worker"] * count, per_task=args.gpus_per_worker,
                              share=bool(args.share_gpus))
    return {name: a.visible for name, a in zip(names, assignments)}


def _info(args: argparse.Namespace) -> int:
    spec = detect(strategy=args.strategy)
    versions, tested = _versions()
    visible = gpus.visible_gpus(os.environ)
    plan = _gpu_plan(args, visible)
    report = {
        "spec": spec.to_dict(),
        "tf_config": spec.to_tf_config(),
        "devices": {"gpus": spec.num_gpus, "cpus": os.cpu_count(),
                    "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"), "visible_gpus": visible},
        **({"launch_gpus": plan} if plan is not None else {}),
        "versions": versions,
        "tested": tested,
        "python": sys.version.split()[0],
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"strategy      {spec.strategy}")
    role = f"{spec.task_type}:{spec.task_index}" if spec.task_type else "single host"
    print(f"task          {role}{' (chief)' if spec.is_chief else ''}")
    print(f"workers       {spec.num_workers}")
    print(f"source        {spec.source}")
    for role_name, addresses in spec.cluster.items():
        print(f"cluster       {role_name}: {', '.join(addresses)}")
    print("why")
    for reason in spec.reasons:
        print(f"  - {reason}")
    print(f"devices       {spec.num_gpus} GPU(s), {os.cpu_count()} CPU core(s)")
    source = ("CUDA_VISIBLE_DEVICES" if "CUDA_VISIBLE_DEVICES" in os.environ else "the NVIDIA driver")
    print(f"gpus          {','.join(visible) or 'none'} (from {source})")
    if plan is not None:
        print(f"launch        stratkit launch --workers {args.workers} would give:")
        for name, value in plan.items():
            print(f"  {name:<12}" + ("GPUs as the environment sets them (no GPU here)" if value is None
                                     else f"CUDA_VISIBLE_DEVICES={value!r}"))
    print("versions")
    for name, version in versions.items():
        if version:
            note = "" if name not in tested else ("  tested" if tested[name] else "  NOT tested")
            print(f"  {name:<15}{version}{note}")
    if "keras" in tested and not tested["keras"]:
        from stratkit.strategy import keras_compat

        keras = str(versions["keras"])
        below = keras_compat.version_tuple(keras) < keras_compat.version_tuple(keras_compat.KERAS_FLOOR)
        advice = (f"Keras {keras} is below the floor and refused; pip install 'keras>={keras_compat.KERAS_FLOOR}'"
                  if below else f"to prove Keras {keras}: {keras_compat.COMPAT_COMMAND.format(keras=keras)}")
        print(f"  stratkit supports {keras_compat.supported_range()}; {advice}")
    return 0


def parse_cluster_arg(values: list[str]) -> dict[str, list[str]]:
    """Parse `worker=h1:2222,h2:2222 ps=h3:2222` (repeatable) into a cluster dict."""
    cluster: dict[str, list[str]] = {}
    for value in values:
        for part in value.split():
            role, sep, addresses = part.partition("=")
            if not sep or not addresses:
                raise ConfigError(f"--cluster {part!r} is not ROLE=host:port[,host:port]. "
                                  "Fix: e.g. --cluster worker=h1:2222,h2:2222 ps=h3:2222")
            cluster.setdefault(role.strip(), []).extend(a.strip() for a in addresses.split(",") if a.strip())
    return cluster


def _tf_config(args: argparse.Namespace) -> int:
    cluster = parse_cluster_arg(args.cluster)
    role, sep, index = args.task.partition(":")
    # isascii + a length cap: int() of thousands of digits raises a plain ValueError.
    if not sep or not (index.isascii() and index.isdigit()) or len(index) > 9:
        raise ConfigError(f"--task {args.task!r} is not ROLE:INDEX. Fix: e.g. --task worker:1 "
                          f"(roles: {', '.join(ROLES)})")
    text = json.dumps({"cluster": cluster, "task": {"type": role, "index": int(index)}})
    try:
        spec = detect({"TF_CONFIG": text})  # the same rule and validation every task will apply
    except ConfigError as exc:
        raise ConfigError(f"--cluster/--task describe an invalid cluster: {exc}") from None
    out = spec.to_tf_config()
    print(f"export TF_CONFIG={shlex.quote(out)}" if args.export else out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stratkit", description=(
        "Distributed Keras training on TensorFlow: detect the cluster, build the strategy, launch."))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    info = sub.add_parser("info", help="show the detected cluster, strategy, devices and versions")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.add_argument("--strategy", default=None, help="an explicit strategy, as stratkit.detect(strategy=...)")
    info.add_argument("--workers", default=None, metavar="N|gpu",
                      help="also show which GPUs `stratkit launch --workers N` would give each worker here")
    info.add_argument("--gpus-per-worker", type=int, default=None, metavar="K",
                      help="with --workers: as `stratkit launch --gpus-per-worker K`")
    info.add_argument("--share-gpus", action="store_true", help="with --workers: as `stratkit launch --share-gpus`")
    info.set_defaults(func=_info)

    tfc = sub.add_parser("tf-config", help="print a validated TF_CONFIG for one task of a cluster")
    tfc.add_argument("--cluster", action="append", required=True, metavar="ROLE=HOST:PORT[,...]",
                     help="e.g. worker=h1:2222,h2:2222 (repeat or space-separate for ps=..., chief=...)")
    tfc.add_argument("--task", required=True, metavar="ROLE:INDEX", help="e.g. worker:1")
    tfc.add_argument("--export", action="store_true", help="print a shell `export TF_CONFIG=...` line")
    tfc.set_defaults(func=_tf_config)

    try:
        from stratkit.launch.cli import add_launch_parser
    except ImportError:
        pass
    else:
        add_launch_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"stratkit: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
