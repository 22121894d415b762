"""vfesim.pairwise.gemm's receiver blocks (the kernels themselves run in tests/cudasim and on a GPU)."""

import numpy as np

from vfesim.pairwise.gemm import GEMM_BLOCK_BYTES, block_rows


def test_block_rows_fill_the_slab_budget():
    assert GEMM_BLOCK_BYTES == 1 << 30
    assert block_rows(16384, "float64", np) == 8192  # 1 GiB of float64 logits
    assert block_rows(16384, "float32", np) == 16384  # every receiver at once
    assert block_rows(65536, "float32", np) == 4096
    assert block_rows(7, "float64", np) == 7
    assert block_rows(1 << 28, "float64", np) == 1  # never none


class _FakeCupy:
    """The part of CuPy block_rows asks: a device of 4 GiB."""

    class cuda:
        class Device:
            id = 0

            def __init__(self, i=0):
                pass

            mem_info = (1 << 31, 1 << 32)


def test_block_rows_take_a_sixteenth_of_a_small_device():
    assert block_rows(16384, "float64", _FakeCupy) == (1 << 28) // (16384 * 8)
    assert block_rows(16384, "float64", _FakeCupy, device=1) == (1 << 28) // (16384 * 8)  # the arrays' GPU
