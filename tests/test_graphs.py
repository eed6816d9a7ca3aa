"""The decode graphs' static inputs (integration/graphs.py ``StaticInputs``): what ``fill`` leaves in the
buffers the graphs read, step after step."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from paged_backend.integration.graphs import StaticInputs

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


def decode_batch(rng, b: int, cols: int):
    """A decode step of ``b`` rows whose block tables hold ``cols`` columns (the scheduler's fields
    that ``fill`` reads)."""
    lens = rng.integers(1, 16 * cols + 1, b).astype(np.int32)
    lens[0] = 16 * cols  # (the widest row sets the table's columns)
    table = np.where(np.arange(cols)[None, :] < -(-lens[:, None] // 16), rng.integers(1, 999, (b, cols)), 0)
    return SimpleNamespace(seqs=[None] * b, input_ids=rng.integers(0, 500, b), positions=lens - 1,
                           slot_mapping=rng.integers(0, 9999, b), block_tables=table.astype(np.int32), seq_lens=lens)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width", [12, 64])
def test_fill_steps(device, width):
    """Steps of more and fewer rows and table columns: each leaves its rows' values, the padding's in
    the other rows, and in the table its block ids with zeros everywhere else - columns and rows an
    earlier step filled included - whether the table went up whole (narrow: its used columns most of
    it) or only its used columns (wide: a model's whole context)."""
    size, rng = 8, np.random.default_rng(0)
    inp = StaticInputs(size, width, torch.device(device))
    for b, cols in [(8, 10), (5, 12), (8, 3), (2, 12), (6, 7), (8, 1)]:
        batch = decode_batch(rng, b, cols)
        inp.fill(batch)
        table = np.zeros((size, width), np.int32)
        table[:b, :cols] = batch.block_tables
        pad = lambda x, v: np.concatenate([x, np.full(size - b, v, x.dtype)])  # noqa: E731
        want = dict(table=table, ids=pad(batch.input_ids, 0)[None], pos=pad(batch.positions.astype(np.int64), 0)[None],
                    slots=pad(batch.slot_mapping, -1), lens=pad(batch.seq_lens, 0),
                    **{n: np.full(size, v) for n, v in StaticInputs.PAD.items()})
        for name, value in want.items():
            got = getattr(inp, name).cpu().numpy()
            assert np.array_equal(got, value.astype(got.dtype)), (b, cols, name)
