"""Tests of stepnet.lod: LoDTensor, its validation and its helpers."""

import copy
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stepnet as sn
from stepnet.errors import Error, LoDError
from stepnet.lod import LoDTensor, lengths_from_offsets, offsets_from_lengths, row_range

DESIGN_LOD = [[0, 2, 5], [0, 3, 5, 9, 10, 14]]
DESIGN_LENGTHS = [[2, 3], [3, 2, 4, 1, 4]]


# ---------------------------------------------------------------------------
# Reference model: nested Python lists, built from lengths only
# ---------------------------------------------------------------------------


def nest(rows, lengths):
    """Group ``rows`` into nested lists following per-level ``lengths``."""
    items = list(rows)
    for lens in reversed(lengths):
        it = iter(items)
        items = [[next(it) for _ in range(n)] for n in lens]
        assert next(it, None) is None, "lengths do not use every item"
    return items


def nested(t):
    """The nested-list view of a LoDTensor (rows as lists)."""
    return nest(t.data.tolist(), t.lengths)


def make_data(rows, features=(2,), dtype=np.float64):
    """Distinct rows so that misplaced rows are detected."""
    size = rows * int(np.prod(features))
    return np.arange(size, dtype=dtype).reshape((rows,) + tuple(features))


@st.composite
def nested_lengths(draw, min_levels=1, max_levels=4, max_top=5, max_len=4):
    """Random per-level lengths: 1-4 levels, zero lengths and empty batches included."""
    num_levels = draw(st.integers(min_levels, max_levels))
    entries = draw(st.integers(0, max_top))
    lengths = []
    for _ in range(num_levels):
        lens = draw(st.lists(st.integers(0, max_len), min_size=entries, max_size=entries))
        lengths.append(lens)
        entries = sum(lens)
    return lengths


@st.composite
def lod_tensors(draw, min_levels=1, max_levels=4, features=(2,)):
    lengths = draw(nested_lengths(min_levels=min_levels, max_levels=max_levels))
    rows = sum(lengths[-1])
    return LoDTensor.from_lengths(make_data(rows, features), lengths)


# ---------------------------------------------------------------------------
# The DESIGN example and a 3-level example
# ---------------------------------------------------------------------------


def test_design_example():
    data = make_data(14)
    t = LoDTensor(data, DESIGN_LOD)
    assert t.lod == DESIGN_LOD
    assert t.lengths == DESIGN_LENGTHS
    assert t.num_levels == 2
    assert t.num_sequences == 2
    assert len(t) == 2
    assert t.shape == (14, 2)
    assert t.dtype == np.float64
    assert t.data is data

    chapter1 = t.sequence(1)
    assert isinstance(chapter1, LoDTensor)
    assert chapter1.lod == [[0, 4, 5, 9]]
    np.testing.assert_array_equal(chapter1.data, data[5:14])
    np.testing.assert_array_equal(chapter1.sequence(2), data[10:14])
    np.testing.assert_array_equal(t.sequence(0).sequence(1), data[3:5])

    padded, lengths = t.to_padded(pad_value=-1)
    assert padded.shape == (5, 4, 2)
    assert lengths.dtype == np.int64
    assert lengths.tolist() == [3, 2, 4, 1, 4]
    np.testing.assert_array_equal(padded[3, 0], data[9])
    assert (padded[3, 1:] == -1).all()


def test_from_lengths_design_example():
    t = LoDTensor.from_lengths(make_data(14), DESIGN_LENGTHS)
    assert t.lod == DESIGN_LOD
    assert t.lengths == DESIGN_LENGTHS


def test_three_levels():
    # 2 books / 3 chapters / 5 paragraphs / 9 words; one chapter is empty.
    lengths = [[2, 1], [2, 0, 3], [1, 3, 2, 0, 3]]
    data = make_data(9, features=(3,))
    t = LoDTensor.from_lengths(data, lengths)
    assert t.lod == [[0, 2, 3], [0, 2, 2, 5], [0, 1, 4, 6, 6, 9]]
    assert t.num_sequences == 2

    book0 = t.sequence(0)
    assert book0.num_levels == 2
    assert book0.lod == [[0, 2, 2], [0, 1, 4]]
    np.testing.assert_array_equal(book0.data, data[:4])

    book1 = t.sequence(-1)
    assert book1.lod == [[0, 3], [0, 2, 2, 5]]
    np.testing.assert_array_equal(book1.data, data[4:9])
    chapter = book1.sequence(0)
    assert chapter.lod == [[0, 2, 2, 5]]
    np.testing.assert_array_equal(chapter.sequence(1), data[6:6])
    np.testing.assert_array_equal(chapter.sequence(2), data[6:9])

    padded, lens = t.to_padded()
    assert padded.shape == (5, 3, 3)
    assert lens.tolist() == [1, 3, 2, 0, 3]
    assert (padded[3] == 0).all()

    assert row_range(t.levels, 0, 1, 2) == (4, 9)
    assert row_range(t.levels, 1, 0, 2) == (0, 4)
    assert row_range(t.levels, 2, 3, 5) == (6, 9)
    assert row_range(t.levels, 3, 2, 7) == (2, 7)


def test_empty_batch_and_empty_sequences():
    t = LoDTensor(np.zeros((0, 4), np.float32), [[0]])
    assert t.num_sequences == 0
    assert len(t) == 0
    padded, lens = t.to_padded()
    assert padded.shape == (0, 0, 4)
    assert padded.dtype == np.float32
    assert lens.shape == (0,)

    t = LoDTensor(np.zeros((0, 4)), [[0, 0, 0]])
    padded, lens = t.to_padded()
    assert padded.shape == (2, 0, 4)
    assert lens.tolist() == [0, 0]
    assert t.sequence(1).shape == (0, 4)

    back = LoDTensor.from_padded(padded, lens)
    assert back.lod == [[0, 0, 0]]
    assert back.shape == (0, 4)


def test_levels_read_only_and_lod_is_a_copy():
    offsets = np.array([0, 2, 5])
    t = LoDTensor(make_data(5), [offsets])
    offsets[1] = 4  # the caller's array is copied
    assert t.lod == [[0, 2, 5]]
    assert isinstance(t.levels, tuple)
    assert t.levels[0].dtype == np.int64
    assert not t.levels[0].flags.writeable
    with pytest.raises(ValueError):
        t.levels[0][1] = 1
    # nor made writeable again: kernels index rows by offsets checked once
    for u in (t, t.select([0]), LoDTensor.concat([t, t]), copy.deepcopy(t),
              LoDTensor.from_lengths(make_data(5), [[2, 3]])):
        with pytest.raises(ValueError):
            u.levels[0].flags.writeable = True
        assert isinstance(u.levels[0].base, bytes)  # (nor its base: an owner could be)
    lod = t.lod
    lod[0][1] = 3
    assert t.lod == [[0, 2, 5]]
    assert all(type(v) is int for v in t.lod[0])
    assert all(type(v) is int for v in t.lengths[0])


def test_accepts_tuples_and_integer_arrays():
    t = LoDTensor(make_data(5), ([np.uint8(0), 2, 5],))
    assert t.lod == [[0, 2, 5]]
    t = LoDTensor(make_data(5), [np.array([0, 2, 5], dtype=np.uint32)])
    assert t.lod == [[0, 2, 5]]
    t = LoDTensor(make_data(5), np.array([[0, 2, 5]]))
    assert t.lod == [[0, 2, 5]]


def test_no_levels():
    for lod in (None, []):
        t = LoDTensor(make_data(3), lod)
        assert t.num_levels == 0
        assert t.lod == []
        assert t.lengths == []
        assert t.levels == ()
        with pytest.raises(LoDError, match="no LoD levels"):
            _ = t.num_sequences
        with pytest.raises(LoDError, match="no LoD levels"):
            len(t)
        with pytest.raises(LoDError, match="no LoD levels"):
            t.to_padded()
        with pytest.raises(LoDError, match="no LoD levels"):
            t.sequence(0)
        with pytest.raises(LoDError, match="no LoD levels"):
            t.select([0])
        with pytest.raises(LoDError, match="no LoD levels"):
            LoDTensor.concat([t, t])
    assert LoDTensor.from_lengths(make_data(3), []).num_levels == 0


def test_sequence_index_errors():
    t = LoDTensor(make_data(5), [[0, 2, 5]])
    np.testing.assert_array_equal(t.sequence(-2), t.data[:2])
    np.testing.assert_array_equal(t.sequence(np.int64(1)), t.data[2:])
    with pytest.raises(IndexError, match="sequence index 2 is out of range for 2"):
        t.sequence(2)
    with pytest.raises(IndexError, match="sequence index -3"):
        t.sequence(-3)
    with pytest.raises(TypeError):
        t.sequence(1.0)


def test_sequence_is_a_view():
    data = make_data(5)
    t = LoDTensor(data, [[0, 2, 5]])
    assert np.shares_memory(t.sequence(1), data)
    t2 = LoDTensor(data, [[0, 1], [0, 5]])
    assert np.shares_memory(t2.sequence(0).data, data)


def test_astype_and_repr():
    t = LoDTensor(make_data(14), DESIGN_LOD)
    t32 = t.astype(np.float32)
    assert t32.dtype == np.float32
    assert t32.lod == DESIGN_LOD
    np.testing.assert_array_equal(t32.data, t.data.astype(np.float32))
    assert t32.data is not t.data

    text = repr(t)
    assert text == ("LoDTensor(shape=(14, 2), dtype=float64, "
                    "lod=[[0, 2, 5], [0, 3, 5, 9, 10, 14]])")
    long = LoDTensor(np.zeros(20), [list(range(21))])
    assert repr(long) == ("LoDTensor(shape=(20,), dtype=float64, "
                          "lod=[[0, 1, 2, ..., 18, 19, 20]])")
    assert repr(LoDTensor(np.zeros(2))) == "LoDTensor(shape=(2,), dtype=float64, lod=[])"


def test_eq_is_identity():
    a = LoDTensor(make_data(3), [[0, 3]])
    b = LoDTensor(make_data(3), [[0, 3]])
    same = a
    assert a == same
    assert a != b
    assert (a == b) is False


def test_select_and_concat_examples():
    t = LoDTensor(make_data(14), DESIGN_LOD)
    s = t.select([1, 0])
    assert s.lod == [[0, 3, 5], [0, 4, 5, 9, 12, 14]]
    np.testing.assert_array_equal(s.data, np.concatenate([t.data[5:], t.data[:5]]))
    assert t.select([]).lod == [[0], [0]]
    assert t.select([]).shape == (0, 2)
    assert t.select([-1, -1]).lengths == [[3, 3], [4, 1, 4, 4, 1, 4]]

    c = LoDTensor.concat([t, s])
    assert c.lod == [[0, 2, 5, 8, 10], [0, 3, 5, 9, 10, 14, 18, 19, 23, 26, 28]]
    np.testing.assert_array_equal(c.data, np.concatenate([t.data, s.data]))


def test_select_index_errors():
    t = LoDTensor(make_data(5), [[0, 2, 5]])
    with pytest.raises(IndexError, match=r"indices\[1\] = 2 is out of range for 2"):
        t.select([0, 2])
    with pytest.raises(IndexError, match=r"indices\[0\] = -3"):
        t.select([-3])
    with pytest.raises(TypeError, match="integers"):
        t.select([0.0])
    with pytest.raises(TypeError, match="integers"):
        t.select([True, False])


# ---------------------------------------------------------------------------
# Validation errors: each names the level and the offset / index at fault
# ---------------------------------------------------------------------------


def test_lod_error_is_a_value_error():
    assert issubclass(LoDError, Error)
    assert issubclass(LoDError, ValueError)


def test_error_zero_dim_data():
    with pytest.raises(LoDError, match="at least 1 dimension"):
        LoDTensor(np.float32(1.0), [[0, 1]])
    with pytest.raises(LoDError, match="at least 1 dimension"):
        LoDTensor(3.0)


def test_error_lodtensor_as_data():
    t = LoDTensor(make_data(3), [[0, 3]])
    with pytest.raises(TypeError, match="already a LoDTensor"):
        LoDTensor(t, [[0, 3]])


def test_error_non_decreasing():
    with pytest.raises(LoDError, match=r"^lod level 1, offset 3: offsets must be "
                                       r"non-decreasing \(got 5 after 7\)$"):
        LoDTensor(make_data(9), [[0, 4], [0, 3, 7, 5, 9]])


def test_error_must_start_at_zero():
    with pytest.raises(LoDError, match=r"^lod level 0: must start at 0 \(got 1\)$"):
        LoDTensor(make_data(5), [[1, 5]])
    with pytest.raises(LoDError, match=r"^lod level 1: must start at 0 \(got 2\)"):
        LoDTensor(make_data(5), [[0, 1], [2, 5]])


def test_error_level_entries_mismatch():
    with pytest.raises(LoDError, match=r"^lod level 0: offsets end at 5 but level 1 has 4 "
                                       r"entries$"):
        LoDTensor(make_data(14), [[0, 2, 5], [0, 3, 5, 9, 14]])
    with pytest.raises(LoDError, match=r"^lod level 1: offsets end at 2 but level 2 has 3 "
                                       r"entries$"):
        LoDTensor(make_data(3), [[0, 2], [0, 1, 2], [0, 1, 2, 3]])


def test_error_last_level_rows_mismatch():
    with pytest.raises(LoDError, match=r"^lod level 1 \(the finest\): offsets end at 14 but "
                                       r"the data has 13 rows$"):
        LoDTensor(make_data(13), DESIGN_LOD)
    with pytest.raises(LoDError, match=r"^lod level 0 \(the only level\): offsets end at 3 "
                                       r"but the data has 4 rows$"):
        LoDTensor(make_data(4), [[0, 3]])


def test_error_non_integer_offsets():
    with pytest.raises(LoDError, match=r"^lod level 1, offset 2: offsets must be integers "
                                       r"\(got 2\.5\)$"):
        LoDTensor(make_data(5), [[0, 2], [0, 1, 2.5]])
    with pytest.raises(LoDError, match=r"^lod level 0, offset 1: offsets must be integers "
                                       r"\(got 2\.0\)$"):
        LoDTensor(make_data(2), [(0, 2.0)])
    with pytest.raises(LoDError, match=r"^lod level 0: offsets must be integers "
                                       r"\(got an array of dtype float64\)$"):
        LoDTensor(make_data(2), [np.array([0.0, 2.0])])
    with pytest.raises(LoDError, match=r"^lod level 0, offset 0: offsets must be integers "
                                       r"\(got False\)"):
        LoDTensor(make_data(1), [[False, True]])
    with pytest.raises(LoDError, match=r"^lod level 0, offset 1: offsets must be integers "
                                       r"\(got '2'\)"):
        LoDTensor(make_data(2), [[0, "2"]])


def test_error_offsets_out_of_int64():
    with pytest.raises(LoDError, match=r"^lod level 0, offset 1: offsets must fit in int64"):
        LoDTensor(make_data(2), [[0, 2**64]])
    with pytest.raises(LoDError, match=r"^lod level 0, offset 1: offsets must fit in int64"):
        LoDTensor(make_data(2), [np.array([0, 2**63], dtype=np.uint64)])


def test_error_negative_offsets():
    with pytest.raises(LoDError, match=r"^lod level 0, offset 2: offsets must be "
                                       r"non-negative \(got -1\)$"):
        LoDTensor(make_data(5), [[0, 3, -1, 5]])
    with pytest.raises(LoDError, match=r"^lod level 1, offset 0: offsets must be "
                                       r"non-negative \(got -2\)$"):
        LoDTensor(make_data(5), [[0, 1], [-2, 5]])


def test_error_empty_level():
    with pytest.raises(LoDError, match=r"^lod level 1: must have at least 1 offset \(got 0\)$"):
        LoDTensor(make_data(0), [[0], []])
    with pytest.raises(LoDError, match=r"^lod level 0: must have at least 1 offset"):
        LoDTensor(make_data(0), [np.zeros(0, dtype=np.int64)])


def test_error_malformed_levels():
    with pytest.raises(LoDError, match=r"^lod level 0: must be a 1-D sequence of offsets "
                                       r"\(got 0\); a LoD is a list of levels"):
        LoDTensor(make_data(5), [0, 2, 5])
    with pytest.raises(LoDError, match=r"^lod level 0: must be a 1-D sequence of offsets "
                                       r"\(got an array of shape \(1, 2\)\)"):
        LoDTensor(make_data(2), [[[0, 2]]])
    with pytest.raises(LoDError, match=r"^lod level 1: must be a 1-D sequence of offsets"):
        LoDTensor(make_data(2), [[0, 1], [[0, 1], [2]]])
    with pytest.raises(LoDError, match="lod must be a list of levels"):
        LoDTensor(make_data(2), 5)
    with pytest.raises(LoDError, match="lod must be a list of levels"):
        LoDTensor(make_data(2), "0,2")


def test_error_from_lengths():
    with pytest.raises(LoDError, match=r"^lengths level 1, index 2: lengths must be "
                                       r"non-negative \(got -1\)$"):
        LoDTensor.from_lengths(make_data(4), [[3], [2, 3, -1]])
    with pytest.raises(LoDError, match=r"^lengths level 0: lengths sum to 6 but level 1 has "
                                       r"5 entries$"):
        LoDTensor.from_lengths(make_data(14), [[2, 4], [3, 2, 4, 1, 4]])
    with pytest.raises(LoDError, match=r"^lengths level 1 \(the finest\): lengths sum to 14 "
                                       r"but the data has 15 rows$"):
        LoDTensor.from_lengths(make_data(15), DESIGN_LENGTHS)
    with pytest.raises(LoDError, match=r"^lengths level 0 \(the only level\): lengths sum to 9 "
                                       r"but the data has 10 rows$"):
        LoDTensor.from_lengths(make_data(10), [[4, 5]])
    with pytest.raises(LoDError, match=r"^lengths level 0, index 1: lengths must be "
                                       r"integers \(got 1\.5\)$"):
        LoDTensor.from_lengths(make_data(3), [[1, 1.5]])
    with pytest.raises(LoDError, match=r"^lengths level 0: must be a 1-D sequence of lengths "
                                       r"\(got 2\); lengths are a list of levels"):
        LoDTensor.from_lengths(make_data(5), [2, 3])
    with pytest.raises(LoDError, match="at least 1 dimension"):
        LoDTensor.from_lengths(np.float64(1.0), [[1]])


def test_error_from_padded():
    padded = np.zeros((3, 4, 2))
    with pytest.raises(LoDError, match=r"^lengths, index 1: length 5 is out of range \[0, 4\]$"):
        LoDTensor.from_padded(padded, [1, 5, 2])
    with pytest.raises(LoDError, match=r"^lengths, index 2: length -1 is out of range"):
        LoDTensor.from_padded(padded, [1, 0, -1])
    with pytest.raises(LoDError, match=r"lengths has 2 entries but padded has 3 sequences"):
        LoDTensor.from_padded(padded, [1, 2])
    with pytest.raises(LoDError, match=r"padded must have shape \[B, T, \.\.\.\]"):
        LoDTensor.from_padded(np.zeros(3), [1, 1, 1])
    with pytest.raises(LoDError, match=r"^lengths, index 0: lengths must be integers"):
        LoDTensor.from_padded(padded, [1.0, 2.0, 3.0])


def test_error_concat():
    a = LoDTensor(make_data(3), [[0, 1, 3]])
    with pytest.raises(LoDError, match=r"tensors\[1\] has 2 lod levels, tensors\[0\] has 1"):
        LoDTensor.concat([a, LoDTensor(make_data(3), [[0, 1], [0, 3]])])
    with pytest.raises(LoDError, match=r"tensors\[2\] has feature shape \(3,\)"):
        LoDTensor.concat([a, a, LoDTensor(make_data(3, (3,)), [[0, 3]])])
    with pytest.raises(LoDError, match=r"tensors\[1\] has dtype float32"):
        LoDTensor.concat([a, a.astype(np.float32)])
    with pytest.raises(LoDError, match="at least one"):
        LoDTensor.concat([])
    with pytest.raises(TypeError, match=r"tensors\[1\] is a ndarray"):
        LoDTensor.concat([a, a.data])


def test_error_helpers():
    with pytest.raises(LoDError, match=r"^lengths, index 1: lengths must be non-negative"):
        offsets_from_lengths([2, -3])
    with pytest.raises(LoDError, match=r"^lengths, index 0: lengths must be integers"):
        offsets_from_lengths([0.5])


# ---------------------------------------------------------------------------
# Property tests
# ---------------------------------------------------------------------------


@given(st.lists(st.integers(0, 10), max_size=20))
def test_offsets_lengths_round_trip(lengths):
    offsets = offsets_from_lengths(lengths)
    assert offsets.dtype == np.int64
    assert offsets[0] == 0
    assert len(offsets) == len(lengths) + 1
    assert offsets[-1] == sum(lengths)
    assert lengths_from_offsets(offsets).tolist() == lengths
    assert offsets_from_lengths(lengths_from_offsets(offsets)).tolist() == offsets.tolist()


@given(nested_lengths())
def test_lengths_lod_round_trip(lengths):
    rows = sum(lengths[-1])
    data = make_data(rows)
    t = LoDTensor.from_lengths(data, lengths)
    assert t.lengths == lengths
    assert t.num_levels == len(lengths)
    assert t.num_sequences == len(lengths[0])
    # Rebuild from the offsets and from the levels: same LoD.
    t2 = LoDTensor(data, t.lod)
    assert t2.lengths == lengths
    assert LoDTensor(data, t.levels).lod == t.lod
    # Offsets are the running sums of the lengths, level by level.
    for offsets, lens in zip(t.lod, lengths):
        assert offsets == [0] + np.cumsum(lens, dtype=np.int64).tolist()
    for k in range(len(lengths) - 1):
        assert t.lod[k][-1] == len(t.lod[k + 1]) - 1
    assert t.lod[-1][-1] == rows


@given(st.lists(st.integers(0, 6), max_size=6), st.integers(0, 3))
def test_padded_round_trip_one_level(lengths, extra):
    t = LoDTensor.from_lengths(make_data(sum(lengths), (3,), np.int32), [lengths])
    padded, lens = t.to_padded(pad_value=-7)
    steps = max(lengths, default=0)
    assert padded.shape == (len(lengths), steps, 3)
    assert padded.dtype == np.int32
    assert lens.tolist() == lengths
    back = LoDTensor.from_padded(padded, lens)
    assert back.lod == t.lod
    np.testing.assert_array_equal(back.data, t.data)
    assert back.dtype == t.dtype

    # Extra padding steps at the end do not change the result.
    wider = np.concatenate([padded, np.full((len(lengths), extra, 3), 9, np.int32)], axis=1)
    back = LoDTensor.from_padded(wider, lengths)
    assert back.lod == t.lod
    np.testing.assert_array_equal(back.data, t.data)


@given(lod_tensors(), st.sampled_from([0.0, -1.5]))
def test_padded_content(t, pad_value):
    padded, lens = t.to_padded(pad_value=pad_value)
    sequences = nest(t.data.tolist(), t.lengths[-1:])
    assert lens.tolist() == t.lengths[-1]
    assert padded.shape == (len(sequences), max(lens, default=0)) + t.shape[1:]
    for b, seq in enumerate(sequences):
        assert padded[b, :len(seq)].tolist() == seq
        assert (padded[b, len(seq):] == pad_value).all()


@given(lod_tensors())
def test_sequence_matches_nested_lists(t):
    reference = nested(t)
    assert len(reference) == t.num_sequences
    for i in range(-t.num_sequences, t.num_sequences):
        seq = t.sequence(i)
        if t.num_levels == 1:
            assert isinstance(seq, np.ndarray)
            assert seq.tolist() == reference[i]
        else:
            assert isinstance(seq, LoDTensor)
            assert seq.num_levels == t.num_levels - 1
            assert seq.lod[0][0] == 0
            assert nested(seq) == reference[i]
            assert seq.lengths == LoDTensor.from_lengths(seq.data, seq.lengths).lengths


@given(lod_tensors(), st.data())
def test_select_matches_nested_lists(t, data):
    n = t.num_sequences
    indices = data.draw(st.lists(st.integers(-n, n - 1), max_size=8) if n else st.just([]))
    s = t.select(indices)
    assert s.num_levels == t.num_levels
    reference = nested(t)
    assert nested(s) == [reference[i] for i in indices]


@given(lod_tensors(), st.randoms(use_true_random=False))
def test_select_permutation_round_trip(t, rnd):
    order = list(range(t.num_sequences))
    rnd.shuffle(order)
    inverse = np.argsort(order)
    back = t.select(order).select(inverse)
    assert back.lod == t.lod
    np.testing.assert_array_equal(back.data, t.data)


@given(st.integers(1, 4).flatmap(
    lambda k: st.lists(lod_tensors(min_levels=k, max_levels=k), min_size=1, max_size=4)))
def test_concat_matches_nested_lists(tensors):
    c = LoDTensor.concat(tensors)
    assert c.num_levels == tensors[0].num_levels
    assert nested(c) == [seq for t in tensors for seq in nested(t)]
    assert c.num_sequences == sum(t.num_sequences for t in tensors)


@settings(max_examples=50)
@given(lod_tensors(), st.data())
def test_split_then_concat_round_trip(t, data):
    n = t.num_sequences
    cut = data.draw(st.integers(0, n))
    parts = [t.select(range(cut)), t.select(range(cut, n))]
    back = LoDTensor.concat(parts)
    assert back.lod == t.lod
    np.testing.assert_array_equal(back.data, t.data)
    # Concatenating every sequence, each selected alone, rebuilds the tensor too.
    if n:
        back = LoDTensor.concat([t.select([i]) for i in range(n)])
        assert back.lod == t.lod
        np.testing.assert_array_equal(back.data, t.data)


@given(lod_tensors(), st.data())
def test_row_range_matches_nested_lists(t, data):
    level = data.draw(st.integers(0, t.num_levels - 1))
    entries = len(t.levels[level]) - 1
    start = data.draw(st.integers(0, entries))
    stop = data.draw(st.integers(start, entries))
    lo, hi = row_range(t.levels, level, start, stop)
    # Count rows in the entries before `start` and within [start, stop) from lengths.
    groups = nest(range(t.shape[0]), t.lengths[level:])

    def flatten(x):
        return [x] if isinstance(x, int) else [r for y in x for r in flatten(y)]

    assert list(range(lo, hi)) == flatten(groups[start:stop])
    assert lo == len(flatten(groups[:start]))


def test_to_padded_to_a_given_number_of_steps():
    t = LoDTensor(np.array([1, 2, 3]), [[0, 2, 3]])
    padded, lengths = t.to_padded(steps=4)
    assert padded.tolist() == [[1, 2, 0, 0], [3, 0, 0, 0]] and lengths.tolist() == [2, 1]
    with pytest.raises(LoDError, match="steps=1 is shorter than the longest sequence"):
        t.to_padded(steps=1)


def test_lengths_whose_sum_passes_int64_are_refused_with_their_sum():
    with pytest.raises(LoDError, match=r"lengths level 0: lengths sum to 9223372036854775813, past"):
        LoDTensor.from_lengths(np.zeros(5), [[2**62, 2**62, 5]])


@pytest.mark.parametrize("copy_of", [copy.copy, copy.deepcopy, lambda t: pickle.loads(pickle.dumps(t))])
def test_a_copy_keeps_its_lod_read_only_and_checked(copy_of):
    t = LoDTensor(np.arange(6.0), [[0, 1, 3], [0, 2, 2, 6]])
    c = copy_of(t)
    assert c.lod == t.lod and np.array_equal(c.data, t.data)
    with pytest.raises(ValueError, match="read-only"):
        c.levels[0][1] = 1000


def test_indices_and_offsets_are_integers_not_bools_nor_wrapped():
    t = LoDTensor(np.arange(5), [[0, 2, 5]])
    with pytest.raises(IndexError, match=r"indices\[0\] = 18446744073709551615 is out of range"):
        t.select(np.array([2**64 - 1], np.uint64))
    with pytest.raises(TypeError, match="not bools"):
        t.select([0, True])
    with pytest.raises(LoDError, match="offset 1: offsets must be integers \\(got True\\)"):
        LoDTensor(np.arange(5), [[0, True, 5]])


def test_copies_of_broadcast_rows_are_sized_before_they_are_made():
    """A LoD may declare many rows over a few broadcast ones: select, concat
    and to_padded copy them whole, so they are sized first, as astype is."""
    rows = np.broadcast_to(np.zeros(4, np.float32), (10**8, 4))  # 16 bytes, 1.5 GiB as a copy
    t = LoDTensor(rows, [[0, 10**8]])
    with sn.config(max_memory=64 * 2**20):
        for copy_of in (lambda: t.select([0]), lambda: LoDTensor.concat([t]), t.to_padded,
                        lambda: LoDTensor(np.zeros((1, 1), np.float32), [[0, 1]]).to_padded(steps=10**13)):
            with pytest.raises(sn.SizeError, match=r"LoDTensor\.\w+: the .* needs .* more than"):
                copy_of()
    with pytest.raises(sn.LoDError, match="steps must be an integer, got '5'"):
        t.to_padded(steps="5")


def test_rows_of_several_shapes_and_a_lod_tensor_given_as_rows_are_refused():
    with pytest.raises(LoDError, match="data must be an array of rows of one shape"):
        LoDTensor([[1, 2], [3]], [[0, 2]])
    with pytest.raises(LoDError, match="padded must be an array of rows of one shape"):
        LoDTensor.from_padded([[1, 2], [3]], [1, 1])
    t = LoDTensor(np.zeros(2), [[0, 2]])
    for make in (lambda: LoDTensor(t, [[0, 2]]), lambda: LoDTensor.from_lengths(t, [[2]]),
                 lambda: LoDTensor.from_padded(t, [1])):
        with pytest.raises(TypeError, match="is already a LoDTensor; pass its .data"):
            make()
