"""The column rule: each column keeps its type; the model's input dtype decides the cast; no cast loses a value."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stratkit.data import columns
from stratkit.data.columns import Column, cast_to, check_range, column_of, label_dtype, to_numpy
from stratkit.errors import ConfigError


@pytest.mark.parametrize("arrow_type, dtype, shape", [
    (pa.int64(), "int64", ()),
    (pa.uint8(), "uint8", ()),
    (pa.float64(), "float64", ()),
    (pa.float32(), "float32", ()),
    (pa.bool_(), "bool", ()),
    (pa.string(), "string", ()),
    (pa.large_binary(), "string", ()),
    (pa.dictionary(pa.int32(), pa.string()), "string", ()),
    (pa.list_(pa.float64()), "float64", (None,)),
    (pa.list_(pa.int64(), 8), "int64", (8,)),
    (pa.list_(pa.list_(pa.float32(), 3), 2), "float32", (2, 3)),
    (pa.decimal128(10, 0), "int64", ()),
    (pa.decimal128(12, 4), "float64", ()),
])
def test_a_column_keeps_its_type_and_shape(arrow_type, dtype, shape):
    column = column_of("c", arrow_type)
    assert (column.dtype, column.shape) == (dtype, shape)


@pytest.mark.parametrize("arrow_type", [pa.timestamp("ms"), pa.struct([("a", pa.int32())]),
                                        pa.map_(pa.string(), pa.int32()), pa.decimal128(30, 2)])
def test_a_type_that_feeds_no_model_is_refused_naming_the_column(arrow_type):
    with pytest.raises(ConfigError, match="column 'when'.*Fix:"):
        column_of("when", arrow_type)


def test_int64_ids_above_2_24_stay_exact_for_an_int64_input():
    ids = pa.array([2**24 + 1, 2**40 + 3, 2**62 + 7], pa.int64())
    column = column_of("id", ids.type)
    out = to_numpy(ids, column, cast_to(column, "int64"))
    assert out.dtype == np.int64 and out.tolist() == [2**24 + 1, 2**40 + 3, 2**62 + 7]


def test_int64_ids_above_2_24_into_float32_are_refused_not_rounded():
    ids = pa.array([3, 2**24 + 1], pa.int64())
    with pytest.raises(ConfigError, match=r"column 'id'.*int64.*float32.*16777217.*dtype='int64'"):
        to_numpy(ids, column_of("id", ids.type), "float32")


def test_int64_within_2_24_into_float32_is_exact_and_allowed():
    values = pa.array([-(2**24), 0, 2**24], pa.int64())
    out = to_numpy(values, column_of("n", values.type), "float32")
    assert out.dtype == np.float32 and out.astype(np.int64).tolist() == [-(2**24), 0, 2**24]


def test_a_fractional_float_into_an_int_input_is_refused():
    values = pa.array([1.0, 2.5], pa.float64())
    with pytest.raises(ConfigError, match=r"column 'x'.*float64.*int64.*2\.5"):
        to_numpy(values, column_of("x", values.type), "int64")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_and_inf_into_an_int_input_are_refused(value):
    values = pa.array([1.0, value], pa.float64())
    with pytest.raises(ConfigError, match="column 'x'"):
        to_numpy(values, column_of("x", values.type), "int32")


def test_whole_floats_into_an_int_input_are_allowed():
    values = pa.array([1.0, -7.0], pa.float64())
    assert to_numpy(values, column_of("x", values.type), "int32").tolist() == [1, -7]


def test_float64_into_float32_rounds_as_keras_does_but_overflow_is_refused():
    values = pa.array([0.1, 1e30], pa.float64())
    out = to_numpy(values, column_of("x", values.type), "float32")
    assert out.dtype == np.float32 and out.tolist() == np.array([0.1, 1e30]).astype(np.float32).tolist()
    with pytest.raises(ConfigError, match="1e\\+300"):
        to_numpy(pa.array([1e300]), column_of("x", pa.float64()), "float32")


def test_float64_stays_float64_for_a_float64_input():
    values = pa.array([0.1, 1 / 3], pa.float64())
    out = to_numpy(values, column_of("x", values.type), "float64")
    assert out.dtype == np.float64 and out.tolist() == [0.1, 1 / 3]


def test_int_into_a_narrower_int_and_into_bool_are_range_checked():
    with pytest.raises(ConfigError, match="2147483648"):
        to_numpy(pa.array([2**31]), Column("x", "int64"), "int32")
    with pytest.raises(ConfigError, match="column 'x'"):
        to_numpy(pa.array([-1]), Column("x", "int64"), "uint8")
    with pytest.raises(ConfigError, match="column 'flag'"):
        to_numpy(pa.array([0, 2]), Column("flag", "int64"), "bool")
    assert to_numpy(pa.array([0, 1]), Column("flag", "int64"), "bool").tolist() == [False, True]


def test_strings_reach_string_inputs_as_bytes():
    values = pa.array(["cat", "dög", ""], pa.string())
    column = column_of("word", values.type)
    out = to_numpy(values, column, cast_to(column, "string"))
    assert out.dtype == object and out.tolist() == ["cat".encode(), "dög".encode(), b""]


def test_a_string_column_for_a_number_input_and_back_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="column 'word' holds strings.*StringLookup"):
        cast_to(Column("word", "string"), "float32")
    with pytest.raises(ConfigError, match="column 'id' holds int64.*dtype='int64'"):
        cast_to(Column("id", "int64"), "string")


def test_fixed_and_variable_lists_keep_their_length():
    fixed = pa.array([[1, 2, 3], [4, 5, 6]], pa.list_(pa.int64(), 3))
    assert to_numpy(fixed, column_of("v", fixed.type), "int64").tolist() == [[1, 2, 3], [4, 5, 6]]
    ragged_but_equal = pa.array([[1.5, 2.5], [3.5, 4.5]], pa.list_(pa.float64()))
    assert to_numpy(ragged_but_equal, column_of("v", ragged_but_equal.type), "float32").shape == (2, 2)
    nested = pa.array([[[1, 2], [3, 4]]], pa.list_(pa.list_(pa.int64())))
    assert to_numpy(nested, column_of("m", nested.type), "int64").shape == (1, 2, 2)


def test_lists_of_different_lengths_and_nulls_are_refused():
    with pytest.raises(ConfigError, match="column 'v' holds arrays of different lengths"):
        to_numpy(pa.array([[1.0], [1.0, 2.0]]), Column("v", "float64", (None,)), "float32")
    with pytest.raises(ConfigError, match="column 'v' has 1 null"):
        to_numpy(pa.array([1.0, None]), Column("v", "float64"), "float32")
    with pytest.raises(ConfigError, match="column 'v' has 1 null"):
        to_numpy(pa.array([[1.0, None]]), Column("v", "float64", (None,)), "float32")


def test_a_chunked_column_reads_as_one():
    chunked = pa.chunked_array([pa.array([1, 2]), pa.array([3])])
    assert to_numpy(chunked, Column("c", "int64"), "int64").tolist() == [1, 2, 3]


def test_labels_travel_in_their_own_type():
    assert label_dtype(Column("y", "int64")) == "int64"
    assert label_dtype(Column("y", "float64")) == "float64"
    assert label_dtype(Column("y", "uint32")) == "int64"


def test_statistics_refuse_a_lossy_cast_before_any_row_is_read():
    check_range("id", "int64", "float32", 0, 2**24)
    with pytest.raises(ConfigError, match="column 'id'.*16777217"):
        check_range("id", "int64", "float32", 0, 2**24 + 1)
    check_range("id", "int64", "int64", 0, 2**62)          # nothing to lose
    check_range("id", "int64", "float32", None, None)      # no statistics: the values are checked as read


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), min_size=1, max_size=20),
       st.sampled_from(["float16", "float32", "float64", "int8", "int32", "uint16", "bool"]))
def test_a_cast_either_keeps_every_value_or_is_refused(values, target):
    """Property: whatever the int64 values and the target, the result equals the input exactly, or it raises."""
    array = pa.array(values, pa.int64())
    try:
        out = to_numpy(array, Column("x", "int64"), target)
    except ConfigError:
        return
    assert [int(v) for v in out.tolist()] == values


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=64), min_size=1, max_size=20),
       st.sampled_from(["int8", "int32", "int64", "uint8", "bool"]))
def test_a_float_into_an_int_keeps_every_value_or_is_refused(values, target):
    array = pa.array(values, pa.float64())
    try:
        out = to_numpy(array, Column("x", "float64"), target)
    except ConfigError:
        return
    assert [float(v) for v in out.tolist()] == values


def test_may_lose_matches_the_bounds():
    assert not columns.may_lose("int32", "int64") and not columns.may_lose("int32", "float64")
    assert columns.may_lose("int64", "float64") and columns.may_lose("int32", "float32")
    assert not columns.may_lose("float32", "float64") and columns.may_lose("float64", "float32")
    assert columns.lossless_bounds("int64", "float32") == (-(2**24), 2**24)


def test_statistics_with_inf_or_nan_refuse_them_only_for_an_int_target():
    check_range("x", "float64", "float32", float("-inf"), float("nan"))   # they stay what they are in a float
    with pytest.raises(ConfigError, match="column 'x'"):
        check_range("x", "float64", "int64", 0.0, float("inf"))
    with pytest.raises(ConfigError, match="column 'x'"):
        check_range("x", "float64", "float32", 0.0, 1e300)
