"""Cascade planning on the host, against plain references: the leader comparison of the prefix
forest."""
from __future__ import annotations

import numpy as np
import pytest

from paged_backend.cascade_forest import lcp_with_leaders


def lcp_reference(table, rows, leads, start, cap):
    out = np.array(cap, dtype=np.int64)
    for i, (r, ld) in enumerate(zip(rows, leads)):
        neq = np.flatnonzero(table[r, start[i]:cap[i]] != table[ld, start[i]:cap[i]])
        if neq.size:
            out[i] = start[i] + neq[0]
    return out


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("n_runs,per_run", [(1, 1), (3, 2), (1, 400), (40, 9), (12, 60), (300, 1)])
def test_lcp_with_leaders_equals_reference(seed, n_runs, per_run):
    """Runs of rows per leader that share a random depth with it, some rows (or the probe, the
    run's middle row) diverging earlier or later; singleton runs; sizes on both sides of the
    one-pass, probe and chunked paths; int32 and int64 tables."""
    rng = np.random.default_rng(seed * 100 + n_runs + per_run)
    width = int(rng.integers(300, 1500))
    table = rng.integers(0, 1 << 30, size=(n_runs * (per_run + 1), width))
    table = table.astype(np.int64 if seed % 2 else np.int32)
    rows, leads, start = [], [], []
    for g in range(n_runs):
        lead = g * (per_run + 1)
        depth = int(rng.integers(1, width))
        for r in range(lead + 1, lead + per_run + 1):
            d = depth if rng.random() < 0.7 else int(rng.integers(0, width))  # some rows diverge elsewhere
            table[r, :d] = table[lead, :d]
            rows.append(r)
            leads.append(lead)
        start += [int(rng.integers(0, max(1, depth // 2)))] * per_run
    rows, leads, start = np.array(rows), np.array(leads), np.array(start)
    lcp0 = lcp_reference(table, rows, leads, np.zeros_like(start), np.full(rows.size, width))
    start = np.minimum(start, lcp0)  # columns before start must be equal
    cap = np.maximum(start, rng.integers(0, width + 1, size=rows.size))
    assert np.array_equal(lcp_with_leaders(table, rows, leads, start, cap), np.minimum(lcp0, cap))
