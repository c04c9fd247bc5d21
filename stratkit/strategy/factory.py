"""`make_strategy`: build the tf.distribute strategy a `ClusterSpec` calls for.

Detection decides *what* (stratkit.cluster); this module only builds it. The
Keras 3 compatibility layer is applied here, so users who call `model.fit`
themselves on a model built in `make_strategy(...).scope()` get it too.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

from stratkit.cluster import ClusterSpec, detect, slurm
from stratkit.errors import ConfigError
# A private TensorFlow read, so it lives behind the gate; still importable from here as before.
from stratkit.strategy.keras_compat import runtime_initialized

log = logging.getLogger(__name__)

_STARTUP_FIX = ("create the strategy before any other TensorFlow op: call stratkit.make_strategy() "
                "(or stratkit.Trainer()) at the top of the script, before building tensors, models or datasets")


def make_strategy(spec: ClusterSpec | str | None = None, *, strategy: str | None = None,
                  gradient_compression: str | None = None, **options: Any):
    """Build the `tf.distribute.Strategy` for `spec` (detected when None).

    Args:
        spec: the cluster spec; `stratkit.detect(strategy=strategy)` when None.
            A string names the strategy kind exactly as `strategy=` does
            (`make_strategy("mirrored")`); with `strategy=` as well, both must
            name the same kind.
        strategy: an explicit strategy kind; with `spec`, it must agree with the
            spec's cluster (the same rule `detect` applies).
        **options: per-strategy options:
            one_device: `device` (default "/gpu:0" when a GPU is visible, else "/cpu:0").
            mirrored: `devices` (default: all GPUs, else all logical CPUs),
                `logical_cpus=N` (split the CPU into N logical devices first;
                useful for testing on a CPU machine; input batches then stay
                in host memory unless you pass InputOptions), `cross_device_ops`
                ("nccl", "hierarchical_copy", "reduce_to_one_device" or a
                `tf.distribute.CrossDeviceOps`; default: STRATKIT_CROSS_DEVICE_OPS, else
                TensorFlow's: NCCL over GPUs).
            multi_worker_mirrored: `implementation` ("auto", "ring", "nccl"; default
                "nccl" when this worker has GPUs, else "ring"; yours wins),
                `timeout_seconds` (collective timeout; keep it well above any
                chief pause), `bytes_per_pack` (gradient packing).
            parameter_server: `variable_partitioner` (e.g.
                `tf.distribute.experimental.partitioners.MinSizePartitioner`).
            tpu: `tpu` (name or address; default from the spec).
        gradient_compression: None (default), "bf16" or "fp16": cast gradients
            to that dtype for the cross-replica all-reduce and back after it
            (mirrored and multi_worker_mirrored; ignored with a log line on
            parameter_server; nothing to do on one device). See
            `stratkit.strategy.compression`.

    Returns:
        strategy (tf.distribute.Strategy): the strategy. On the `ps` and `worker` tasks of a parameter-server
        cluster it does not return: the task serves its `tf.distribute.Server`
        until the chief signals the end of training, then the process exits 0
        (see `stratkit.strategy.server.serve`).

    Raises:
        ConfigError: on a bad spec/option, or when TensorFlow was already
            initialised where TensorFlow itself would fail: a multi-worker
            strategy with a cluster, or `logical_cpus` that differ from the
            devices TensorFlow started with.
    """
    from stratkit.strategy import compression

    compression.validate(gradient_compression)  # before anything is built
    if isinstance(spec, str):
        spec, strategy = None, _positional_kind(spec, strategy)
    if spec is None:
        spec = detect(strategy=strategy)
    elif strategy is not None:
        spec = _override(spec, strategy)

    pin_gpus(spec)  # before TensorFlow enumerates its devices
    build = _BUILDERS[spec.strategy]
    known = _OPTIONS[spec.strategy]
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"make_strategy got option(s) {unknown} that strategy {spec.strategy!r} does not take. "
                          f"Fix: use only {sorted(known) or 'no options'}")
    from stratkit.strategy import keras_compat

    keras_compat.check_supported()  # below the Keras floor nothing is supported, one device and ps servers included
    from stratkit import timeline

    if timeline.enabled():  # (every builder imports it anyway) TensorFlow's import apart from the strategy's start
        _tf()
        timeline.mark("tensorflow imported")
    result = build(spec, **options)
    # One device never reaches the buggy cross-replica code, so an untested Keras
    # version is no reason to refuse it.
    if spec.strategy in ("mirrored", "multi_worker_mirrored"):
        keras_compat.apply(result)  # also guards the user's own model.fit (callbacks, verbose, ...)
        keras_compat.guard_inputs(result)  # the datasets it distributes: auto-shard policy, Python's tensors copied
    elif spec.strategy == "one_device":
        keras_compat.apply_one_device()  # a model without call() builds as without one; paths routed as on N workers
    elif spec.strategy == "parameter_server":
        # Keras's own fit/evaluate/predict and metrics are wrong under PS: refuse them up front.
        keras_compat.install_fit_guards()
    if spec.strategy in ("one_device", "mirrored", "multi_worker_mirrored"):
        from stratkit.strategy.keras_compat import ownership

        ownership.adopt(result)  # its models' paths (store URLs) are routed on one process as on N workers
    compression.configure(result, spec.strategy, gradient_compression)
    timeline.mark("strategy ready")  # multi-worker: every worker connected (TF waits for them)
    return result


def pin_gpus(spec: ClusterSpec, environ: MutableMapping[str, str] | None = None) -> str | None:
    """In a Slurm step whose tasks all see every GPU of their node, keep only this task's share.

    `stratkit.cluster.slurm.gpu_share` decides (by SLURM_LOCALID; with
    `--gpus-per-task` Slurm's own assignment stands); this sets it as the
    process's CUDA_VISIBLE_DEVICES, which CUDA reads when TensorFlow first
    looks at its devices -- so it must happen before any TensorFlow op, as for
    MultiWorkerMirrored itself. Other sources (the launcher, Spark, a
    platform's TF_CONFIG) set the variable before the process starts.

    Returns:
        The value set, or None when nothing changed.

    Raises:
        ConfigError: when TensorFlow already started (it saw every GPU).
    """
    env = os.environ if environ is None else environ
    if spec.source != "slurm":
        return None
    share = slurm.gpu_share(env)
    if share is None:
        return None
    if "tensorflow" in sys.modules and runtime_initialized():  # (not imported yet: it cannot have started)
        raise ConfigError(f"this Slurm task should use GPUs {share or 'none'} of its node (SLURM_LOCALID="
                          f"{env.get('SLURM_LOCALID')}), but TensorFlow already started and sees them all. Fix: "
                          f"{_STARTUP_FIX}; or give each task its own GPUs with srun --gpus-per-task")
    env["CUDA_VISIBLE_DEVICES"] = env[slurm.PINNED_VAR] = share
    log.info("Slurm task SLURM_LOCALID=%s: CUDA_VISIBLE_DEVICES=%r (its share of the node's GPUs)",
             env.get("SLURM_LOCALID"), share)
    return share


def _positional_kind(positional: str, strategy: str | None) -> str:
    """The kind a string first argument names (as `strategy=` would); refuse a different `strategy=`."""
    from stratkit.cluster.detect import normalize_strategy

    kind = normalize_strategy(positional, var="make_strategy's first argument")
    if strategy is not None and normalize_strategy(strategy) != kind:
        raise ConfigError(f"make_strategy got the strategy kind twice and they differ: {positional!r} as the first "
                          f"argument and strategy={strategy!r}. Fix: name the kind once, e.g. "
                          f"make_strategy({positional!r}) or make_strategy(strategy={strategy!r})")
    return positional if kind else strategy  # an empty string means 'not set', as for strategy=


def _override(spec: ClusterSpec, strategy: str) -> ClusterSpec:
    """Apply an explicit strategy to a given spec with the same rule detect() uses."""
    from stratkit.cluster.detect import _apply_override, normalize_strategy

    kind = normalize_strategy(strategy)
    return _apply_override(spec, kind, f"strategy={strategy!r} was passed explicitly") if kind else spec


def _tf():
    import tensorflow as tf

    return tf


def _build_one_device(spec: ClusterSpec, device: str | None = None):
    tf = _tf()
    if device is None:
        device = "/gpu:0" if tf.config.list_physical_devices("GPU") else "/cpu:0"
    return tf.distribute.OneDeviceStrategy(device)


def configure_logical_cpus(count: int) -> list[str]:
    """Split the first physical CPU into `count` logical devices (before TF starts)."""
    tf = _tf()
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(f"logical_cpus must be a positive integer: got {count!r}. Fix: e.g. logical_cpus=2")
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is None or len(current) != count:
        if runtime_initialized():
            raise ConfigError(f"logical_cpus={count} cannot be applied: TensorFlow already started "
                              f"with {len(current or [1])} CPU device(s). Fix: {_STARTUP_FIX}")
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def host_inputs(strategy: Any) -> Any:
    """Make `strategy`'s two dataset-distributing methods keep batches in host memory unless told otherwise.

    For Mirrored over logical CPUs: every "device" is this host's memory, so
    TensorFlow's prefetch to each device only adds a multi-device iterator
    whose per-device get_next ops block inter-op threads. Measured (TF 2.21,
    2 cores, TensorFlow's default pool of 2 threads): a custom loop that
    creates and advances a distributed iterator inside one `tf.function`
    stalled 3 of 3 runs with it, and finished 3 of 3 in 4-5 s with
    `InputOptions(experimental_fetch_to_device=False)`. Sizing the pool up
    instead (3 threads) also avoided the stall but made one `model.fit` run
    in 3 about 25% slower (benchmarks/README.md). Options the caller passes win.
    """
    tf = _tf()

    def wrap(method: Any) -> Any:
        @functools.wraps(method)
        def distribute(*args: Any, options: Any = None, **kwargs: Any) -> Any:
            if options is None:
                options = tf.distribute.InputOptions(experimental_fetch_to_device=False)
            return method(*args, options=options, **kwargs)

        return distribute

    for name in ("experimental_distribute_dataset", "distribute_datasets_from_function"):
        setattr(strategy, name, wrap(getattr(strategy, name)))
    return strategy


#: `make_strategy("mirrored", cross_device_ops=...)` by name, also from this variable.
CROSS_DEVICE_OPS_VAR = "STRATKIT_CROSS_DEVICE_OPS"
CROSS_DEVICE_OPS = ("nccl", "hierarchical_copy", "reduce_to_one_device")


def cross_device_ops_for(value: Any, environ: Mapping[str, str] | None = None) -> Any:
    """MirroredStrategy's reduction: a name from `CROSS_DEVICE_OPS` (or STRATKIT_CROSS_DEVICE_OPS), or TF's object.

    None and no variable: TensorFlow's default (NCCL over several GPUs). The
    names are the fallbacks users are told to try when several GPUs give NaN
    where one does not (tensorflow/tensorflow#90686): "hierarchical_copy",
    then "reduce_to_one_device".
    """
    env = os.environ if environ is None else environ
    where = "cross_device_ops"
    if value is None and env.get(CROSS_DEVICE_OPS_VAR, "").strip():
        value, where = env[CROSS_DEVICE_OPS_VAR], CROSS_DEVICE_OPS_VAR
    if value is None or not isinstance(value, str):
        return value  # TF's default, or the user's own tf.distribute.CrossDeviceOps
    name = value.strip().lower().replace("-", "_")
    if name not in CROSS_DEVICE_OPS:
        raise ConfigError(f"{where}={value!r} is not a cross-device reduction. Fix: one of "
                          f"{', '.join(CROSS_DEVICE_OPS)} (or a tf.distribute.CrossDeviceOps object)")
    tf = _tf()
    return {"nccl": tf.distribute.NcclAllReduce, "hierarchical_copy": tf.distribute.HierarchicalCopyAllReduce,
            "reduce_to_one_device": tf.distribute.ReductionToOneDevice}[name]()


def _build_mirrored(spec: ClusterSpec, devices: list[str] | None = None, logical_cpus: int | None = None,
                    cross_device_ops: Any = None):
    tf = _tf()
    cross_device_ops = cross_device_ops_for(cross_device_ops)
    if logical_cpus is not None:
        cpu_devices = configure_logical_cpus(logical_cpus)
    if devices is None:
        gpus = tf.config.list_logical_devices("GPU")
        # MirroredStrategy() alone uses one CPU even when several logical CPUs exist.
        devices = [d.name for d in gpus] if gpus else (
            cpu_devices if logical_cpus is not None else [d.name for d in tf.config.list_logical_devices("CPU")])
    strategy = tf.distribute.MirroredStrategy(devices=devices, cross_device_ops=cross_device_ops)
    return host_inputs(strategy) if logical_cpus is not None else strategy


def cluster_resolver(spec: ClusterSpec):
    """A resolver for the spec's own cluster (not re-read from the environment: Slurm specs have no TF_CONFIG)."""
    tf = _tf()
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec.cluster), task_type=spec.task_type, task_id=spec.task_index,
        rpc_layer="grpc", num_accelerators={"GPU": spec.num_gpus} if spec.num_gpus else None)


def _build_multi_worker(spec: ClusterSpec, implementation: str | None = None, timeout_seconds: float | None = None,
                        bytes_per_pack: int = 0):
    tf = _tf()
    if implementation is None:
        # NCCL when this worker has GPUs: the front doors (launcher rendezvous, Spark) refuse clusters mixing
        # GPU and CPU-only workers, which NCCL cannot serve (tensorflow/tensorflow#60847); ring otherwise.
        implementation = "nccl" if tf.config.list_physical_devices("GPU") else "ring"
    impls = {"auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
             "ring": tf.distribute.experimental.CommunicationImplementation.RING,
             "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL}
    if implementation not in impls:
        raise ConfigError(f"implementation={implementation!r} is not a collective implementation. "
                          f"Fix: use one of {sorted(impls)}")
    if spec.task_type in ("evaluator", "ps"):
        # An evaluator is outside the collective group: it evaluates checkpoints on its own devices.
        return _build_mirrored(spec) if spec.num_gpus > 1 else _build_one_device(spec)
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=impls[implementation], timeout_seconds=timeout_seconds, bytes_per_pack=bytes_per_pack)
    # Measured (TF 2.21): after an eager op, MWMS with a cluster (even of one worker) fails with
    # 'Collective ops must be configured at program startup'; with no cluster it works.
    if spec.cluster and runtime_initialized():
        raise ConfigError("MultiWorkerMirroredStrategy must be created before TensorFlow runs any op "
                          f"(TensorFlow raises 'Collective ops must be configured at program startup'). Fix: {_STARTUP_FIX}")
    resolver = cluster_resolver(spec) if spec.cluster else None
    if spec.cluster:
        from stratkit.strategy.startup import wait_for_leader

        wait_for_leader(spec.cluster, spec.task_type, spec.task_index)  # no gRPC reconnect backoff (~1 s)
    try:
        return tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver, communication_options=options)
    except RuntimeError as exc:
        if "program startup" in str(exc):
            raise ConfigError(f"MultiWorkerMirroredStrategy could not be created ({exc}). Fix: {_STARTUP_FIX}") from None
        raise


def _build_parameter_server(spec: ClusterSpec, variable_partitioner: Any = None):
    tf = _tf()
    if spec.task_type in ("ps", "worker"):
        from stratkit.strategy.server import serve

        serve(spec)  # never returns: exits 0 when the chief signals the end
    if spec.task_type == "evaluator":
        return _build_mirrored(spec) if spec.num_gpus > 1 else _build_one_device(spec)
    from dataclasses import replace

    from stratkit.strategy.server import configure_coordinator, end_training_at_exit

    configure_coordinator(spec)
    # The evaluator runs no server: listed in the coordinator's cluster, the
    # connection waits for it forever (measured: the chief hangs in the constructor).
    training = replace(spec, cluster={r: a for r, a in spec.cluster.items() if r != "evaluator"})
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        cluster_resolver(training), variable_partitioner=variable_partitioner)
    end_training_at_exit(spec)
    return strategy


def _build_tpu(spec: ClusterSpec, tpu: str | None = None):
    tf = _tf()
    name = tpu if tpu is not None else spec.tpu
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=name)
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
    except Exception as exc:  # noqa: BLE001 - URLError, NotFoundError, ValueError: all mean 'no TPU here'
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"no TPU could be reached for TPU_NAME={name!r}: {first_line}. Fix: run on a TPU VM "
                          "or set TPU_NAME to a reachable TPU; on a CPU/GPU machine use another strategy "
                          "(STRATKIT_STRATEGY=one_device or mirrored)") from None
    return tf.distribute.TPUStrategy(resolver)


_BUILDERS = {
    "one_device": _build_one_device,
    "mirrored": _build_mirrored,
    "multi_worker_mirrored": _build_multi_worker,
    "parameter_server": _build_parameter_server,
    "tpu": _build_tpu,
}
_OPTIONS = {
    "one_device": {"device"},
    "mirrored": {"devices", "logical_cpus", "cross_device_ops"},
    "multi_worker_mirrored": {"implementation", "timeout_seconds", "bytes_per_pack"},
    "parameter_server": {"variable_partitioner"},
    "tpu": {"tpu"},
}
