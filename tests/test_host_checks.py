"""The launch-time checks and allocations shared by the kernels' host code (run on CPU tensors here)."""
import pytest
import torch

from cute_moe.kernels.host_checks import check_index_range, check_rows_16b, debug_check_index_range, empty_mn_major


def test_rows_16b_accepts_aligned_rows_and_size_one_dims():
    check_rows_16b("op", "x", torch.zeros(4, 64, dtype=torch.bfloat16))
    check_rows_16b("op", "x", torch.zeros(3, 1, 64, dtype=torch.bfloat16)[:, :, :])  # size-1 dim: any stride
    check_rows_16b("op", "x", torch.zeros(8, 2, 128, dtype=torch.float32).transpose(0, 1))  # bhsd-like view


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(4, 68, dtype=torch.bfloat16)[:, :64],  # row stride 136 bytes
        lambda: torch.zeros(4, 64, dtype=torch.bfloat16)[:, 4:36],  # base 8 bytes in
        lambda: torch.zeros(64, 4, dtype=torch.bfloat16).t(),  # last stride != 1
    ],
)
def test_rows_16b_rejects_what_vector_loads_cannot_take(make):
    with pytest.raises(ValueError, match="cute_moe.op: x needs a unit last stride"):
        check_rows_16b("op", "x", make())


def test_debug_index_range_is_off_by_default(monkeypatch):
    monkeypatch.delenv("CUTE_MOE_DEBUG", raising=False)
    debug_check_index_range("op", "ids", torch.tensor([[-5, 99]]), 10)  # not read: no error


def test_debug_index_range_names_the_first_bad_entry(monkeypatch):
    monkeypatch.setenv("CUTE_MOE_DEBUG", "1")
    debug_check_index_range("op", "ids", torch.tensor([[-1, 0], [9, 3]]), 10)
    with pytest.raises(ValueError, match=r"cute_moe.op: ids entries must lie in \[-1, 10\), got 10 at \(1, 0\)"):
        debug_check_index_range("op", "ids", torch.tensor([[-1, 0], [10, 3]]), 10)
    with pytest.raises(ValueError, match=r"got -2 at \(0, 1\)"):
        debug_check_index_range("op", "ids", torch.tensor([[0, -2]]), 10)


@pytest.mark.parametrize("rows,cols", [(0, 0), (0, 56), (1, 56), (7, 1), (4096, 56), (3, 0)])
def test_empty_mn_major_has_the_layout_the_fake_implementations_promise(rows, cols):
    """The ops' fake implementations build MN-major scales as empty(cols, rows).t(): the kernels'
    single empty_strided must give the same shape and strides, zero-size dims included."""
    got = empty_mn_major(rows, cols, torch.device("cpu"))
    want = torch.empty(cols, rows).t()
    assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)


def test_index_range_bounds_past_the_dtype_hold_for_every_entry():
    """An upper bound past int32's range (a tensor of more than 2**31 rows) must not wrap when
    compared with int32 entries and refuse valid ones."""
    ids = torch.tensor([[-1, 0], [2**31 - 1, 7]], dtype=torch.int32)
    check_index_range("op", "ids", ids, -1, 2**31)
    check_index_range("op", "ids", ids, -(2**40), 2**40)
    with pytest.raises(ValueError, match=r"ids entries must lie in \[0, 2147483648\), got -1 at \(0, 0\)"):
        check_index_range("op", "ids", ids, 0, 2**31)
