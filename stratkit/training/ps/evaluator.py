"""Sidecar evaluation on the evaluator task of a parameter-server cluster.

Keras 3 has no SidecarEvaluator. On the evaluator task, `trainer.fit` (the same
call as on the chief, from the same script) runs `run_sidecar_evaluation`: it
watches the chief's checkpoints in `backup_dir`, evaluates each new one on
`validation_data` in this process, and writes the metrics as TensorBoard
scalars and one log line per checkpoint. What the user passes to `fit`, on
every task:

  * `backup_dir`: a directory the chief and the evaluator can both read (shared
    storage on a real cluster). The chief writes `epoch-N.weights.h5` and
    `checkpoint.json` there after every epoch (atomically; see
    `stratkit.training.backup`).
  * `validation_data`: what the evaluator evaluates (numpy arrays, a
    `tf.data.Dataset` unbatched (batched here with `global_batch_size`) or
    already batched with the global batch, or a dataset_fn).
  * optionally a `keras.callbacks.TensorBoard` in `callbacks`: the summaries go
    to `<its log_dir>/eval`; without one, to `<backup_dir>/eval`. A store URL
    (``s3://...``) is written to a local staging directory and uploaded after
    each evaluation (`stratkit.storage.Mirror`).

When it ends: the chief writes `training-done.json` naming the final weights
when training ends; the evaluator evaluates that file (unless it already saw
that epoch) and returns. A marker older than this evaluation is a previous
run's and is ignored: mtimes are compared on the shared directory's own clock,
against `backup_dir/evaluator-started`, written when the evaluation starts. If
the chief disappears without that marker for `STRATKIT_CHIEF_GRACE_SECONDS`,
the evaluator stops with an error instead of waiting forever.

Checkpoints are evaluated newest first: an evaluator slower than the chief
skips epochs rather than falling behind.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any, Iterable

import keras

from stratkit import files, status, storage
from stratkit.errors import ChiefGoneError, ConfigError
from stratkit.strategy import scratch
from stratkit.training import backup as backup_lib
from stratkit.training import inputs
from stratkit.training.ps import variables
from stratkit.training.ps.checkpoints import DONE_FILE, read_done_marker
from stratkit.training.ps.metrics import Metrics

log = status.logger(__name__)

STARTED_FILE = "evaluator-started"


def summary_dir(backup_dir: str, callbacks: Iterable[Any] = ()) -> str:
    """Where the evaluator writes its TensorBoard summaries (a directory or a store URL)."""
    for callback in callbacks or ():
        if isinstance(callback, keras.callbacks.TensorBoard):
            return storage.join(os.fspath(callback.log_dir), "eval")
    return storage.join(backup_dir, "eval")


def _staged(out_dir: str) -> tuple[str, storage.Mirror | None]:
    """The local directory the summary writer writes, and for a store URL the mirror that uploads it."""
    if not storage.is_url(out_dir):
        return out_dir, None
    staging = scratch.make("stratkit-eval-summaries-")
    return staging, storage.Mirror(staging, storage.check_store(out_dir, "TensorBoard(log_dir=...) eval"))


def _push(mirror: storage.Mirror | None) -> None:
    if mirror is None:
        return
    try:
        mirror.push()
    except OSError as exc:   # the next evaluation's push tries again
        log.warning("evaluator: could not upload the summaries to %s (%s)", mirror.store.shown, exc)


def run_sidecar_evaluation(trainer: Any, model: Any, validation_data: Any, *,
                           backup_dir: str | os.PathLike[str] | None, global_batch_size: int | None,
                           validation_steps: int | None = None, callbacks: Iterable[Any] = (), verbose: Any = None,
                           poll_seconds: float = 1.0) -> keras.callbacks.History:
    """Evaluate every checkpoint the chief writes to `backup_dir` until training ends.

    Returns:
        A `keras.callbacks.History` whose `.history` has one `val_<metric>` entry
        per evaluated checkpoint and whose `.epoch` lists the checkpoints' epochs.

    Raises:
        ConfigError: `backup_dir` or `validation_data` is missing.
        ChiefGoneError: the chief vanished for the grace period without ending training.
    """
    import tensorflow as tf

    from stratkit.strategy.server import (DEFAULT_GRACE, DEFAULT_STARTUP, GRACE_VAR, STARTUP_VAR,
                                          _chief_reachable)

    if backup_dir is None:
        raise ConfigError("backup_dir=None on the evaluator task: it evaluates the checkpoints the chief writes to "
                          "backup_dir. Fix: pass backup_dir=<a directory the chief and the evaluator can both "
                          "read> to trainer.fit (the same on every task)")
    if validation_data is None:
        raise ConfigError("validation_data=None on the evaluator task: it has nothing to evaluate. Fix: pass "
                          "validation_data=(x_val, y_val) (or a dataset) to trainer.fit")
    directory = os.fspath(backup_dir)
    dataset = inputs.local_dataset(validation_data, global_batch_size, validation_steps)
    with trainer.strategy.scope():
        variables.build(model, inputs.batched_element_spec(dataset.element_spec, batched=True))
    metrics = Metrics.of(model)

    out_dir = summary_dir(directory, callbacks)
    local_out, mirror = _staged(out_dir)
    os.makedirs(local_out, exist_ok=True)
    os.makedirs(directory, exist_ok=True)
    # In backup_dir itself: compared with the chief's marker there, on that filesystem's clock.
    started = _touch(os.path.join(directory, STARTED_FILE))
    writer = tf.summary.create_file_writer(local_out)
    history = keras.callbacks.History()
    history.set_model(model)
    history.on_train_begin()
    quiet = verbose == 0
    if not quiet:
        log.info("evaluator: watching %s for checkpoints; summaries in %s", directory, out_dir)

    chief = trainer.spec.cluster.get("chief", [None])[0]
    grace = float(os.environ.get(GRACE_VAR, DEFAULT_GRACE))
    startup = float(os.environ.get(STARTUP_VAR, DEFAULT_STARTUP))
    begun = time.monotonic()
    evaluated, seen_chief, gone_since = 0, False, None

    def evaluate(epoch: int, path: str) -> bool:
        try:
            with warnings.catch_warnings():
                # The optimizer's state is of no use here (and differs in shape when the chief's
                # variables are sharded): only the model's weights are evaluated.
                warnings.filterwarnings("ignore", message="Skipping variable loading for optimizer")
                model.load_weights(path)
        except (OSError, ValueError) as exc:  # pruned since it was named (then the next one comes), or broken
            log.warning("evaluator: could not load %s: %r", path, exc)
            return False
        logs = {f"val_{name}": value for name, value in metrics.evaluate(dataset).items()}
        with writer.as_default(step=epoch):
            for name, value in logs.items():
                if isinstance(value, float):
                    tf.summary.scalar(f"epoch_{name[len('val_'):]}", value)
        writer.flush()
        _push(mirror)
        history.on_epoch_end(epoch, logs)
        if not quiet:
            values = " - ".join(f"{k}: {v:.4f}" for k, v in logs.items() if isinstance(v, float))
            log.info("evaluator: epoch %d (%s) - %s", epoch, os.path.basename(path), values)
        return True

    while True:
        done = _current_done_marker(directory, started)
        if done is not None:
            if int(done["epoch"]) != evaluated:
                evaluate(int(done["epoch"]), os.path.join(directory, str(done["file"])))
            break
        epoch = backup_lib.latest_epoch(directory)
        if epoch and epoch != evaluated and evaluate(epoch, backup_lib.weights_path(directory, epoch)):
            evaluated = epoch
            continue
        # The same rule as the ps/worker tasks: never wait forever for a chief that is gone.
        if chief is None or _chief_reachable(chief):
            seen_chief, gone_since = chief is not None, None
        elif seen_chief or time.monotonic() - begun > startup:
            gone_since = gone_since or time.monotonic()
            if not seen_chief or time.monotonic() - gone_since > grace:
                writer.close()
                waited, var = (grace, GRACE_VAR) if seen_chief else (startup, STARTUP_VAR)
                raise ChiefGoneError(
                    f"the chief {chief} has been unreachable for {waited:.0f}s and did not mark the end of "
                    f"training in {directory}; the evaluator stops. Fix: see the chief's log for why it stopped "
                    f"and restart the job (the chief resumes from backup_dir), or set {var}=<seconds> to wait "
                    "longer")
        time.sleep(poll_seconds)
    writer.close()
    _push(mirror)
    if mirror is not None:
        scratch.remove([local_out])
    if not quiet:
        log.info("evaluator: training ended; evaluated %d checkpoint(s)", len(history.epoch))
    return history


def _touch(path: str) -> int:
    """Write `path` now (atomically, never through someone else's file) and return its mtime (ns).

    The mtime is on the shared directory's own clock, as the chief's marker's is.
    """
    files.check_dir(os.path.dirname(path) or ".", "backup_dir")
    files.write_bytes(path, str(os.getpid()).encode())
    return os.lstat(path).st_mtime_ns


def _current_done_marker(directory: str, started_ns: int) -> dict | None:
    """This run's end-of-training marker, or None (absent, or older than this evaluation)."""
    marker = read_done_marker(directory)
    if marker is None:
        return None
    try:
        written = os.lstat(os.path.join(directory, DONE_FILE)).st_mtime_ns
    except OSError:
        return None
    return marker if written >= started_ns else None
