"""Where am I running? Pure-Python cluster detection (never imports TensorFlow)."""

from __future__ import annotations

from stratkit.cluster.detect import detect, normalize_strategy
from stratkit.cluster.spec import ROLES, STRATEGIES, ClusterSpec

__all__ = ["ClusterSpec", "ROLES", "STRATEGIES", "detect", "normalize_strategy"]
