"""`qla-serve bench prefill --idle`: the GPU idle time per call from a kernel timeline
(bench/prefill.idle_per_call_us). Pure arithmetic on (start, end) spans, so it runs on the CPU;
the profiler that supplies the spans on the H200 is exercised by the benchmark runs
(benchmarks/prefill.md v20)."""

import pytest

from qla_serve.bench.prefill import idle_per_call_us


def test_back_to_back_kernels_have_no_idle_time():
    assert idle_per_call_us([(0, 10), (10, 25), (25, 30)], calls=3) == 0.0


def test_gaps_between_and_within_calls_count_once_per_call():
    # two calls of two kernels: 1 us between kernels inside a call, 4 us between the calls
    spans = [(0, 10), (11, 20), (24, 34), (35, 44)]
    assert idle_per_call_us(spans, calls=2) == pytest.approx((1 + 4 + 1) / 2)


def test_overlapping_kernels_are_busy_once_and_order_does_not_matter():
    # a kernel inside another one's span and one that overlaps its end: busy 0-15, idle 15-20
    spans = [(20, 30), (2, 5), (0, 10), (8, 15)]
    assert idle_per_call_us(spans, calls=1) == pytest.approx(5.0)
