"""Flat buffers: a device's chunk of a packed buffer built from the arrays it overlaps."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from job_scripts.packing import flat_layout, pack, pack_by_groups, pack_range  # noqa: E402


def test_a_range_of_the_packed_buffer_is_built_from_the_arrays_it_overlaps():
    rng = np.random.default_rng(0)
    shapes = [(3, 4), (5,), (2, 2, 2), (7,)]  # 12 + 5 + 8 + 7 = 32 float32 elements
    arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    structs = [jax.ShapeDtypeStruct(s, np.float32) for s in shapes]
    with_int = structs + [jax.ShapeDtypeStruct((3,), np.int32)]  # another dtype's array is skipped
    layout = flat_layout(with_int)
    arrays_all = arrays + [np.arange(3, dtype=np.int32)]
    whole = np.asarray(pack(layout, arrays_all, {"float32": 40, "int32": 3})["float32"])  # 8 of padding
    for start, stop in ((0, 10), (10, 20), (20, 30), (30, 40), (12, 17), (36, 40), (0, 40)):
        got = np.asarray(pack_range(layout, arrays_all, "float32", start, stop))
        assert got.shape == (stop - start,)
        np.testing.assert_array_equal(got, whole[start:stop])


def test_packing_group_by_group_gives_the_packed_buffers():
    rng = np.random.default_rng(1)
    shapes = [((3, 4), np.float32), ((2,), np.int32), ((5,), np.float32), ((4,), np.int32),
              ((2, 3), np.float32), ((1,), np.float32)]
    arrays = [rng.integers(0, 9, s).astype(t) for s, t in shapes]
    layout = flat_layout([jax.ShapeDtypeStruct(s, t) for s, t in shapes])
    lengths = {"float32": 30, "int32": 8}  # padding in both
    want = pack(layout, arrays, lengths)
    for counts in ((6,), (2, 3, 1), (1, 1, 1, 1, 1, 1)):
        got = pack_by_groups(layout, counts, arrays, lengths)
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]))
    with pytest.raises(ValueError):
        pack_by_groups(layout, (2, 3), arrays, lengths)


def test_a_chunking_cuts_each_region_over_the_ranks_and_puts_it_back():
    from job_scripts.packing import Chunking

    # Three regions (layers) of 7, 4 and 9 elements over 3 ranks: chunks of 3, 2 and 3.
    cut = Chunking(((0, 7), (7, 4), (11, 9)), 3)
    assert cut.chunks == (3, 2, 3) and cut.offsets == (0, 3, 5) and cut.length == 8 and cut.span == 20
    whole = np.arange(1, 21, dtype=np.float32)
    locals_ = [cut.local_of_whole(whole, r) for r in range(3)]
    # Rank 2 holds element 6 of the first region, elements 10 and 11 (padding: none of the
    # second, whose 4 elements rank 0 and 1 hold) and 17..19 of the third.
    np.testing.assert_array_equal(locals_[2], [7, 0, 0, 0, 0, 18, 19, 20])
    np.testing.assert_array_equal(cut.whole_of_locals(locals_), whole)
    for r in range(3):
        got = np.asarray(cut.local_of_packed(jax.numpy.asarray(whole), r))
        np.testing.assert_array_equal(got, locals_[r])
    for lo, hi in ((0, 20), (5, 13), (7, 11), (19, 20), (2, 3)):
        read = np.concatenate([locals_[r][a:b] for r, a, b in cut.locate(lo, hi)])
        np.testing.assert_array_equal(read, whole[lo:hi])
