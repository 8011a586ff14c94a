"""The benchmark timing helper (qops.testing): how many calls one timed CUDA graph makes."""

from __future__ import annotations

import pytest
import torch

from qops import testing


@pytest.mark.parametrize(
    "per_call_us, n_sets, want",
    [
        (25.0, 2, 20),  # 2 sets of a 25 us call: 20 rounds, 40 calls, 1 ms
        (600.0, 2, 1),  # already longer than GRAPH_MIN_US
        (1.0, 2, 64),  # capped at GRAPH_MAX_CALLS = 128 calls
        (1.0, 32, 4),
        (2.0, 200, 1),  # more sets than the cap: each once
        (0.0, 3, 42),  # a call too short to time: the cap (128 // 3 rounds)
    ],
)
def test_graph_repeats(per_call_us, n_sets, want):
    assert testing._graph_repeats(per_call_us, n_sets) == want


@pytest.mark.gpu
def test_runner_repeats_sets_in_turn():
    used = []
    x = torch.zeros(1024, device="cuda")

    def make(i):
        def call():
            used.append(i)  # runs at warm-up and capture only; replays do not call Python
            x.add_(1.0)

        return call

    run, ncalls = testing._runner(make, 3, True)
    # a microsecond kernel: the graph repeats the 3 sets (up to the cap) to run ~GRAPH_MIN_US
    assert ncalls % 3 == 0 and 3 < ncalls <= testing.GRAPH_MAX_CALLS
    # the last capture called the sets in turn, each equally often
    assert used[-ncalls:] == [0, 1, 2] * (ncalls // 3)
    before = x[0].item()
    run()
    torch.cuda.synchronize()
    assert x[0].item() == before + ncalls
    assert testing.bench_us(make, 3, replays=3, warmup=1) > 0.0
