"""The decode graphs' static inputs (integration/static_inputs.py ``StaticInputs``): what ``fill`` and
a graph's first step (``copy_in``) leave in the buffers the graphs read, step after step, and where a
graph's draw goes (``publish``)."""
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
        inp.copy_in()
        table = np.zeros((size, width), np.int32)
        table[:b, :cols] = batch.block_tables
        pad = lambda x, v: np.concatenate([x, np.full(size - b, v, x.dtype)])  # noqa: E731
        want = dict(table=table, ids=pad(batch.input_ids, 0)[None], pos=pad(batch.positions.astype(np.int64), 0)[None],
                    slots=pad(batch.slot_mapping, -1), lens=pad(batch.seq_lens, 0),
                    **{n: np.full(size, v) for n, v in StaticInputs.PAD.items()})
        for name, value in want.items():
            got = getattr(inp, name).cpu().numpy()
            assert np.array_equal(got, value.astype(got.dtype)), (b, cols, name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width", [12, 64])
def test_fill_leaves_the_ids_a_graph_drew(device, width):
    """A step run ahead on the inputs whose graph drew its input ids (``ids``: a view of ``inp.ids``)
    keeps them on the device - the host's placeholders do not go up over them, in either kind of copy
    - while the rest is the batch's; ids from elsewhere are copied in over the host's; ``ids_kept``
    undoes what a warm-up's draw writes."""
    size, b, rng = 8, 6, np.random.default_rng(1)
    inp = StaticInputs(size, width, torch.device(device))
    inp.fill(decode_batch(rng, b, 5))
    drawn = torch.arange(100, 100 + size, device=device)
    inp.ids[0].copy_(drawn)  # what the graph's draw leaves
    batch = decode_batch(rng, b, 5)  # (its input ids: the host's placeholders)
    inp.fill(batch, inp.ids[0, :b])
    inp.copy_in()
    assert torch.equal(inp.ids[0], drawn)
    assert np.array_equal(inp.pos[0, :b].cpu().numpy(), batch.positions)
    assert np.array_equal(inp.table[:b, :5].cpu().numpy(), batch.block_tables)
    assert np.array_equal(inp.slots[:b].cpu().numpy(), batch.slot_mapping)
    other = torch.arange(7, 7 + b, device=device)
    inp.fill(batch, other)
    inp.copy_in()
    assert inp.ids[0].tolist() == other.tolist() + [0] * (size - b)
    with inp.ids_kept():
        inp.ids.fill_(3)
    assert inp.ids[0].tolist() == other.tolist() + [0] * (size - b)


@pytest.mark.parametrize("device", DEVICES)
def test_publish_alternates_halves(device):
    """A graph's draw: its tokens become the inputs' ids, and tokens and log-probabilities go to the
    half of ``drawn`` its fill picked - the next fill's graph writes the other half, so the one the
    host reads is not written until two fills later."""
    size, rng = 8, np.random.default_rng(2)
    inp = StaticInputs(size, 12, torch.device(device))
    seen = []
    for step in range(3):
        inp.fill(decode_batch(rng, 6, 4))
        inp.copy_in()
        tokens = torch.arange(size, device=device) + 10 * step
        logprobs = -torch.arange(size, device=device, dtype=torch.float32) / (step + 1)
        inp.publish(tokens, logprobs)
        if device == "cuda":
            torch.cuda.synchronize()
        assert inp.ids[0].tolist() == tokens.tolist()
        half = inp.drawn[inp.half]
        assert half[:, 0].tolist() == tokens.double().tolist() and half[:, 1].tolist() == logprobs.double().tolist()
        seen.append((inp.half, half[:, 0].clone()))
    assert [h for h, _ in seen] == [1, 0, 1]
    assert inp.drawn[0, :, 0].tolist() == seen[1][1].tolist()  # (the second step's half, untouched by the third)
