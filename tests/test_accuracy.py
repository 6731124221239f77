"""npattn's float32 results are as close to the float64 truth as PyTorch's own float32 results.

The figures come from ``python -m benchmarks.accuracy`` (errors in units of eps32 times the
magnitude of the summed terms); here they are held: for every case the median and the worst
error of npattn may exceed PyTorch's by at most 25 % plus a small slack.
"""
import pytest

from benchmarks.accuracy import measure


@pytest.mark.parametrize("seed", [0, 1])
def test_float32_error_is_no_worse_than_pytorch(torch, seed):
    for label, (our_median, our_max), theirs in measure(seed):
        their_median, their_max = theirs
        assert our_median <= 1.25 * their_median + 0.05, (label, our_median, their_median)
        assert our_max <= 1.25 * their_max + 0.5, (label, our_max, their_max)
