"""The Keras version gate: every private Keras/TensorFlow use of stratkit lives behind it.

Keras 3's TensorFlow trainer has two bugs that stop ``fit``/``evaluate`` under
multi-worker ``MultiWorkerMirroredStrategy`` (:mod:`.trainer_patches`), and
stratkit needs a few more Keras/TF internals (the guards for the user's own
``model.fit``, the parameter-server loop, the gradient all-reduce hook, a few
private reads). All of them replace or read private code, so they are applied
only to Keras versions they were verified on (:data:`TESTED_KERAS_VERSIONS`,
proved by the compat suite ``make compat`` / ``tools/compat.py`` on real
worker processes). Below :data:`KERAS_FLOOR` every strategy is refused, even
when forced (forcing is measured to train wrong there). On any other Keras 3
version :func:`apply` runs a cheap in-process probe of the installed functions
(:mod:`.self_check`); if it cannot prove both bugs are gone it raises
:class:`~stratkit.errors.KerasCompatError` instead of letting training fail
later or, worse, silently do something else. The parameter-server loop sits
behind the same gate (:func:`check_parameter_server`).

The modules, one responsibility each:

* :mod:`.versions`: the tested sets, the floor, ``STRATKIT_KERAS_COMPAT``, version parsing;
* :mod:`.trainer_patches`: the trainer fixes (:mod:`.step_gate`: a step runs nothing without its batch);
  :mod:`.self_check`: the probe for untested versions; :mod:`.replicas`: how many replicas train in sync;
* :mod:`.global_gradient`: the global gradient (counts, clipping, loss scaling; :mod:`.accumulation`,
  :mod:`.float8`), with :mod:`.synced_logs` (logs from the summed state), :mod:`.batchnorm` (the global
  batch's moments) and :mod:`.layer_losses` (each replica thread's own ``add_loss`` losses);
* :mod:`.replica_seeds`: each replica its own random numbers (the replica id folded into ``SeedGenerator``'s seeds);
* :mod:`.replica_state`: state a layer assigns in a replica step (``aggregation="none"``) set to the replicas'
  row-weighted mean, one value everywhere;
* :mod:`.optimizer_build`: a custom loop's optimizer, built by its first ``apply`` in ``strategy.run``,
  is built in the cross-replica context; :mod:`.on_batch`: ``*_on_batch`` split over the replicas;
* :mod:`.array_shuffle`: the arrays ``fit`` shuffles take one order on every worker;
* :mod:`.fit_guards` (the user's own ``model.fit``) and :mod:`.metric_guard` (Keras metrics in PS steps);
* :mod:`.parameter_server`: what the PS loop needs of Keras, and its refusals;
* :mod:`.all_reduce`: the gradient all-reduce hook ``gradient_compression`` uses;
* :mod:`.variable_scalars`: ``float()``/``int()`` of Keras variables holding distributed values;
* :mod:`.save_guards`: ``model.save``/``export`` under a stratkit strategy (:mod:`.ownership` decides whose);
* :mod:`.distributed_input`: every dataset a Mirrored/MWMS strategy distributes gets its auto-shard policy
  (:mod:`.sharding`: exact DATA unless FILE was chosen, FILE checked against the files) and a copy of the
  tensors Python made (:mod:`.dataset_graph` reads the pipeline);
* :mod:`.internals`: small private reads/writes the training code needs; :mod:`.coordination`: TensorFlow's
  coordination service key-value store (how a preemption notice reaches every worker, beside the steps);
* :mod:`.resume_step`: a resumed ``fit`` starts its first epoch at the backup's step
  (installed on demand by :func:`install_resume_step`); :mod:`.callback_state`: the counters
  of Keras's own callbacks (EarlyStopping, ReduceLROnPlateau, ModelCheckpoint, TensorBoard,
  History) read and written back for a backup.

This package (this file) holds the decisions: :func:`apply`, :func:`revert`,
:func:`check_supported`, :func:`check_parameter_server`. They read the Keras
version through this package's name :func:`installed_keras_version` (and the
self-check through :func:`upstream_bugs_present`), so a test can substitute
either with ``monkeypatch.setattr(keras_compat, ...)``. Private Keras/TF access
anywhere else in stratkit fails ``tests/strategy/test_private_api_gate.py``
(sibling gate modules are named ``stratkit/strategy/keras_*.py``).

Nothing here imports TensorFlow or Keras at import time: ``import stratkit``
must stay TensorFlow-free. Everything heavy is imported inside the functions.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from stratkit.errors import KerasCompatError

# Re-exported: tests, tools/compat.py and the rest of stratkit import these names from the package
# (private ones included), as they did from the single module it replaced.
from stratkit.strategy.keras_compat import batchnorm as _batchnorm
from stratkit.strategy.keras_compat import distributed_input as _distributed_input
from stratkit.strategy.keras_compat import fit_guards as _fit_guards
from stratkit.strategy.keras_compat import global_gradient as _global_gradient
from stratkit.strategy.keras_compat import layer_losses as _layer_losses
from stratkit.strategy.keras_compat import replica_seeds as _replica_seeds
from stratkit.strategy.keras_compat import replica_state as _replica_state
from stratkit.strategy.keras_compat import resume_step as _resume_step
from stratkit.strategy.keras_compat import synced_logs as _synced_logs
from stratkit.strategy.keras_compat import parameter_server as _parameter_server
from stratkit.strategy.keras_compat import save_guards as _save_guards
from stratkit.strategy.keras_compat import variable_scalars as _variable_scalars
from stratkit.strategy.keras_compat.fit_guards import (
    _guarded,
    _is_chief,
    check_jit_compile,
    check_stateful_rnn,
    check_steps_per_execution,
    revert_fit_guards,
)
from stratkit.strategy.keras_compat.internals import (
    configured_learning_rate,
    dataset_batch_size,
    resume_epoch,
    runtime_initialized,
    set_resume_epoch,
)
from stratkit.strategy.keras_compat.metric_guard import ParameterServerMetricError, _in_parameter_server_step
from stratkit.strategy.keras_compat.parameter_server import (
    PS_FIX,
    is_parameter_server,
    model_losses_override,
    parameter_server_internals_missing,
    parameter_server_refusal,
)
from stratkit.strategy.keras_compat.self_check import BUG_SCALAR_REDUCE, BUG_SYMBOLIC_BUILD, upstream_bugs_present
from stratkit.strategy.keras_compat.trainer_patches import (
    _install,
    _is_multi_worker_collective,
    _maybe_symbolic_build,
    _originals,
    _reduce_per_replica,
    _trainer_module,
    _uninstall,
)
from stratkit.strategy.keras_compat.versions import (
    _PATCH_MARK,
    COMPAT_COMMAND,
    ENV_VAR,
    KERAS_FLOOR,
    TESTED_KERAS_VERSIONS,
    TESTED_TENSORFLOW_VERSIONS,
    _major,
    _mode,
    _newest_tested,
    installed_keras_version,
    refuse_below_floor,
    supported_range,
    version_tuple,
)

is_multi_worker_collective = _is_multi_worker_collective  # MWMS over several workers? (the training layer asks)

__all__ = [
    "ENV_VAR",
    "is_multi_worker_collective",
    "PS_FIX",
    "ParameterServerMetricError",
    "KERAS_FLOOR",
    "TESTED_KERAS_VERSIONS",
    "TESTED_TENSORFLOW_VERSIONS",
    "apply",
    "apply_one_device",
    "check_parameter_server",
    "check_supported",
    "check_jit_compile",
    "check_stateful_rnn",
    "check_steps_per_execution",
    "guard_inputs",
    "install_fit_guards",
    "install_resume_step",
    "installed_keras_version",
    "is_parameter_server",
    "parameter_server_refusal",
    "revert",
    "resume_epoch",
    "revert_fit_guards",
    "settle_sharding",
    "supported_range",
    "upstream_bugs_present",
    "version_tuple",
]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_status: str | None = None


def check_supported(version: str | None = None) -> None:
    """Refuse a Keras 3 release below :data:`KERAS_FLOOR`, whatever :data:`ENV_VAR` says.

    ``make_strategy`` calls it for every strategy (``off`` skips :func:`apply`, not this).

    Keras 2 / tf-keras (major version < 3) passes: it needs no fixes. The
    refusal is not subject to ``force`` because forcing these releases is known
    to crash inside the patches or train wrong without an error.

    Raises:
        KerasCompatError: naming the installed version, the supported range and the fix.
    """
    refuse_below_floor(installed_keras_version() if version is None else version)


def _refusal(version: str, bugs: list[str]) -> KerasCompatError:
    """The error raised for an untested Keras version (at or above the floor) that still has a bug."""
    return KerasCompatError(
        f"Keras {version} is installed, but stratkit's multi-worker fixes for Keras 3 "
        f"were only proved on {supported_range()}, and a self-check of Keras {version} "
        f"could not show these upstream bugs are fixed: {'; '.join(bugs)}. "
        f"Fix: install a tested version (pip install keras=={_newest_tested()}); or prove this one "
        f"with `{COMPAT_COMMAND.format(keras=version)}` in a stratkit checkout and add it to "
        f"TESTED_KERAS_VERSIONS; or set {ENV_VAR}=force to apply the patches to Keras {version} "
        f"at your own risk, or {ENV_VAR}=off to run Keras {version} unpatched."
    )


def apply(strategy: Any = None) -> str:
    """Make Keras 3 work under MWMS / MirroredStrategy; safe to call many times.

    Patches once per process and caches the outcome (a refusal is not cached,
    so a fixed environment can retry). Returns:

    * ``"patched"``: Keras is a tested version; the fixes are installed.
    * ``"forced"``: Keras is untested and still buggy, but
      ``STRATKIT_KERAS_COMPAT=force``; the fixes are installed anyway.
    * ``"not_needed"``: a ``keras`` package older than 3 (``TF_USE_LEGACY_KERAS=1``
      alone does not count: it changes only ``tf.keras``),
      a non-TensorFlow Keras backend, or an untested Keras 3 whose self-check
      shows both bugs fixed upstream. Nothing is changed.
    * ``"disabled"``: ``STRATKIT_KERAS_COMPAT=off``. Nothing is changed.

    Raises:
        KerasCompatError: an untested Keras 3 version that still has a bug (or
            cannot be checked), and no override is set.
        ConfigError: ``STRATKIT_KERAS_COMPAT`` has an unknown value.

    ``strategy`` is optional and only used for a log line: the fixes act on
    Keras classes, so they cover every strategy in the process and change
    nothing for strategies that never hit the buggy code (they delegate to
    the original code, or build from identical shapes). Calling this before or
    after creating the strategy both work: no TensorFlow op is run.
    """
    global _status
    with _lock:
        if _status is not None:
            return _status
        mode = _mode()
        if mode == "off":
            log.info("%s=off: Keras 3 multi-worker fixes not applied.", ENV_VAR)
            _status = "disabled"
            return _status
        version = installed_keras_version()
        major = _major(version)
        if major < 3:
            _status = "not_needed"  # Keras 2 / tf-keras has neither bug.
            return _status
        check_supported(version)  # below the floor: refused, force or not
        import keras

        if keras.backend.backend() != "tensorflow":
            _status = "not_needed"  # tf.distribute is irrelevant to jax/torch.
            return _status
        if version in TESTED_KERAS_VERSIONS:
            _install_all()
            _status = "patched"
        else:
            bugs = upstream_bugs_present()
            if not bugs:
                log.info("Keras %s: self-check shows the bugs fixed upstream; not patching.", version)
                _status = "not_needed"
            elif mode == "force":
                log.warning(
                    "Keras %s is not among the tested versions %s; %s=force: "
                    "applying stratkit's Keras fixes at your own risk.",
                    version,
                    sorted(TESTED_KERAS_VERSIONS),
                    ENV_VAR,
                )
                _install_all()
                _status = "forced"
            else:
                raise _refusal(version, bugs)
        install_fit_guards()
        _variable_scalars.install(version, mode)  # float(model.optimizer.learning_rate) in a callback
        _save_guards.install()  # every worker's model.save(path) under MWMS: no race on the path
        log.debug(
            "keras_compat.apply: %s (Keras %s, strategy %s)",
            _status,
            version,
            type(strategy).__name__ if strategy is not None else None,
        )
        return _status


def apply_one_device() -> bool:
    """What one device needs: a model without ``call()`` (Keras's DCGAN/VAE examples) trains as without a strategy,
    a step needs its batch, and the user's paths (store URLs) are routed as on N workers.

    Keras builds every model under a strategy by calling it, which a model with only a ``train_step`` cannot
    do (see :mod:`.trainer_patches`), and counts an optimizer step for the step that meets the end of an input
    (:mod:`.step_gate`). ``make_strategy`` calls this for its one-device choice. The trainer fixes go in on a
    tested Keras only: one device is never refused for an untested Keras, nor forced (:func:`apply` would take
    them for an upstream fix). The guards on ``fit`` and ``save`` go in as :func:`apply` installs them.

    Returns:
        True when the trainer fixes are in place.
    """
    if not install_fit_guards():    # off, Keras 2, another backend: nothing is installed
        return False
    _save_guards.install()
    if installed_keras_version() not in TESTED_KERAS_VERSIONS:
        return False
    with _lock:
        _install()
    return True


def revert() -> None:
    """Restore the original Keras functions and forget the cached :func:`apply` result.

    For tests and for callers who need upstream behaviour back in this process.
    """
    global _status
    revert_fit_guards()
    _variable_scalars.revert()
    _save_guards.revert()
    with _lock:
        _uninstall()
        _global_gradient.uninstall()
        _layer_losses.uninstall()
        _synced_logs.uninstall()
        _batchnorm.uninstall()
        _replica_seeds.uninstall()
        _replica_state.uninstall()
        _resume_step.uninstall()
        _status = None


def _install_all() -> None:
    """The trainer fixes, the global-gradient path and global BatchNorm moments (each idempotent)."""
    _install()
    _global_gradient.install()
    _layer_losses.install()   # the count all-reduce pauses a replica thread: keep its added losses its own
    _synced_logs.install()
    _batchnorm.install()
    _replica_seeds.install()  # Dropout, augmentation, keras.random: each replica its own draws
    _replica_state.install()  # a layer's assigned state: the replicas' row-weighted mean, the same everywhere


def install_fit_guards() -> bool:
    """Install the guards on Keras's ``fit``/``evaluate``/``predict`` (idempotent).

    Called by :func:`apply` and by ``make_strategy`` for parameter-server
    strategies. Nothing is installed with ``STRATKIT_KERAS_COMPAT=off``, on
    Keras 2 (tf-keras) or on a non-TensorFlow Keras backend. The metric guard
    touches private Keras code, so it is installed only on tested Keras
    versions (or with ``STRATKIT_KERAS_COMPAT=force``). See :mod:`.fit_guards`.

    Returns:
        True when the guards are in place.
    """
    return _fit_guards.install(installed_keras_version(), _mode())


def install_resume_step() -> bool:
    """Let a resumed ``fit`` start its first epoch at a backup's step (:mod:`.resume_step`); idempotent.

    Installed on a tested Keras (or with ``STRATKIT_KERAS_COMPAT=force``), never
    with ``off``: the backup callback calls it before a mid-epoch resume and
    refuses the resume (with the fix) when it returns False.
    """
    mode = _mode()
    if mode == "off" or (installed_keras_version() not in TESTED_KERAS_VERSIONS and mode != "force"):
        return False
    return _resume_step.install()
def guard_inputs(strategy: Any) -> Any:
    """Every dataset `strategy` distributes: its auto-shard policy settled, Python's tensors copied.

    ``make_strategy`` calls it for Mirrored and MultiWorkerMirrored strategies
    (see :mod:`.distributed_input`); it wraps that strategy object's
    ``experimental_distribute_dataset``, which ``model.fit``/``evaluate``/``predict``
    and custom loops call. Nothing changes with ``STRATKIT_KERAS_COMPAT=off``.

    Returns:
        `strategy`.
    """
    if _mode() == "off":
        return strategy
    return _distributed_input.install(strategy)


def settle_sharding(dataset: Any, strategy: Any) -> Any:
    """`dataset` with the auto-shard policy it trains with under `strategy` (:func:`.sharding.settle`).

    AUTO becomes DATA (exact); a policy the user set is kept, FILE refused before step 1 with fewer files
    than workers.

    Raises:
        ConfigError: FILE with fewer files than workers.
    """
    from stratkit.strategy.keras_compat import sharding

    return sharding.settle(dataset, sharding.workers_of(strategy))


def check_parameter_server(model: Any = None) -> None:
    """Refuse parameter-server training up front on a Keras it was not proved on.

    The PS loop runs on Keras internals (``_compute_loss``, ``_symbolic_build``,
    ``_loss_tracker``, ...), so it sits behind the same gate as the sync patches:
    below :data:`KERAS_FLOOR` refused in every mode; an untested version refused
    unless ``STRATKIT_KERAS_COMPAT=force`` (``off`` means "do not patch", and the PS
    loop patches nothing, so it is treated like ``auto``); and in every case the
    internals it needs must be there (:func:`parameter_server_internals_missing`),
    so an incompatible Keras fails here rather than with an ``AttributeError``
    deep inside the first scheduled step.

    Raises:
        KerasCompatError: naming the version, what is missing and the fix.
    """
    _parameter_server.check(installed_keras_version(), _mode(), model)
