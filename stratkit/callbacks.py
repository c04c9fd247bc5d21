"""Public callbacks: `stratkit.callbacks.Throughput`, `stratkit.callbacks.LinearScalingWarmup`."""

from __future__ import annotations

from stratkit.training.callbacks import LinearScalingWarmup, Throughput

__all__ = ["LinearScalingWarmup", "Throughput"]
