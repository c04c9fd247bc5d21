"""Each epoch's order of a table: a function of (seed, epoch) alone, the same in every process and release.

Three draws make it (`docs/data.md`, "Order"):

* the units (Parquet row groups, TFRecord record ranges) permuted: `unit_order`;
* inside each lane, its rows shuffled in windows of W rows: `window_order`;
* the lanes visited in a fixed order every round: `visit_order` (no draw: spread like the golden-ratio
  sequence, so any run of consecutive visits touches every stretch of lanes about evenly, and a global
  batch draws about evenly from every worker's lanes).

The permutations sort 64-bit hashes (splitmix64's finaliser over the seed, the epoch, the lane, the window
and the index) instead of drawing from numpy's generators, whose streams numpy does not promise to keep
between releases: a resume after an upgrade must continue the same order. Pure numpy, no I/O.
"""

from __future__ import annotations

import math

import numpy as np

_MASK = (1 << 64) - 1
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 values (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = values + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def hash_keys(count: int, *key: int) -> np.ndarray:
    """`count` 64-bit hashes of (key..., i) for i in 0..count-1."""
    state = np.zeros(1, np.uint64)
    for part in key:
        state = _mix(state ^ np.uint64(int(part) & _MASK))
    return _mix(state ^ np.arange(count, dtype=np.uint64))


def _sorted_by(keys: np.ndarray, index: np.ndarray, index_bits: int, high: np.ndarray | None = None,
               high_bits: int = 0) -> np.ndarray:
    """argsort of hash `keys`, made unique: `high` (e.g. the lane) in the top bits, the hash below, the index in
    the low bits. Unique keys have one sorted order, so numpy's fastest sort gives the same permutation in every
    release (a stable sort of 400,000 keys took 4x as long); equal hash bits keep index order."""
    hash_bits = 64 - high_bits - index_bits
    combined = (keys >> np.uint64(64 - hash_bits)) << np.uint64(index_bits) | index.astype(np.uint64)
    if high is not None and high_bits:
        combined |= high.astype(np.uint64) << np.uint64(64 - high_bits)
    # the index is the low bits of its own key: sorting the keys (SIMD, 3x numpy's argsort) gives the argsort
    return (np.sort(combined) & np.uint64((1 << index_bits) - 1)).astype(np.int64)


def permutation(count: int, *key: int) -> np.ndarray:
    """A permutation of range(count) determined by `key` (int64 indices)."""
    if count <= 1:
        return np.arange(count, dtype=np.int64)
    return _sorted_by(hash_keys(count, *key), np.arange(count, dtype=np.int64), int(count - 1).bit_length())


def unit_order(units: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The order the units of epoch `epoch` follow in its stream (identity without `shuffle`)."""
    if not shuffle:
        return np.arange(units, dtype=np.int64)
    return permutation(units, seed, epoch, 0x756E697473)  # "units"


def window_order(length: int, seed: int, epoch: int, lane: int, window: int, shuffle: bool = True) -> np.ndarray:
    """The order of the `length` rows of window `window` of lane `lane` in epoch `epoch` (`window_orders`'s)."""
    return window_orders(np.array([length]), seed, epoch, np.array([lane]), window, shuffle)


def window_orders(lengths: np.ndarray, seed: int, epoch: int, lanes: np.ndarray, window: int,
                  shuffle: bool = True) -> np.ndarray:
    """The windows of several lanes at once, laid end to end (lengths `lengths`): each lane's rows permuted by
    the hashes of (seed, epoch, lane, window, row), each index pointing into its own lane's part."""
    total = int(np.sum(lengths))
    if not shuffle or total == 0:
        return np.arange(total, dtype=np.int64)
    state = np.zeros(1, np.uint64)
    for part in (seed, epoch):
        state = _mix(state ^ np.uint64(int(part) & _MASK))
    per_lane = _mix(state ^ np.asarray(lanes, np.int64).astype(np.uint64))
    per_lane = _mix(per_lane ^ np.uint64(int(window) & _MASK))
    per_lane = _mix(per_lane ^ np.uint64(0x726F7773))  # "rows", as window_order
    index_bits, high_bits = int(total - 1).bit_length(), int(len(lengths) - 1).bit_length()
    if len(lengths) > 1 and np.all(lengths == lengths[0]):
        # Every window as long (all but an epoch's last block): the same keys as below, one row per lane, each
        # row sorted on its own (the lane's top bits would only keep the rows apart); 2.5-3x the general case.
        width = int(lengths[0])
        keys = _mix(per_lane[:, None] ^ np.arange(width, dtype=np.uint64)[None, :])
        hash_bits = 64 - high_bits - index_bits
        combined = (keys >> np.uint64(64 - hash_bits)) << np.uint64(index_bits)
        combined |= np.arange(total, dtype=np.uint64).reshape(len(lengths), width)
        combined.sort(axis=1)
        return (combined.ravel() & np.uint64((1 << index_bits) - 1)).astype(np.int64)
    owner = np.repeat(np.arange(len(lengths)), lengths)
    begin = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    local = np.arange(total, dtype=np.int64) - begin[owner]
    keys = _mix(per_lane[owner] ^ local.astype(np.uint64))
    # one sort for every lane: the lane in the top bits keeps each lane's rows together, in its own order
    return _sorted_by(keys, np.arange(total, dtype=np.int64), index_bits, owner, high_bits)


def visit_order(lanes: int) -> np.ndarray:
    """The lanes in the order each round visits them: lane `visit_order(C)[j]` is visited j-th.

    The j-th visit goes to the rank of frac(j x golden ratio) among the C such points: consecutive
    visits land far apart and any run of them spreads evenly over the lanes (the three-distance
    theorem), so every contiguous stretch of lanes (one worker's) gets its share of a batch, +- a row or two.
    """
    points = (np.arange(lanes, dtype=np.float64) * _GOLDEN) % 1.0
    ranks = np.empty(lanes, dtype=np.int64)
    ranks[np.argsort(points, kind="stable")] = np.arange(lanes, dtype=np.int64)
    return ranks


__all__ = ["hash_keys", "permutation", "unit_order", "visit_order", "window_order", "window_orders"]
