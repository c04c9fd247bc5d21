"""Kept for imports of `stratkit.training.data`: the input layer is `stratkit.training.inputs`."""

from __future__ import annotations

from stratkit.training.inputs import (DEFAULT_SEED, PreparedData, batch_size_of, check_batched, prepare,
                                      resolve_global_batch_size)

__all__ = ["DEFAULT_SEED", "PreparedData", "batch_size_of", "check_batched", "prepare", "resolve_global_batch_size"]
