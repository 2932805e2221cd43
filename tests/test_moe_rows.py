"""Which rows the row-walking kernels (``silu_mul_quant``) process, on the CPU.

``moe_rows.processed_rows`` is the executable model of the device arithmetic (``rows_end``,
``real_rows_end`` and the 64-row blocks).  For routings from ``align_ref``: without counts
every row below ``expert_offsets[-1]``; with ``align``'s counts every real row
``[off[e], off[e] + counts[e])`` whatever the alignment, and with segments of multiples of 64
rows (the GEMM's 128) nothing else -- the padding is neither read nor written."""
import random

import pytest
import torch

from cute_moe import reference as R
from cute_moe.kernels import moe_rows

ROWS_PER_CTA = 64  # silu_mul_quant: 8 lanes per row, 32 rows per pass, 2 passes


def _real(offsets, counts):
    return [r for e, c in enumerate(counts) for r in range(offsets[e], offsets[e] + c)]


def _routing(rng, T, k, E, alignment, local=None, expert_offset=0):
    ids = torch.tensor([rng.sample(range(E), k) for _ in range(T)], dtype=torch.int32).reshape(T, k)
    off, r2t, _, counts = R.align_ref(ids, E, alignment, expert_offset, local)
    return off.tolist(), r2t.shape[0], counts.tolist()


@pytest.mark.parametrize("alignment", [128, 64, 32, 8, 1])
@pytest.mark.parametrize(("T", "k", "E"), [(1, 8, 256), (7, 2, 4), (64, 8, 256), (300, 8, 32), (200, 8, 600),
                                           (0, 2, 4)])  # fmt: skip
def test_real_rows_processed(alignment, T, k, E):
    rng = random.Random(1000 * T + E + alignment)
    off, m_cap, counts = _routing(rng, T, k, E, alignment)
    real = _real(off, counts)
    assert moe_rows.processed_rows(off, None, m_cap, ROWS_PER_CTA) == list(range(off[-1]))
    rows = moe_rows.processed_rows(off, counts, m_cap, ROWS_PER_CTA)
    assert set(real) <= set(rows) and rows == sorted(set(rows)) and all(0 <= r < off[-1] for r in rows)
    if alignment % ROWS_PER_CTA == 0:
        assert rows == real  # the padding is skipped entirely


def test_expert_parallel_shard_and_rows_before_the_first_segment():
    rng = random.Random(7)
    off, m_cap, counts = _routing(rng, 100, 8, 64, 128, local=16, expert_offset=16)
    assert off[-1] < m_cap
    assert moe_rows.processed_rows(off, counts, m_cap, ROWS_PER_CTA) == _real(off, counts)
    # Segments starting past row 0: the rows before off[0] belong to no segment, never processed.
    shifted = [o + 128 for o in off]
    rows = moe_rows.processed_rows(shifted, counts, m_cap + 128, ROWS_PER_CTA)
    assert rows == _real(shifted, counts)


def test_counts_out_of_range_stay_inside_the_segment():
    # counts larger than the segment (or negative) never process a row of another segment or past end.
    off = [0, 128, 256, 384]
    rows = moe_rows.processed_rows(off, [500, -3, 0], 384, ROWS_PER_CTA)
    assert rows == list(range(128))
    assert moe_rows.processed_rows(off, [500, -3, 0], 200, ROWS_PER_CTA) == list(range(128))  # end = M_cap
