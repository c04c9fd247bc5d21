"""What do I build? The tf.distribute strategy for a ClusterSpec (TensorFlow imported lazily)."""

from __future__ import annotations

from stratkit.strategy.factory import make_strategy

__all__ = ["make_strategy"]
