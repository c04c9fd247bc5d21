"""The order, the shards and the cursor, from plans alone (pure numpy, no file read, no TensorFlow).

* exactly once: over the workers of any world size, every row of an epoch is at exactly one global position;
* one order: global position g holds the same row whatever the world size;
* the cursor: a worker started at batch k (any world size) reads what a worker that read from the start
  has from batch k on, and its rows of each batch are the closed form's count;
* scale on paper: a 10,000-file table planned from synthetic footers; at 8, 64 and 256 workers each worker
  fetches at most 1.1 x (table / N) plus one row group, and the global order is the same at every N.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stratkit.data.columns import Column
from stratkit.data.cursor import Cursor, OrderRecord, check_resume
from stratkit.data.order import hash_keys, permutation, visit_order, window_order, window_orders
from stratkit.data.plan import Plan
from stratkit.data.readahead import batch_counts
from stratkit.data.shards import Layout, steps_for, stream_rows
from stratkit.errors import ConfigError


def synthetic_plan(unit_rows, bytes_per_row: int = 100, units_per_file: int = 1) -> Plan:
    """A plan made from metadata alone: units of `unit_rows` rows, `units_per_file` per file."""
    rows = np.asarray(unit_rows, np.int64)
    count = len(rows)
    files = np.arange(count, dtype=np.int64) // units_per_file
    names = tuple(f"f{i}" for i in range(int(files[-1]) + 1))
    return Plan(kind="parquet", root="synthetic", source={"kind": "parquet"}, files=names, sizes=(0,) * len(names),
                unit_file=files, unit_part=np.arange(count, dtype=np.int64) % units_per_file, unit_rows=rows,
                unit_begin=np.zeros(count, np.int64), unit_end=rows, unit_bytes=rows * bytes_per_row,
                unit_decoded=rows * bytes_per_row, columns=(Column("x", "float32"),))


def epoch_order(layout: Layout, world: int, seed: int = 1, epoch: int = 0, plan: Plan | None = None,
                shuffle: bool = True) -> np.ndarray:
    """The row (a plan's unit-and-offset as one number, else the stream row) at each global position."""
    out = np.full(layout.rows, -1, np.int64)
    stream = plan.stream(seed, epoch, shuffle) if plan is not None else None
    offsets = np.concatenate([[0], np.cumsum(plan.unit_rows)]) if plan is not None else None
    for rank in range(world):
        first, stop = layout.owned(world, rank)
        for block in range(layout.blocks()):
            g, index = layout.block(block, first, stop, seed, epoch, shuffle)
            rows = stream_rows(layout, block, first, stop, index)
            assert (out[g] == -1).all(), "a position filled twice"
            if stream is not None:   # the stream row as the plan's row (its unit in plan order + offset)
                at = np.searchsorted(stream.ends, rows, side="right")
                begin = np.concatenate([[0], stream.ends])[at]
                rows = offsets[stream.units[at]] + (rows - begin)
            out[g] = rows
    return out


layouts = st.builds(lambda rows, lanes, window: Layout(rows, lanes, window), st.integers(1, 600),
                    st.integers(1, 40), st.integers(1, 50))


@settings(max_examples=50, deadline=None)
@given(layout=layouts, world=st.integers(1, 13), seed=st.integers(0, 2**40), epoch=st.integers(0, 5))
def test_every_row_once_per_epoch_in_one_order_at_any_world_size(layout, world, seed, epoch):
    one = epoch_order(layout, 1, seed, epoch)
    assert sorted(one.tolist()) == list(range(layout.rows))       # a permutation of the epoch's rows
    assert (epoch_order(layout, world, seed, epoch) == one).all()


@settings(max_examples=60, deadline=None)
@given(layout=layouts, world=st.integers(1, 9), batch=st.integers(1, 70))
def test_each_workers_share_of_each_batch_is_the_closed_form_and_the_shares_add_up(layout, world, batch):
    steps = steps_for(layout.rows, batch)
    total = np.zeros(steps, np.int64)
    for rank in range(world):
        first, stop = layout.owned(world, rank)
        counted = np.zeros(steps, np.int64)
        for block in range(layout.blocks()):
            g, _ = layout.block(block, first, stop, 3, 0)
            np.add.at(counted, g // batch, 1)
        closed = batch_counts(layout, batch, first, stop, steps)
        assert (closed == counted).all()
        assert (closed == layout.share(batch, world, rank)).all()
        total += counted
    sizes = np.diff(np.minimum(np.arange(steps + 1) * batch, layout.rows))
    assert (total == sizes).all()      # every batch full but the last, on one process as on N workers


@settings(max_examples=60, deadline=None)
@given(layout=layouts, world=st.integers(1, 9), batch=st.integers(1, 70), data=st.data())
def test_a_resume_at_any_batch_reads_what_an_uninterrupted_worker_reads_from_there(layout, world, batch, data):
    """The reader's seek (`readahead.WorkerReader._one_pass`): lanes start at the block holding the cursor's
    position and drop the rows before it; nothing else is read and dropped."""
    steps = steps_for(layout.rows, batch)
    k = data.draw(st.integers(0, steps - 1))
    rank = data.draw(st.integers(0, world - 1))
    first, stop = layout.owned(world, rank)
    start = Cursor(0, k).global_position(batch)
    full = [layout.block(b, first, stop, 5, 2) for b in range(layout.blocks())]
    expected = np.concatenate([g for g, _ in full])
    expected = expected[expected >= start]
    resumed = [layout.block(b, first, stop, 5, 2) for b in range(layout.first_block(start), layout.blocks())]
    got = np.concatenate([g for g, _ in resumed]) if resumed else np.zeros(0, np.int64)
    dropped = int((got < start).sum())
    assert (got[got >= start] == expected).all()
    lanes = stop - first
    assert dropped <= lanes * layout.window          # at most the part of one window per lane
    offsets = layout.offsets(start, first, stop)      # the closed form: each lane's rows before the cursor
    assert int(offsets.sum()) == int((np.concatenate([g for g, _ in full]) < start).sum())


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.integers(0, 60), min_size=1, max_size=40), lanes=st.integers(1, 12),
       window=st.integers(1, 30), world=st.integers(1, 7), seed=st.integers(0, 1000))
def test_a_plans_units_are_permuted_by_seed_and_epoch_and_every_unit_row_is_read_once(rows, lanes, window, world,
                                                                                       seed):
    plan = synthetic_plan(rows)
    if plan.rows == 0:
        return
    layout = Layout(plan.rows, lanes, window)
    for epoch in (0, 1):
        order = epoch_order(layout, world, seed, epoch, plan=plan)
        assert sorted(order.tolist()) == list(range(plan.rows))
        assert (order == epoch_order(layout, 1, seed, epoch, plan=plan)).all()
    assert (plan.stream(seed, 0).units == plan.stream(seed, 0).units).all()
    if plan.units > 3:
        assert any((plan.stream(seed, e).units != plan.stream(seed, 0).units).any() for e in range(1, 4))


def test_the_order_is_pinned_not_drawn_from_numpy_generators():
    """The permutations hash (seed, epoch, ...) with splitmix64: the same in every numpy release. These values
    are the order a backup made today continues with."""
    assert hex(int(hash_keys(1, 1, 2)[0])) == "0xe68e6fc01df08360"
    assert permutation(8, 1, 2).tolist() == [7, 5, 6, 1, 4, 3, 0, 2]
    # the golden-ratio visits: consecutive visits far apart, each lane once a round
    assert visit_order(12).tolist() == [0, 7, 3, 10, 5, 1, 8, 4, 11, 6, 2, 9]
    # a full block (every window as long: its own faster path) and its rows' global order, as before that path
    g, index = Layout(40, 4, 5).block(0, 0, 4, 1, 2)
    assert g.tolist() == list(range(20))
    assert index.tolist() == [0, 14, 7, 17, 2, 10, 6, 19, 1, 12, 5, 16, 3, 11, 8, 18, 4, 13, 9, 15]


@settings(max_examples=40, deadline=None)
@given(lanes=st.integers(2, 30), width=st.integers(1, 300), seed=st.integers(0, 2**40), epoch=st.integers(0, 9),
       window=st.integers(0, 50))
def test_several_lanes_windows_drawn_at_once_are_each_lanes_own_draw(lanes, width, seed, epoch, window):
    """`window_orders` of equal windows (a full block, drawn as one row per lane) is `window_order` of each lane,
    laid end to end: the block's shortcut draws the same order as the one-lane definition."""
    together = window_orders(np.full(lanes, width), seed, epoch, np.arange(lanes), window)
    alone = [window_order(width, seed, epoch, p, window) + p * width for p in range(lanes)]
    assert together.tolist() == np.concatenate(alone).tolist()


@pytest.mark.parametrize("lanes", [12, 24, 60])
def test_a_global_batch_draws_about_evenly_from_every_workers_lanes(lanes):
    layout = Layout(50_000, lanes, 100)
    for world in [n for n in (2, 3, 4, 6, 12) if lanes % n == 0]:
        for batch in (64, 256):
            shares = np.array([layout.share(batch, world, rank)[:-1] for rank in range(world)])
            assert np.abs(shares - batch / world).max() <= 2.0, (world, batch)


def test_scale_on_paper_10000_files_each_worker_reads_its_share_and_the_order_is_the_same_at_every_n():
    rng = np.random.default_rng(0)
    groups = rng.integers(1, 4, 10_000)                       # 1-3 row groups per file
    rows = rng.integers(10, 60, int(groups.sum()))            # of unequal sizes
    files = np.repeat(np.arange(10_000), groups)
    plan = synthetic_plan(rows, bytes_per_row=1000)
    plan = Plan(**{**plan.__dict__, "unit_file": files.astype(np.int64),
                   "files": tuple(f"f{i}" for i in range(10_000)), "sizes": tuple(0 for _ in range(10_000))})
    layout = Layout(plan.rows, 768, 64)                        # 768 = 3 x 256: every N below divides it
    stream = plan.stream(7, 0)
    biggest = int(plan.unit_bytes.max())
    reads = {}
    for world in (8, 64, 256):
        fetched = []
        for rank in range(world):
            first, stop = layout.owned(world, rank)
            fetched.append(sum(stream.fetched(int(layout.starts[p]), int(layout.starts[p + 1]))
                               for p in range(first, stop)))
        reads[world] = max(fetched)
        assert max(fetched) <= 1.1 * plan.nbytes / world + biggest, (world, max(fetched), plan.nbytes / world)
    one = epoch_order(layout, 8, 7, 0, plan=plan)
    for world in (64, 256):
        assert (epoch_order(layout, world, 7, 0, plan=plan) == one).all()
    assert np.array_equal(np.sort(one), np.arange(plan.rows))
    print({n: round(b / (plan.nbytes / n), 4) for n, b in reads.items()})


def test_a_resume_that_would_change_the_order_mid_pass_is_refused_and_at_a_pass_boundary_said():
    saved = OrderRecord(source={"kind": "delta", "version": 1}, fingerprint="a" * 64, rows=100, seed=1, lanes=12,
                        window=10)
    assert check_resume(saved, saved, mid_pass=True, backup="b") is None
    changed = OrderRecord(**{**saved.as_dict(), "lanes": 24})
    with pytest.raises(ConfigError, match=r"lanes=12.*this run has lanes=24.*Fix: pass lanes=12"):
        check_resume(saved, changed, mid_pass=True, backup="b")
    assert check_resume(saved, changed, mid_pass=False, backup="b") == "lanes 12 -> 24"
    other = OrderRecord(**{**saved.as_dict(), "fingerprint": "b" * 64})
    with pytest.raises(ConfigError, match=r"the table's files changed under the run \(a file rewritten or removed\)"):
        check_resume(saved, other, mid_pass=False, backup="b")
    assert OrderRecord.from_dict(saved.as_dict()) == saved


def test_the_cursor_counts_passes_with_and_without_steps_per_epoch():
    assert Cursor.at(0, 5, rows=1000, batch_size=100) == Cursor(0, 5)
    assert Cursor.at(2, 3, rows=1001, batch_size=100) == Cursor(2, 3)         # 11 steps a pass
    assert Cursor.at(2, 3, rows=1000, batch_size=100, steps_per_epoch=4) == Cursor(1, 1)   # step 11 of passes of 10
