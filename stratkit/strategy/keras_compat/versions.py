"""Which Keras and TensorFlow versions stratkit supports, and how the gate reads them.

The data of the version gate (the tested sets, the floor, the override
variable) and the pure functions that read and compare versions. Imports no
TensorFlow or Keras at import time.
"""

from __future__ import annotations

import os

from stratkit.errors import ConfigError, KerasCompatError

#: Exact Keras versions the compat suite (``make compat``, ``tools/compat.py``)
#: proved: 2-worker MWMS weights equal to one process, Mirrored, parameter-server
#: training with an evaluator, backup resume, plain ``model.fit`` (see
#: ``benchmarks/results/compat.json``; a test keeps this set equal to its passing rows).
TESTED_KERAS_VERSIONS: frozenset[str] = frozenset({"3.11.3", "3.12.4", "3.13.2", "3.14.1", "3.15.1"})

#: The oldest Keras stratkit supports. Older releases are refused in every mode,
#: ``force`` included, because forcing them is known to go wrong: 3.8-3.10 pass
#: ``(step, iterator)`` pairs to ``_maybe_symbolic_build`` (the patch crashes; a
#: tolerant patch gives right weights but wrong history metrics), 3.3 fails with
#: ``KeyError`` and a scalar-only fix lets workers diverge silently.
KERAS_FLOOR = "3.11.0"

#: TensorFlow versions the compat suite ran (each with every tested Keras).
TESTED_TENSORFLOW_VERSIONS: frozenset[str] = frozenset({"2.16.2", "2.21.0"})

#: The command that proves another (TF, Keras) pair, named in refusals.
COMPAT_COMMAND = "make compat KERAS={keras}"

#: Environment variable overriding the version gate: ``force`` patches any
#: Keras 3 version (at the user's own risk), ``off`` never patches,
#: ``auto`` (or unset) is the default gate.
ENV_VAR = "STRATKIT_KERAS_COMPAT"

#: The attribute that marks a function in Keras's classes as one of stratkit's
#: replacements (so installing twice never wraps a wrapper).
_PATCH_MARK = "__stratkit_keras_compat__"


def installed_keras_version() -> str:
    """The version of the ``keras`` package, e.g. ``"3.15.1"``: the Keras the fixes patch.

    ``TF_USE_LEGACY_KERAS=1`` (which Ray Train sets in every worker) routes only
    ``tf.keras`` to tf-keras; ``import keras`` -- what Keras 3 models and
    ``stratkit.Trainer`` use -- is still Keras 3 and still needs the fixes.
    A tf-keras model is not touched by them (``Trainer.build`` refuses it with
    a message). The gate's functions in ``stratkit.strategy.keras_compat``
    read it through the package's name, so tests can monkeypatch
    ``keras_compat.installed_keras_version``.
    """
    import keras

    return str(keras.__version__)


def _major(version: str) -> int:
    """Major version number of ``version`` (``"3.15.1"`` -> 3)."""
    try:
        return int(version.split(".", 1)[0])
    except ValueError as exc:
        raise KerasCompatError(f"Cannot parse the Keras version {version!r}.") from exc


def _mode() -> str:
    """The value of :data:`ENV_VAR`, validated (``auto``, ``force`` or ``off``)."""
    raw = os.environ.get(ENV_VAR, "").strip().lower()
    if raw in ("", "auto"):
        return "auto"
    if raw in ("force", "off"):
        return raw
    raise ConfigError(
        f"{ENV_VAR}={os.environ.get(ENV_VAR)!r} is not understood. "
        f"Use {ENV_VAR}=auto (default: patch tested Keras versions only), "
        f"{ENV_VAR}=force (patch any Keras 3 version at your own risk) or "
        f"{ENV_VAR}=off (never patch)."
    )


def version_tuple(version: str) -> tuple[int, ...]:
    """The leading numeric parts of a version: ``"3.16.0.dev2025"`` -> ``(3, 16, 0)``."""
    parts: list[int] = []
    for piece in version.split("."):
        digits = ""
        for char in piece:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):
            break
    if not parts:
        raise KerasCompatError(f"Cannot parse the Keras version {version!r}.")
    return tuple(parts)


def _newest_tested() -> str:
    return max(TESTED_KERAS_VERSIONS, key=version_tuple)


def supported_range() -> str:
    """One phrase naming what works, for error messages and ``stratkit info``."""
    tested = ", ".join(sorted(TESTED_KERAS_VERSIONS, key=version_tuple))
    tf = ", ".join(sorted(TESTED_TENSORFLOW_VERSIONS, key=version_tuple))
    return f"Keras >= {KERAS_FLOOR} (tested: Keras {tested}; TensorFlow {tf})"


def refuse_below_floor(version: str) -> None:
    """Refuse a Keras 3 release below :data:`KERAS_FLOOR`, whatever :data:`ENV_VAR` says.

    Keras 2 / tf-keras (major version < 3) passes: it needs no fixes. The
    refusal is not subject to ``force`` because forcing these releases is known
    to crash inside the patches or train wrong without an error.

    Raises:
        KerasCompatError: naming the installed version, the supported range and the fix.
    """
    if _major(version) != 3 or version_tuple(version) >= version_tuple(KERAS_FLOOR):
        return
    raise KerasCompatError(
        f"Keras {version} is installed, but stratkit supports {supported_range()}. "
        f"Keras {version} is refused even with {ENV_VAR}=force: its trainer differs from the code "
        f"stratkit's fixes replace, and forcing them is known to crash or train wrong "
        f"(Keras 3.8-3.10: wrong history metrics; 3.3: workers diverge). "
        f"Fix: pip install 'keras>={KERAS_FLOOR}' (newest tested: pip install keras=={_newest_tested()})."
    )
