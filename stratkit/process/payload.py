"""A training function and its arguments on their way to a task's process, and its result on the way back.

Both cluster runners send `(train_fn, args, kwargs)` cloudpickled to a fresh
training process per task, and bring back the chief's return value the same
way: `pickle_payload` on the driver (naming the argument that cannot be
pickled), `load_payload` in the training process, `write_result` there
(atomically: a reader never sees half a result), and `exit_now` to end it
without TensorFlow's slow teardown.

Imports no TensorFlow.
"""

from __future__ import annotations

import atexit
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from stratkit import status
from stratkit.errors import ConfigError, PayloadError

#: File names in a run's working directory.
PAYLOAD = "payload.pkl"
RESULT = "result.pkl"
#: A tune run's result file per tuner (`LocalRunner(tune=True)`: every task is a tuner).
TUNER_RESULT = "result-{}.pkl"


def pickle_payload(train_fn: Callable[..., Any], args: tuple, kwargs: dict, *, where: str) -> bytes:
    """`(train_fn, args, kwargs)` cloudpickled; a ConfigError naming the culprit when one cannot be.

    Args:
        where: who receives it, for the message ("the Spark tasks", "the Ray actors").
    """
    import cloudpickle

    args, kwargs = _planned_tables(args, kwargs)
    try:
        return cloudpickle.dumps((train_fn, args, kwargs))
    except Exception as exc:  # noqa: BLE001 - find the culprit for the message
        for name, value in [("train_fn", train_fn)] + [(f"args[{i}]", a) for i, a in enumerate(args)] + \
                [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]:
            try:
                cloudpickle.dumps(value)
            except Exception as inner:  # noqa: BLE001
                raise ConfigError(f"{name} cannot be pickled to send to {where} ({type(inner).__name__}: "
                                  f"{inner}). Fix: pass plain data (numbers, strings, numpy arrays, paths) and create "
                                  "models, sessions, locks or open files inside train_fn") from None
        raise ConfigError(f"train_fn and its arguments cannot be pickled ({type(exc).__name__}: {exc})") from None


def _planned_tables(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments with each `stratkit.data.TableInput` among them planned here, on the driver
    (`table_input.planned`); the others as given."""
    if "stratkit.data.table_input" not in sys.modules:     # no TableInput was made in this process
        return args, kwargs
    from stratkit.data.table_input import TableInput, planned

    def plan(value: Any) -> Any:
        return planned(value) if isinstance(value, TableInput) else value

    return tuple(plan(a) for a in args), {k: plan(v) for k, v in kwargs.items()}


def load_payload(workdir: str, fix: str) -> tuple[Callable[..., Any], tuple, dict]:
    """The `(train_fn, args, kwargs)` in `workdir`; a PayloadError with `fix` when it does not unpickle here."""
    import cloudpickle

    with open(os.path.join(workdir, PAYLOAD), "rb") as handle:
        try:
            return cloudpickle.load(handle)
        except Exception as exc:
            raise PayloadError(f"could not unpickle train_fn and its arguments in the training process "
                               f"({type(exc).__name__}: {exc}). Fix: {fix}") from exc


def write_result(workdir: str, value: Any, name: str = RESULT) -> None:
    """Cloudpickle `value` to `workdir`/`name` (result.pkl) through a temporary and a rename."""
    import cloudpickle

    tmp = os.path.join(workdir, name + ".tmp")
    with open(tmp, "wb") as handle:
        cloudpickle.dump(value, handle)
    os.replace(tmp, os.path.join(workdir, name))


def run_function(call: Callable[[], Any], workdir: str, *, keep_result: bool,
                 mark: Callable[[str], None] = lambda event: None, result_name: str = RESULT) -> int:
    """Call `call()` (train_fn with its arguments) in the training process; the exit code for `exit_now`.

    Its return value goes to `write_result` (as `result_name`) when `keep_result` (the chief's);
    `sys.exit(n)` in train_fn is exit code n; any other exception is printed
    (its traceback is what the driver's root-cause report quotes) and is exit
    code 1. `mark` is told "function returns" / "result written" (a timeline).
    """
    code = 0
    try:
        result = call()
        mark("function returns")
        if keep_result:
            write_result(workdir, result, result_name)
            mark("result written")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code:
            status.logger(__name__).warning(f"train_fn called sys.exit({exc.code!r})")
    except BaseException as exc:  # noqa: BLE001 - report everything, including KeyboardInterrupt
        traceback.print_exc()
        # What the interpreter records for an uncaught exception, so exit hooks (e.g. the parameter-server
        # chief's "end training" signal) see that train_fn failed.
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
        code = 1
    return code


def exit_now(code: int) -> int:
    """Run the exit hooks, flush, and end the process without TensorFlow's slow teardown.

    Measured (TF 2.21, 2-worker MultiWorkerMirroredStrategy): a normal
    interpreter exit takes 1.5-4 s after the last Python line (the runtime's
    shutdown), and nothing of the user's is in it: the Python exit hooks
    (`atexit`: logging, the parameter-server chief's end-of-training signal)
    run here. No `gc.collect()`: with TensorFlow and Keras loaded it took
    seconds (4.3 s measured on the loaded test machine); a file object left
    open in a global is therefore not flushed (docs/spark.md says to close files).
    """
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code  # pragma: no cover
