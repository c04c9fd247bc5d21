"""A worker reader's memory plan: what its read-ahead budget holds, and the settings that follow from it.

The budget (`read_ahead_bytes`, from the sizes the footers give) holds each lane's open unit (a row group's fetched
column chunks, and one batch of its rows decoded: `decode_rows`, at most `DECODE_BATCH_BYTES`), the block being put
together (its Arrow rows and its arrays), the blocks decoded ahead, and two finished chunks (`readahead.CHUNK_ROWS`
rows each, within a quarter of the budget). The blocks ahead are what the budget leaves room for beside an eighth
kept for the allocators (`SLACK_PART`), at least one and at most `MAX_AHEAD_BLOCKS`; a budget without room for one
(the slack aside) is refused before step 1 (`check_budget`), naming what takes the bytes.
`table_input.auto_window` sizes the default shuffle window from `lane_bytes`. Pure numpy, no I/O.
"""

from __future__ import annotations

import numpy as np

from stratkit.data.plan import Plan
from stratkit.data.shards import Layout
from stratkit.errors import ConfigError

#: Rows pyarrow decodes at a time (`iter_batches`) is a lane's window, within these bounds. pyarrow alone decodes
#: faster in small batches (one thread, 16 float32s + a label, 65,536-row groups: 3.7M rows/s at 4,096, 1.6M at
#: 19,421), but the whole reader into `Dataset.reduce` was slower with them (1M rows, 4 alternating rounds, load
#: 0.9-1.1: 0.81M rows/s at 4,096, 0.93M at 8,192, 1.12M at the window's 19,421, 1.03M at 65,536): each batch
#: costs the assembling thread its slicing and concatenation under the GIL.
DECODE_ROWS_BOUNDS = (4096, 65536)
#: ... and at most about this many bytes (a row of 768 float32s: 1,363 rows). A lane holds one decoded batch at a
#: time beside its fetched column chunks, so wide rows decoded 4,096 at a time took the budget's room for the shuffle
#: window: a table of 3 KiB rows in 2,500-row groups got a window of 11 rows a lane (227 blocks a pass), and the
#: reader fed a small CNN at 0.66x its steps/s on arrays.
DECODE_BATCH_BYTES = 4 << 20
#: Blocks read ahead at most, whatever room the budget leaves: 4 threads are kept busy by fewer, and the blocks run
#: on across passes, so a table of a few rows would otherwise read a budget's worth of passes ahead before its
#: first step (256 MiB of 12-row blocks: the first step never came, the memory grew).
MAX_AHEAD_BLOCKS = 8
#: The blocks read ahead leave this part of the budget (1/8) unplanned, for what the allocators keep of the reader's
#: freed memory (pages jemalloc holds for up to a second, Python's and numpy's heaps). Planned to the whole budget,
#: a worker's peak RSS grew 0.91-1.01x the budget more than the same steps fed from memory (2 workers, 24 MiB, a
#: table 10x that, 3 rounds: `benchmarks/bench_lake.py`). It only takes blocks ahead: a budget that holds one is
#: never refused for it, and the default shuffle window does not change.
SLACK_PART = 8


def decode_rows(plan: Plan, window: int) -> int:
    """Rows pyarrow decodes at a time: a lane's window within `DECODE_ROWS_BOUNDS`, within `DECODE_BATCH_BYTES`."""
    rows = min(max(int(window), DECODE_ROWS_BOUNDS[0]), DECODE_ROWS_BOUNDS[1])
    return int(max(1, min(rows, DECODE_BATCH_BYTES // max(int(plan.row_bytes), 1))))


def lane_bytes(plan: Plan) -> int:
    """What one lane holds while it reads a unit: its fetched column chunks (pyarrow pre-buffers a row group's) and
    one decoded batch of its rows (`decode_rows`: at most `DECODE_BATCH_BYTES`, or one row wider than that), the
    largest unit's."""
    if not plan.units:
        return 0
    batch = decode_rows(plan, DECODE_ROWS_BOUNDS[1]) * max(plan.row_bytes, 1.0)   # the widest window's batch
    return int((plan.unit_bytes + np.minimum(plan.unit_decoded, batch)).max())


def memory_plan(layout: Layout, plan: Plan, first: int, stop: int, budget: int) -> tuple[int, int, int]:
    """(blocks read ahead, one block's bytes, the lanes' bytes) for lanes [first, stop) within `budget`.

    The budget holds the lanes' open units, the block being put together, the blocks decoded ahead and the
    ready chunks (kept within a quarter of the budget by their size), beside the allocators' slack (`SLACK_PART`)."""
    lanes = (stop - first) * lane_bytes(plan)
    block = block_bytes(layout, plan, first, stop)
    room = budget - lanes - budget // 4 - budget // SLACK_PART
    return max(1, min(MAX_AHEAD_BLOCKS, room // max(block, 1) - 1)), block, lanes


def check_budget(layout: Layout, plan: Plan, world: int, budget: int) -> None:
    """Refuse a read-ahead budget that cannot hold what the worker with the most lanes needs: its lanes' open
    units, a block put together and one decoded ahead, and the ready chunks.

    Raises:
        ConfigError: naming what takes the bytes, and the fix.
    """
    most = max(layout.owned(world, rank)[1] - layout.owned(world, rank)[0] for rank in range(world))
    _, block, lanes = memory_plan(layout, plan, 0, most, budget)
    needed = lanes + 2 * block + budget // 4
    if needed > budget:
        raise ConfigError(
            f"read_ahead_bytes={budget} cannot hold what a worker of {world} reads at once: {most} lane(s), each "
            f"holding a row group being read (up to {lane_bytes(plan)} bytes fetched and one batch decoded) = {lanes} "
            f"bytes, "
            f"and two blocks of shuffle_window={layout.window} rows a lane x ~{plan.row_bytes:.0f} bytes per row "
            f"(decoded, twice: rows and arrays) = {2 * block} bytes, and a quarter for finished steps. Fix: "
            f"read_ahead_bytes={int(1.34 * (lanes + 2 * block)) + 1} or more, a smaller shuffle_window, fewer lanes "
            "per worker (lanes=), or smaller row groups")


def layout_rows_per_block(layout: Layout, first: int, stop: int) -> int:
    """Rows of lanes [first, stop) in a full block (its first)."""
    return int(layout.window_lengths(0, first, stop).sum()) if stop > first else 0


def block_bytes(layout: Layout, plan: Plan, first: int, stop: int) -> int:
    """Bytes one block of lanes [first, stop) takes decoded, twice (its Arrow rows and its arrays)."""
    return int(2 * layout_rows_per_block(layout, first, stop) * max(plan.row_bytes, 1.0))


__all__ = ["DECODE_BATCH_BYTES", "DECODE_ROWS_BOUNDS", "MAX_AHEAD_BLOCKS", "SLACK_PART", "block_bytes", "check_budget",
           "decode_rows", "lane_bytes", "layout_rows_per_block", "memory_plan"]
