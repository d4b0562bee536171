"""The torch path's KV read (issue 26): a request whose local list is one ascending run of rows is
read as a view of the pool (no gather), bit-identical to the gather; anything else is gathered."""

import sys

import torch

from sglang_helix.testing.cpu_env import STUB_DIR

if STUB_DIR not in sys.path:
    sys.path.insert(0, STUB_DIR)

from sglang.srt.layers.dcp.torch_attention import _read_rows, _run_starts  # noqa: E402


def test_run_starts_only_for_exact_ascending_runs():
    idx = torch.tensor([5, 6, 7, 8, 3, 2, 9, 10, 12, 40], dtype=torch.int64)
    # [5..8] a run; [3, 2] descending; [] empty; [9, 10, 12] a gap; [40] a run of one
    assert _run_starts(idx, [0, 4, 6, 6, 9, 10]) == [5, None, None, None, 40]
    # same span, permuted: not a run (the view would change the summation order)
    assert _run_starts(torch.tensor([1, 3, 2, 4]), [0, 4]) == [None]


def test_view_equals_gather_and_never_scales_the_pool():
    buf = torch.randn(64, 2, 8)
    rows = torch.arange(10, 30)
    assert torch.equal(_read_rows(buf, slice(10, 30), 1.0), _read_rows(buf, rows, 1.0))
    assert _read_rows(buf, slice(10, 30), 1.0).data_ptr() == buf[10].data_ptr()  # no copy
    before = buf.clone()
    assert torch.equal(_read_rows(buf, slice(10, 30), 0.5), _read_rows(buf, rows, 0.5))
    assert torch.equal(buf, before)
