"""Errors stratkit raises on purpose.

Every message names the variable (or argument), the bad value and the fix, so a
user can act on it without reading a TensorFlow traceback.
"""

from __future__ import annotations


class StratkitError(Exception):
    """Base class of every error stratkit raises on purpose."""


class ConfigError(StratkitError, ValueError):
    """The environment or an argument describes a cluster or strategy that cannot work."""


class KerasCompatError(StratkitError, RuntimeError):
    """The installed Keras version is not one stratkit's compatibility layer was tested on."""


class ReplicaDivergenceError(StratkitError, RuntimeError):
    """The replicas' copies of the model differ: saving now would save the model of whichever worker is chief."""


class ChiefGoneError(StratkitError, RuntimeError):
    """A task waiting on the chief (the parameter-server evaluator) lost it before training ended."""


class PayloadError(StratkitError, RuntimeError):
    """A training process cannot load the function (and its arguments) it was sent to run."""
