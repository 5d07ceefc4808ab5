"""Flat buffers: a device's chunk of a packed buffer built from the arrays it overlaps."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from job_scripts.packing import flat_layout, pack, pack_range  # noqa: E402


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
