"""The interface every cluster environment implements."""

from __future__ import annotations

from typing import ClassVar, Mapping

from stratkit.cluster.spec import ClusterSpec
from stratkit.errors import ConfigError


class ClusterEnvironment:
    """One place a cluster description can come from.

    Attributes:
        name: the `STRATKIT_CLUSTER_ENV` value that selects this environment alone.
        description: what `detect` looks for, used in error messages.
    """

    name: ClassVar[str]
    description: ClassVar[str]

    @staticmethod
    def detect(environ: Mapping[str, str], num_gpus: int) -> ClusterSpec | None:
        """The spec this environment describes, or None when its variables are absent.

        Raises:
            ConfigError: when its variables are present but malformed.
        """
        raise NotImplementedError

    @classmethod
    def missing(cls, environ: Mapping[str, str], var: str) -> ConfigError:
        """The error for `var=<name>` when `detect` found nothing."""
        return ConfigError(f"{var}={cls.name} but {cls.description} is not set. "
                           f"Fix: set it, or set {var}=auto")
