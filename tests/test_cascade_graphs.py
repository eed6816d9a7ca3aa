"""The engine's cascade CUDA graphs (integration/cascade_graphs.py), planning only: which steps
capture a graph. A forward stand-in returns zero logits; the plans are the real ones."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

import paged_backend.cascade.fused as fused
from paged_backend.cascade import partition
from paged_backend.integration.cascade_graphs import CascadeGraphs
from paged_backend.integration.kv_cache import KVCacheSpec, PagedKVCache
from paged_backend.integration.step import StepBuilder
from paged_backend.scheduler import BlockManager, SamplingParams, Scheduler


def test_a_repeated_schedule_captures_nothing_the_second_time(monkeypatch):
    """RL rollouts call generate again and again on batches of the same shape: 16 prompts x 8 samples,
    prompt i stopping after 64 - 32i//15 tokens, so the batch shrinks and its forest changes. The first
    call captures a graph per padded size and launch key; a call of other shape between (every prompt
    4 tokens) must not drop them; the third call, the first's shape again, captures none. Planned as on
    an H200 (132 SMs, the Hopper kernel's lists): there the lists' parts come and go with the node tile,
    and the lists' lengths change with the rows."""
    monkeypatch.setattr(fused, "use_sm90", lambda device: True)
    monkeypatch.setattr(partition, "num_sms", lambda device: 132)
    prompts, n, prompt_len, new, vocab = 16, 8, 1024, 64, 11
    spec = KVCacheSpec(1, 8, 128, 16, torch.bfloat16, torch.device("cpu"))
    cache = PagedKVCache(spec, 8)  # (planning only: the pool is not read)
    builder = StepBuilder(cache, num_q_heads=32)
    sched = Scheduler(BlockManager(8000, 16, watermark=0.0), max_num_seqs=prompts * n,
                      max_num_batched_tokens=1 << 16)

    def forward(input_ids, logits_to_keep, **kw):
        assert logits_to_keep == 0  # (every row's)
        return SimpleNamespace(logits=torch.zeros(1, input_ids.shape[1], vocab))
    graphs = CascadeGraphs(forward, cache, builder, max_num_seqs=prompts * n, max_model_len=prompt_len + new + 16,
                           capture=False)
    rng = np.random.default_rng(0)

    def generate(ids, max_tokens):
        for p, m in zip(ids, max_tokens):
            sched.add_request(p, SamplingParams(n=n, max_tokens=m, ignore_eos=True))
        before, steps = graphs.captures, 0
        while sched.has_unfinished():
            batch = sched.schedule()
            if batch.num_prefill_tokens or not builder.wants_cascade(batch) or graphs.run(batch) is None:
                builder.planner.reset()
            else:
                steps += 1
            sched.postprocess(batch, rng.integers(10, 300, int(batch.num_samples.sum())))
        return graphs.captures - before, steps
    ids = [rng.integers(10, 32000, prompt_len).tolist() for _ in range(prompts)]
    news = [new - i * (new // 2) // (prompts - 1) for i in range(prompts)]
    first, steps = generate([[t - 1 for t in p] for p in ids], news)
    assert steps >= 60 and 5 <= first < steps  # (a graph per padded size 128, 64, 32, 16, 8 at least)
    generate([[t - 2 for t in p] for p in ids], [4] * prompts)
    assert generate(ids, news) == (0, steps)


def test_a_step_left_to_the_flat_graph_still_reads_its_inputs_in():
    """A step whose plan keeps no node goes to the flat graph (``run`` gives None) after its inputs were
    written for the cascade graph: they are read in there and then, so the next step's columns and
    rows to clear are counted from what the device holds (a step of 10 table columns, one of 5 left
    to the flat graph, one of 3: the device table's columns 3.. are zeros)."""
    spec = KVCacheSpec(1, 2, 64, 16, torch.float32, torch.device("cpu"))
    cache = PagedKVCache(spec, 64)
    graphs = CascadeGraphs(None, cache, StepBuilder(cache, num_q_heads=4), max_num_seqs=8, max_model_len=16 * 12,
                           capture=False)
    flat = {None: SimpleNamespace(is_flat=True)}
    graphs._plan = lambda batch, inp: flat

    def batch(cols):
        table = np.arange(1, 1 + 8 * cols, dtype=np.int32).reshape(8, cols)
        return SimpleNamespace(seqs=[None] * 8, input_ids=np.zeros(8, np.int64), positions=np.full(8, 16 * cols - 1),
                               slot_mapping=np.zeros(8, np.int64), block_tables=table,
                               seq_lens=np.full(8, 16 * cols, np.int32))
    for cols in (10, 5, 3):
        b = batch(cols)
        assert graphs.run(b) is None
        inp = graphs.inputs[8]
        want = np.zeros((8, inp.width), np.int32)
        want[:, :cols] = b.block_tables
        assert np.array_equal(inp.table.numpy(), want), cols
