"""The vLLM plug-in (integration/vllm) through the real vLLM 0.33 classes: registration by the
entry point, vLLM's own supports_* checks, and a step built the way vLLM's runner builds it
(``CommonAttentionMetadata`` -> builder -> real ``Attention`` layers -> KV update and forward),
checked against the independent fp64 dense reference for decode-only, prefill-only and mixed
batches, with and without shared prefixes, for every supported head size and block size.

vLLM is installed without its requirements (tests/install_vllm.sh); where it is missing these
tests skip with the reason, and CI (PAGED_BACKEND_REQUIRE_VLLM=1) fails instead.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # a CPU-only host has no device vLLM can infer
if os.environ.get("PAGED_BACKEND_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (CI: a missing vLLM is a failure, not a skip)
else:
    pytest.importorskip("vllm", reason="vLLM 0.33 is not installed: bash tests/install_vllm.sh (docs/vllm.md)")

from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.config.compilation import CUDAGraphMode  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.layers.attention import Attention  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

import paged_backend as pb  # noqa: E402
from paged_backend.cascade import CascadeCost  # noqa: E402
from paged_backend.integration.vllm.backend import PagedAttentionBackend  # noqa: E402
from paged_backend.integration.vllm.impl import PagedAttentionImpl  # noqa: E402
from paged_backend.kernels.checks import HEAD_DIMS  # noqa: E402
from tests.reference import TOL, prefill_reference, rel_err  # noqa: E402

pytestmark = pytest.mark.xdist_group("vllm")  # one worker imports vLLM (seconds), not both

HQ, HKV = 4, 2
BLOCK_SIZES = PagedAttentionBackend.get_supported_kernel_block_sizes()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture
def vllm_config():
    cfg = VllmConfig()
    with set_current_vllm_config(cfg):
        yield cfg


def make_layers(cfg, head_size: int, num_layers: int = 1, softcap=None, sinks=None, windows=None,
                kv_cache_dtype="auto") -> list[Attention]:
    """Real vLLM attention layers on our backend (they register in ``cfg``'s forward context);
    ``windows``: each layer's sliding window (None: full attention); ``kv_cache_dtype``: vLLM's."""
    extra = {} if sinks is None else {"sinks": sinks}
    windows = windows or [None] * num_layers
    return [Attention(HQ, head_size, 0.37 / head_size ** 0.5, num_kv_heads=HKV, prefix=f"model.layers.{i}.attn",
                      logits_soft_cap=softcap, attn_backend=PagedAttentionBackend, per_layer_sliding_window=w,
                      cache_config=CacheConfig(cache_dtype=kv_cache_dtype), **extra)
            for i, w in enumerate(windows)]


class Batch:
    """One step of a batch as vLLM's runner lays it out: decodes first, then prefill rows.

    Request ``i`` has ``seq_lens[i]`` tokens after the step, its last ``query_lens[i]`` new. Rows in
    ``share`` (lists of request indices) share their first ``shared_blocks`` blocks. The cache is
    vLLM's per-layer ``[NB, Hkv, BS, 2D]`` view in the ``layout`` vLLM allocates (``NHD``: LBNHC,
    vLLM's default; ``HND``: LBHNC), filled with NaN before the context is written, so a read of
    anything outside the requests shows. ``pad_tokens`` garbage tokens (slot -1) follow the real
    ones; with ``pad_attn`` the metadata counts them, as vLLM's runner does for a full CUDA graph
    (whose padding requests have no tokens and length 0). ``fp8``: an fp8 cache as vLLM allocates it
    (uint8), every K/V value rounded to that format first (so the reference sees what it holds) and
    stored divided by ``fp8_scale`` (a power of two: exact)."""

    def __init__(self, seq_lens, query_lens, block_size, head_size, dtype=torch.float32, device="cpu",
                 share=(), shared_blocks=0, layout="NHD", pad_tokens=0, pad_attn=False, seed=0, fp8=None,
                 fp8_scale=1.0, table=None, req_idx=None, is_prefilling=None):
        g = torch.Generator().manual_seed(seed)
        self.seq_lens, self.query_lens, self.bs, self.d = list(seq_lens), list(query_lens), block_size, head_size
        b = len(seq_lens)
        nblocks = [-(-s // block_size) for s in seq_lens]
        if table is None:
            owner = {i: grp[0] for grp in share for i in grp}  # a sharing row's prefix blocks are its group's first
            total = sum(nblocks) + 3
            ids = torch.randperm(total, generator=g).tolist()  # scattered pages
            table = torch.zeros(b, max(nblocks), dtype=torch.int32)
            for i in range(b):
                for j in range(nblocks[i]):
                    src = owner.get(i, i)
                    table[i, j] = table[src, j] if (src != i and j < shared_blocks) else ids.pop()
        else:  # the block ids given (rows in ``share`` must hold the same first ``shared_blocks``)
            table = torch.as_tensor(table, dtype=torch.int32)
            total = int(table.max()) + 4
        self.block_table, self.req_idx = table, req_idx
        self.is_prefilling = [q > 1 for q in query_lens] if is_prefilling is None else list(is_prefilling)
        physical = (total, block_size, HKV, 2 * head_size) if layout == "NHD" else (total, HKV, block_size, 2 * head_size)
        cache = torch.full(physical, float("nan"), dtype=fp8 or dtype)
        self.kv_cache = cache.transpose(1, 2) if layout == "NHD" else cache  # logical [NB, Hkv, BS, 2D]
        k_cache, v_cache = self.kv_cache.transpose(1, 2).split(head_size, dim=-1)
        # every token's K/V; the context (all but the new tokens) is written here, the new by the backend
        rounded = (lambda x: x.to(fp8).to(dtype)) if fp8 else (lambda x: x)
        self.k = [rounded(torch.randn(s, HKV, head_size, generator=g).to(dtype)) for s in seq_lens]
        self.v = [rounded(torch.randn(s, HKV, head_size, generator=g).to(dtype)) for s in seq_lens]
        for grp in share:
            for i in grp[1:]:
                n = min(shared_blocks * block_size, seq_lens[i])
                self.k[i][:n], self.v[i][:n] = self.k[grp[0]][:n], self.v[grp[0]][:n]
        slots, new_k, new_v = [], [], []
        for i, (s, q) in enumerate(zip(seq_lens, query_lens)):
            for p in range(s):
                blk, row = int(table[i, p // block_size]), p % block_size
                if p < s - q:
                    k_cache[blk, row], v_cache[blk, row] = self.k[i][p] / fp8_scale, self.v[i][p] / fp8_scale
                else:
                    slots.append(blk * block_size + row)
            new_k.append(self.k[i][s - q:])
            new_v.append(self.v[i][s - q:])
        t = sum(query_lens)
        self.num_tokens, self.num_padded = t, t + pad_tokens if pad_attn else t
        # vLLM may pad the step's tokens (CUDA graphs): padding rows hold garbage and slot -1
        pad = torch.full((pad_tokens, HKV, head_size), float("nan"), dtype=dtype)
        self.key = torch.cat(new_k + [pad])
        self.value = torch.cat(new_v + [pad])
        self.query = torch.randn(t + pad_tokens, HQ, head_size, generator=g).to(dtype)
        self.slot_mapping = torch.tensor(slots + [-1] * pad_tokens, dtype=torch.int64)
        qsl = torch.zeros(b + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
        self.query_start_loc = qsl
        if fp8:
            self.kv_cache = self.kv_cache.view(torch.uint8)  # vLLM's allocation of an fp8 cache
        self.fp8 = fp8
        for name in ("kv_cache", "block_table", "key", "value", "query", "slot_mapping"):
            setattr(self, name, getattr(self, name).to(device))
        self.device = device

    def common_metadata(self) -> CommonAttentionMetadata:
        """What vLLM 0.33's runner hands a builder (``_build_attention_metadata``)."""
        seq = torch.tensor(self.seq_lens, dtype=torch.int32)
        qsl, dev = self.query_start_loc, self.device
        return CommonAttentionMetadata(
            query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl, seq_lens=seq.to(dev), num_reqs=len(self.seq_lens),
            num_actual_tokens=self.num_padded, max_query_len=max(self.query_lens), max_seq_len=max(self.seq_lens),
            block_table_tensor=self.block_table, slot_mapping=self.slot_mapping, causal=True,
            seq_lens_cpu_upper_bound=seq,
            is_prefilling=torch.tensor(self.is_prefilling),  # (V2's: on the host, from its numpy array)
            positions=torch.arange(self.num_padded, device=dev),  # (unused by the backend)
            req_idx=None if self.req_idx is None else np.asarray(self.req_idx, dtype=np.int32))

    def reference(self, scale: float, softcap=None, sinks=None, window=None) -> torch.Tensor:
        """fp64 dense attention of the step's queries over each request's true K/V -> [T, Hq, D]."""
        k_dense = torch.zeros(len(self.seq_lens), max(self.seq_lens), HKV, self.d, dtype=torch.float64)
        v_dense = torch.zeros_like(k_dense)
        for i, s in enumerate(self.seq_lens):
            k_dense[i, :s], v_dense[i, :s] = self.k[i].double(), self.v[i].double()
        m = max(self.seq_lens)
        table = torch.arange(len(self.seq_lens) * m, dtype=torch.int32).view(-1, m)
        o, _ = prefill_reference(self.query[:self.num_tokens].cpu(), k_dense.view(-1, 1, HKV, self.d),
                                 v_dense.view(-1, 1, HKV, self.d), table, torch.tensor(self.seq_lens),
                                 self.query_start_loc, causal=True, scale=scale, softcap=softcap, sinks=sinks,
                                 window=window)
        return o

    def check_written(self):
        """The backend's KV update put the new tokens' K/V in their slots."""
        kv = self.kv_cache.view(self.fp8) if self.fp8 else self.kv_cache
        k_cache, v_cache = kv.transpose(1, 2).split(self.d, dim=-1)
        n = self.num_tokens
        sl = self.slot_mapping[:n].cpu()
        got_k = k_cache.cpu()[sl // self.bs, sl % self.bs].to(self.key.dtype)
        got_v = v_cache.cpu()[sl // self.bs, sl % self.bs].to(self.key.dtype)
        assert torch.equal(got_k, self.key[:n].cpu()) and torch.equal(got_v, self.value[:n].cpu())


def make_builder(cfg, layers, batch: Batch):
    """The plug-in's metadata builder for ``layers`` over ``batch``'s cache."""
    spec = FullAttentionSpec(block_size=batch.bs, num_kv_heads=HKV, head_size=batch.d, dtype=batch.kv_cache.dtype)
    return PagedAttentionBackend.get_builder_cls()(spec, [layer.layer_name for layer in layers], cfg,
                                                   torch.device(batch.device))


def run_step(cfg, layers, batch: Batch, builder=None):
    """Build the step's metadata once and run every layer through vLLM's forward context."""
    names = [layer.layer_name for layer in layers]
    if builder is None:
        builder = make_builder(cfg, layers, batch)
    md = builder.build(common_prefix_len=0, common_attn_metadata=batch.common_metadata())
    outs = []
    for layer in layers:
        layer.kv_cache = batch.kv_cache
        # on the CPU platform vLLM registers its attention ops for CPU tensors only; with CUDA tensors
        # take the layer's direct call (what a platform with non-opaque attention ops does)
        layer.use_direct_call = batch.device != "cpu"
    with set_forward_context({n: md for n in names}, cfg, slot_mapping={n: batch.slot_mapping for n in names}):
        for layer in layers:
            q = batch.query.reshape(batch.query.shape[0], -1)
            outs.append(layer(q, batch.key.reshape(q.shape[0], -1), batch.value.reshape(q.shape[0], -1)))
    return md, builder, [o.view(-1, HQ, batch.d) for o in outs]


def check(batch: Batch, layer, out, dtype=torch.float32):
    batch.check_written()
    ref = batch.reference(layer.impl.scale, layer.impl.softcap, layer.impl.sinks, layer.impl.window)
    assert torch.isfinite(out[:batch.num_tokens]).all()
    assert rel_err(out[:batch.num_tokens], ref) < TOL[dtype]


# (seq_lens, query_lens) in vLLM's order: decodes, then extends (chunked prefill), then fresh prompts
STEPS = {
    "decode": ([37, 5, 64, 1, 18], [1, 1, 1, 1, 1]),
    "prefill": ([20, 7, 33], [20, 7, 33]),
    "mixed": ([40, 9, 50, 30, 17], [1, 1, 1, 12, 17]),
}


@pytest.mark.parametrize("kind", list(STEPS))
@pytest.mark.parametrize("head_size", HEAD_DIMS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_step_matches_reference(vllm_config, kind, head_size, block_size):
    seq_lens, query_lens = STEPS[kind]
    batch = Batch(seq_lens, query_lens, block_size, head_size, layout=("NHD", "HND")[BLOCK_SIZES.index(block_size) % 2])
    layers = make_layers(vllm_config, head_size)
    md, _, (out,) = run_step(vllm_config, layers, batch)
    assert md.num_decodes == sum(q == 1 for q in query_lens)
    check(batch, layers[0], out)


@pytest.mark.kernel
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kind", list(STEPS))
def test_step_on_kernels(vllm_config, kind, layout, device):
    """The same steps on the Triton kernels (CI: the interpreter; tests/gpu: CUDA tensors)."""
    seq_lens, query_lens = STEPS[kind]
    for dtype in (torch.float32, torch.bfloat16):
        batch = Batch(seq_lens, query_lens, 16, 64, dtype=dtype, device=device, layout=layout, pad_tokens=3)
        layers = make_layers(vllm_config, 64)
        _, _, (out,) = run_step(vllm_config, layers, batch)
        check(batch, layers[0], out, dtype)
        vllm_config.compilation_config.static_forward_context.clear()


# 16 samples of one prompt (64 shared blocks: long enough for the cascade to pay on any device)
# decoding beside two unrelated requests, and the same with a prompt being prefilled in the step
SAMPLES = [64 * 16 + n for n in (5, 1, 9, 16, 3, 7, 2, 11, 4, 13, 6, 8, 1, 15, 10, 12)]
SHARED = {
    "decode": (SAMPLES + [40, 23], [1] * 18),
    "mixed": (SAMPLES + [40, 23], [1] * 16 + [6, 23]),
}


@pytest.mark.kernel
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(SHARED))
@pytest.mark.parametrize("cascade", [True, False])
def test_shared_prefix(vllm_config, monkeypatch, kind, cascade, device):
    """Decode rows that share leading blocks run as a cascade (vLLM finds no shared prefixes
    itself); PAGED_BACKEND_CASCADE=0 gives flat decode; both match the reference."""
    monkeypatch.setenv("PAGED_BACKEND_CASCADE", "1" if cascade else "0")
    seq_lens, query_lens = SHARED[kind]
    batch = Batch(seq_lens, query_lens, 16, 128, device=device, share=[list(range(16))], shared_blocks=64)
    layers = make_layers(vllm_config, 128)
    md, _, (out,) = run_step(vllm_config, layers, batch)
    assert isinstance(md.plans[None], pb.CascadePlan if cascade else pb.DecodePlan)
    check(batch, layers[0], out)


@pytest.mark.parametrize("device", DEVICES)
def test_cascade_forest_carries_over_steps(vllm_config, monkeypatch, device):
    """Decode steps of the same 16 samples plan from the last step's forest (found once); a step
    whose rows no longer hold its node's blocks (other requests in their places) is planned anew;
    every step matches the reference."""
    monkeypatch.setenv("PAGED_BACKEND_CASCADE", "1")
    layers = make_layers(vllm_config, 128)
    builder = None
    steps = [([list(range(16))], 0), ([list(range(16))], 0), ([list(range(16))], 0),
             ([list(range(8)), list(range(8, 16))], 5)]  # (sharing groups, seed of the block ids)
    for t, (share, seed) in enumerate(steps):
        batch = Batch([n + t for n in SAMPLES], [1] * 16, 16, 128, device=device, share=share, shared_blocks=64,
                      seed=seed)
        md, builder, (out,) = run_step(vllm_config, layers, batch, builder)
        plan = md.plans[None]
        assert isinstance(plan, pb.CascadePlan) and not plan.is_flat
        assert builder.planner.reused == (0, 1, 2, 2)[t]
        assert np.diff(plan.node_ptr).tolist() == ([16] if t < 3 else [8, 8])
        check(batch, layers[0], out)


def slot_steps():
    """Steps of Model Runner V2 (rows named by request slots, ``req_idx``): 16 samples of a 64-block
    prompt in slots 0-15 and two other requests in slots 20 and 21 decode; some samples cross into a
    block of their own at step 1; at step 2 the rows come reordered and the samples of slots 5 and 9
    have finished; at step 3 two new requests take their slots beside the decodes: in slot 5 one with
    the same prompt (vLLM's prefix cache gives it the prompt's blocks) that prefills 5 tokens, in slot
    9 one with a prompt of its own that is all cached but its last token (a one-token row still
    prefilling: vLLM computes that token again); at step 4 both decode, the first with a private
    block whose id the finished sample's was. -> [(seq_lens, query_lens, slots, table rows,
    is_prefilling)]."""
    bs, shared, rng = 16, 64, np.random.default_rng(3)
    ids = iter((1 + rng.permutation(4000)).tolist())  # (block 0: vLLM's null block)
    prompt = [next(ids) for _ in range(shared)]
    lens = {s: shared * bs + n for s, n in enumerate([15, 16, 9, 14, 16, 3, 15, 16, 1, 2, 16, 4, 15, 16, 7, 8])}
    lens.update({20: 40, 21: 23})
    rows = {s: (prompt if s < 16 else []) + [next(ids) for _ in range(-(-lens[s] // bs) - (shared if s < 16 else 0))]
            for s in lens}
    steps, order = [], list(lens)
    for t in range(5):
        if t:
            for s in order:
                lens[s] += 1
                if -(-lens[s] // bs) > len(rows[s]):
                    rows[s].append(next(ids))
        if t == 2:
            order = [s for s in rng.permutation(order).tolist() if s not in (5, 9)]
        query = [1] * len(order)
        prefilling = [False] * len(order)
        if t == 3:  # the new requests: slot 9's decodes-like (one token) first, slot 5's prefill last
            lens[5], rows[5] = shared * bs + 5, prompt + [rows[5][-1]]
            lens[9], rows[9] = shared * bs + 3, [next(ids) for _ in range(shared + 1)]
            order, query, prefilling = [9] + order + [5], [1] + query + [5], [True] + prefilling + [True]
        if t == 4:
            order = [5] + order[:-1]
            query, prefilling = [1] * len(order), [False] * len(order)
        width = max(len(rows[s]) for s in order)
        table = np.zeros((len(order), width), dtype=np.int32)
        for i, s in enumerate(order):
            table[i, :len(rows[s])] = rows[s]
        steps.append(([lens[s] for s in order], query, order, table, prefilling))
    return steps


@pytest.mark.kernel
@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_cascade_from_request_slots_without_sync(vllm_config, monkeypatch, device, debug):
    """With the rows' request slots (Model Runner V2's ``req_idx``) the cascade plans take the block
    tables of the steps before (integration/vllm/host_tables.py), never a copy from the device: the
    first step plans flat (nothing held yet), later ones cascade over the prompt's 64 blocks with the
    forest carried by slot through a reorder and finished requests; a request new in a slot joins
    once its prefill step ran, and one whose first step is a single token still prefilling (its prompt
    cached) shares nothing in that step - its slot's row then is the finished sample's, which shared
    the prompt - nor after (its prompt is its own); every step matches the reference. A dummy batch
    after step 1 (as an idle data-parallel rank runs: slots 0 and 1, 65 null blocks each) leaves those
    slots sharing nothing - not block 0 with each other - until their next step's table arrives (step
    2's plan has them not; step 3's, found anew for slot 9's new row, has them)."""
    from paged_backend.integration.vllm import builder as B
    monkeypatch.setenv("PAGED_BACKEND_CASCADE", "1")
    monkeypatch.setenv("PAGED_BACKEND_DEBUG", "1" if debug else "0")  # (the held blocks checked on the device's)
    monkeypatch.setattr(B, "_table_from_device", lambda table: pytest.fail("the table was copied from the device"))
    layers = make_layers(vllm_config, 128)
    builder = None
    for t, (seq_lens, query_lens, slots, table, prefilling) in enumerate(slot_steps()):
        share = [[i for i, s in enumerate(slots) if (s < 16 and s != 9) or (s == 9 and t < 3)]]
        batch = Batch(seq_lens, query_lens, 16, 128, device=device, share=share, shared_blocks=64, table=table,
                      req_idx=slots, is_prefilling=prefilling, seed=t)
        md, builder, (out,) = run_step(vllm_config, layers, batch, builder)
        plan = md.plans[None]
        if t == 0:
            assert isinstance(plan, pb.DecodePlan)
        else:
            assert isinstance(plan, pb.CascadePlan) and not plan.is_flat
            members = sorted(np.asarray(slots)[plan.node_members].tolist())
            assert members == sorted(s for s in slots[:plan.batch_size]
                                     if s < 16 and (t < 3 or s != 9) and (t != 2 or s > 1)), t
            assert plan.node_end.tolist() == [64 * 16]
        check(batch, layers[0], out)
        if t == 1:  # the dummy batch (its output is dropped, as vLLM drops it)
            dummy = Batch([64 * 16 + 1] * 2, [1, 1], 16, 128, device=device, table=np.zeros((2, 65)), req_idx=[0, 1])
            run_step(vllm_config, layers, dummy, builder)
    assert builder.planner.reused == 1  # the dummy's (step 1's forest on its rows; 2: after a dummy; 3, 4: new rows)


@pytest.mark.parametrize("why", ["micro-batches", "kv connector"])
def test_no_slot_tables_where_a_request_may_prefill_unseen(vllm_config, monkeypatch, why):
    """With vLLM's micro-batching (a builder per micro-batch, each seeing some requests) or a KV
    connector (a prompt prefilled on another instance) the request slots are not used: a step copies
    its table from the device, as without them."""
    from vllm.config import KVTransferConfig
    from paged_backend.integration.vllm import builder as B
    monkeypatch.setenv("PAGED_BACKEND_CASCADE", "1")
    if why == "micro-batches":
        monkeypatch.setattr(vllm_config.parallel_config, "enable_dbo", True)  # (use_ubatching follows)
    else:
        monkeypatch.setattr(vllm_config, "kv_transfer_config", KVTransferConfig(kv_connector="NixlConnector",
                                                                                kv_role="kv_both"))
    copied = []
    monkeypatch.setattr(B, "_table_from_device", lambda table: copied.append(1) or table.cpu().numpy())
    layers = make_layers(vllm_config, 128)
    for seq_lens, query_lens, slots, table, _ in slot_steps()[:2]:
        md, builder, (out,) = run_step(vllm_config, layers, Batch(seq_lens, query_lens, 16, 128, share=[list(range(16))],
                                                                  shared_blocks=64, table=table, req_idx=slots))
        assert builder.host_tables is None and isinstance(md.plans[None], pb.CascadePlan)
    assert len(copied) == 2


def test_slot_rows_rewritten_without_a_prefill_raise_under_debug(vllm_config, monkeypatch):
    """PAGED_BACKEND_DEBUG=1 checks the host copy against the device table: a slot whose blocks changed
    without a step between (what vLLM never does) raises naming the slot."""
    monkeypatch.setenv("PAGED_BACKEND_CASCADE", "1")
    monkeypatch.setenv("PAGED_BACKEND_DEBUG", "1")
    layers = make_layers(vllm_config, 128)
    (seq_lens, query_lens, slots, table, _), *_ = slot_steps()
    md, builder, _ = run_step(vllm_config, layers, Batch(seq_lens, query_lens, 16, 128, share=[list(range(16))],
                                                         shared_blocks=64, table=table, req_idx=slots))
    table = table.copy()
    table[3, 10] += 5000  # (slot 3's eleventh block, another id)
    with pytest.raises(RuntimeError, match="request slot 3"):
        run_step(vllm_config, layers, Batch(seq_lens, query_lens, 16, 128, table=table, req_idx=slots), builder)


@pytest.mark.kernel
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["mixed", "shared"])
@pytest.mark.parametrize("feature", ["softcap", "sinks"])
def test_logit_features(vllm_config, kind, device, feature):
    """A layer with ``logits_soft_cap`` (Gemma 2) or ``sinks`` (gpt-oss, bf16 as its parameter is)
    has it on every path: decode, cascade, prefill."""
    seq_lens, query_lens = SHARED["mixed"] if kind == "shared" else STEPS["mixed"]
    share = dict(share=[list(range(16))], shared_blocks=64) if kind == "shared" else {}
    batch = Batch(seq_lens, query_lens, 16, 128, device=device, **share)
    batch.query *= 8  # large scores: the cap matters
    if feature == "softcap":
        layers = make_layers(vllm_config, 128, softcap=2.0)
    else:
        layers = make_layers(vllm_config, 128, sinks=torch.linspace(0.0, 30.0, HQ, dtype=torch.bfloat16, device=device))
    md, _, (out,) = run_step(vllm_config, layers, batch)
    assert kind != "shared" or isinstance(md.plans[None], pb.CascadePlan)
    check(batch, layers[0], out)
    assert rel_err(out[:batch.num_tokens], batch.reference(layers[0].impl.scale)) > 0.05  # featured != plain


@pytest.mark.kernel
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["mixed", "shared"])
def test_sliding_windows(vllm_config, monkeypatch, kind, device):
    """Layers of windows 24 and 1000 beside a full-attention layer (Gemma 2 / gpt-oss alternate
    them) in one builder: a plan per window, each layer exact on decode, cascade and prefill rows."""
    monkeypatch.setenv("PAGED_BACKEND_CASCADE", "1")
    seq_lens, query_lens = SHARED["mixed"] if kind == "shared" else STEPS["mixed"]
    share = dict(share=[list(range(16))], shared_blocks=64) if kind == "shared" else {}
    batch = Batch(seq_lens, query_lens, 16, 128, device=device, **share)
    layers = make_layers(vllm_config, 128, windows=[None, 24, 1000])
    md, builder, outs = run_step(vllm_config, layers, batch)
    assert builder.plans_made == 1 and set(md.plans) == {None, 24, 1000}
    if kind == "shared":  # 24-token windows (from 1001 on) reach the last two shared blocks: the node is trimmed
        assert isinstance(md.plans[None], pb.CascadePlan) and isinstance(md.plans[1000], pb.CascadePlan)
        assert [(t0, t1) for _, t0, t1 in md.plans[24].nodes()] == [(62 * 16, 64 * 16)]
    for layer, out in zip(layers, outs):
        check(batch, layer, out)
    assert rel_err(outs[1][:batch.num_tokens], batch.reference(layers[1].impl.scale)) > 0.05  # the window cuts


@pytest.mark.kernel
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slots", [False, True])
def test_sliding_window_tables_with_null_entries(vllm_config, monkeypatch, device, slots):
    """Model Runner V2 gives a sliding-window group tables whose entries wholly below each row's window
    are its null block (block 0, here a block of other keys). 16 samples of a 62-block prompt, window
    24: at step 1 the first 8 samples' windows have moved from block 61 to 62 (their block 61 is null
    now), the last 8's are still in block 61. Both steps are exact, with the table copied from the
    device or the rows taken by request slot from the step before (which then share nothing: a row's
    leading entries are null, and a row is held only up to its first null block)."""
    monkeypatch.setenv("PAGED_BACKEND_CASCADE", "1")
    layers = make_layers(vllm_config, 128, windows=[24])
    builder = None
    for t in range(2):
        lens = [62 * 16 + 23 + t] * 8 + [62 * 16 + 8 + t] * 8  # windows from 991 / 976 (block 61), then 992 / 977
        table = np.concatenate([np.tile(np.arange(1, 63), (16, 1)), 100 + np.arange(32).reshape(16, 2)], axis=1)
        batch = Batch(lens, [1] * 16, 16, 128, device=device, share=[list(range(16))], shared_blocks=62,
                      table=table, req_idx=list(range(16)) if slots else None, seed=t)
        below = (np.array(lens) - 24) // 16  # [16] blocks wholly below each window
        nulled = batch.block_table.cpu()
        nulled[torch.from_numpy(np.arange(table.shape[1])[None, :] < below[:, None])] = 0
        batch.block_table = nulled.to(device)
        md, builder, (out,) = run_step(vllm_config, layers, batch, builder)
        if slots:
            assert isinstance(md.plans[24], pb.DecodePlan)
        check(batch, layers[0], out)


@pytest.mark.kernel
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["mixed", "shared"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_kv_cache(vllm_config, monkeypatch, kind, kv_cache_dtype, device):
    """vLLM's fp8 caches (uint8 buffers, the layer's _k_scale/_v_scale): the KV update quantizes,
    decode, cascade and prefill rows dequantize; bf16 queries (fp16 in the interpreter)."""
    monkeypatch.setenv("PAGED_BACKEND_CASCADE", "1")
    assert PagedAttentionBackend.supports_kv_cache_dtype(kv_cache_dtype)
    fp8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
    seq_lens, query_lens = SHARED["mixed"] if kind == "shared" else STEPS["mixed"]
    share = dict(share=[list(range(16))], shared_blocks=64) if kind == "shared" else {}
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    batch = Batch(seq_lens, query_lens, 16, 128, dtype=dtype, device=device, fp8=fp8, fp8_scale=0.5, **share)
    layers = make_layers(vllm_config, 128, kv_cache_dtype=kv_cache_dtype)
    for layer in layers:  # a scale of 0.5: stored values are twice the real ones, dequantized back exactly
        layer._k_scale.fill_(0.5)
        layer._v_scale.fill_(0.5)
        layer.to(device)
    builder = make_builder(vllm_config, layers, batch)
    assert builder.cascade_cost.kv_elem_bytes == 1  # the cost model counts the fp8 cache's bytes
    builder.cascade_cost = CascadeCost(0, 0, 0, kv_elem_bytes=1)  # keep the prefix (it saves < 8 MB in fp8)
    md, _, (out,) = run_step(vllm_config, layers, batch, builder)
    assert kind != "shared" or isinstance(md.plans[None], pb.CascadePlan)
    kv = batch.kv_cache.view(fp8).transpose(1, 2)
    sl = batch.slot_mapping[:batch.num_tokens].cpu()
    stored = kv.cpu()[sl // 16, sl % 16][..., :128].to(dtype)
    assert torch.equal(stored * 0.5, batch.key[:batch.num_tokens].cpu())  # quantized with the layer's scale
    ref = batch.reference(layers[0].impl.scale)
    assert rel_err(out[:batch.num_tokens], ref) < TOL[dtype]


def test_plan_once_per_step(vllm_config):
    """Four layers share one plan per step; a second step of the same size refills the first's."""
    layers = make_layers(vllm_config, 64, num_layers=4)
    first = Batch([30, 12, 7], [1, 1, 1], 16, 64, seed=1)
    md1, builder, outs = run_step(vllm_config, layers, first)
    assert builder.plans_made == 1
    for layer, out in zip(layers, outs):
        check(first, layer, out)
    second = Batch([31, 40, 2], [1, 1, 1], 16, 64, seed=2)
    md2, _, outs = run_step(vllm_config, layers, second, builder)
    assert builder.plans_made == 2 and md2.plans[None] is md1.plans[None]  # same device buffers (graph replays read them)
    for layer, out in zip(layers, outs):
        check(second, layer, out)


def test_full_decode_graphs_take_flat_plans(vllm_config, monkeypatch):
    """Where vLLM may replay a full decode graph, decode-only batches get the batch size's graph-safe
    DecodePlan even when rows share a prefix; padded requests (length 0, as vLLM pads a graph's
    batch) give zeros. Mixed batches and batches past the captured sizes still cascade."""
    monkeypatch.setenv("PAGED_BACKEND_CASCADE", "1")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # (Model Runner V1: no request slots)
    comp = vllm_config.compilation_config
    comp.cudagraph_mode, comp.max_cudagraph_capture_size = CUDAGraphMode.FULL_DECODE_ONLY, 32
    assert PagedAttentionBackend.get_builder_cls().get_cudagraph_support(vllm_config, None) == \
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    layers = make_layers(vllm_config, 128)
    batch = Batch(SAMPLES + [0, 0], [1] * 16 + [0, 0], 16, 128, share=[list(range(16))], shared_blocks=64,
                  pad_tokens=2, pad_attn=True)
    md, builder, (out,) = run_step(vllm_config, layers, batch)
    assert isinstance(md.plans[None], pb.DecodePlan) and md.num_decodes == 18
    assert torch.equal(out[16:18], torch.zeros_like(out[16:18]))
    check(batch, layers[0], out)
    mixed = Batch(SAMPLES + [20], [1] * 16 + [20], 16, 128, share=[list(range(16))], shared_blocks=64)
    md, _, (out,) = run_step(vllm_config, layers, mixed, builder)
    assert isinstance(md.plans[None], pb.CascadePlan)
    check(mixed, layers[0], out)


GRAPH_ROWS = 24  # the padded batch size of the graph-cascade tests (vLLM pads decode batches to its sizes)


def graph_slot_steps():
    """``slot_steps()`` as vLLM runs them with full decode graphs of 24 rows: each decode-only step
    padded with requests of length 0 (no slot, no token) -> [(Batch kwargs, graphable)]."""
    out = []
    for t, (seq_lens, query_lens, slots, table, prefilling) in enumerate(slot_steps()):
        graphable = max(query_lens) == 1
        pad = GRAPH_ROWS - len(seq_lens) if graphable else 0
        share = [[i for i, s in enumerate(slots) if (s < 16 and s != 9) or (s == 9 and t < 3)]]
        out.append((dict(seq_lens=list(seq_lens) + [0] * pad, query_lens=list(query_lens) + [0] * pad,
                         table=np.pad(table, ((0, pad), (0, 0))), req_idx=slots, is_prefilling=prefilling,
                         share=share, shared_blocks=64, seed=t, pad_tokens=pad, pad_attn=True), graphable))
    return out


def graph_builder(vllm_config, monkeypatch, layers, device, dtype):
    """A builder as vLLM makes it with full decode graphs of up to 32 rows under Model Runner V2."""
    monkeypatch.setenv("PAGED_BACKEND_CASCADE", "1")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    comp = vllm_config.compilation_config
    comp.cudagraph_mode, comp.max_cudagraph_capture_size = CUDAGraphMode.FULL_DECODE_ONLY, 32
    spec = FullAttentionSpec(block_size=16, num_kv_heads=HKV, head_size=128, dtype=dtype)
    builder = PagedAttentionBackend.get_builder_cls()(spec, [layer.layer_name for layer in layers], vllm_config,
                                                       torch.device(device))
    assert builder.graph_cascade
    return builder


def capture_batch(device, dtype=torch.float32, slots: bool = False) -> Batch:
    """A capture run for a graph of ``GRAPH_ROWS`` rows: one token a row, no request slots, or with
    ``slots`` slots 0.. as Model Runner V2's capture names them (their host rows hold nothing yet)."""
    return Batch([1] * GRAPH_ROWS, [1] * GRAPH_ROWS, 16, 128, dtype=dtype, device=device, seed=9,
                 req_idx=list(range(GRAPH_ROWS)) if slots else None)


def captured(step, md):
    """``step(md)`` warmed up on a side stream (kernels compiled off the capture), then captured in a
    CUDA graph -> (graph, the output tensor its replays write)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(md)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(md)
    return graph, out


@pytest.mark.kernel
@pytest.mark.parametrize("windows", [(None,), (None, 24, 1000)])
def test_full_decode_graphs_cascade_in_a_fixed_arena(vllm_config, monkeypatch, windows):
    """With full decode graphs under Model Runner V2, decode-only batches of a captured size are planned
    into the builder's fixed arena: the capture's batch (no slots) as tails only (carried over from a
    step that shared nothing to the next, as a forest is), then Model Runner V2's steps (request slots,
    padding rows of length 0) with the prompt's 64 blocks as a node once the host tables hold them - all
    with the capture's launch key, so its graph replays them (the GPU test replays them). The mixed step
    between runs eagerly. With sliding-window layers beside full attention (Gemma 2) each window has
    its fixed arena and key; a 24-token window reaches the prompt's last two blocks (its node trimmed to
    them). Every layer of every step matches the reference; padding rows give zeros."""
    layers = make_layers(vllm_config, 128, windows=list(windows))
    builder = graph_builder(vllm_config, monkeypatch, layers, "cpu", torch.float32)
    md, _, _ = run_step(vllm_config, layers, capture_batch("cpu"), builder)
    captured = md.plans
    for w, plan in captured.items():
        assert isinstance(plan, pb.CascadePlan) and plan.launch_all and plan.num_nodes == 0, w
    md, _, _ = run_step(vllm_config, layers, capture_batch("cpu"), builder)  # (again: carried over)
    assert builder.planner.reused == 1 and all(md.plans[w].launch_key() == captured[w].launch_key() for w in windows)
    md, _, _ = run_step(vllm_config, layers, capture_batch("cpu", slots=True), builder)  # (Model Runner V2's)
    assert all(md.plans[w].num_nodes == 0 and md.plans[w].launch_key() == captured[w].launch_key() for w in windows)
    for t, (kw, graphable) in enumerate(graph_slot_steps()):
        batch = Batch(block_size=16, head_size=128, **kw)
        md, _, outs = run_step(vllm_config, layers, batch, builder)
        for w, plan in md.plans.items():
            assert isinstance(plan, pb.CascadePlan) and plan.launch_all == graphable, (t, w)
            if graphable:
                assert plan.launch_key() == captured[w].launch_key() and plan.arena is captured[w].arena, (t, w)
                assert plan.num_nodes == (0 if t == 0 else 1), (t, w)  # (step 0: the host tables hold nothing yet)
                if w == 24 and t:
                    assert [(a, b) for _, a, b in plan.nodes()] == [(62 * 16, 64 * 16)]
        for layer, out in zip(layers, outs):
            if graphable:
                assert not out[len(kw["req_idx"]):].any()
            check(batch, layer, out)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # Model Runner V1 names no slots: flat plans
    v1 = make_builder(vllm_config, layers, capture_batch("cpu"))
    assert not v1.graph_cascade
    md, _, _ = run_step(vllm_config, layers, capture_batch("cpu"), v1)
    assert all(isinstance(p, pb.DecodePlan) for p in md.plans.values())


@pytest.mark.gpu
def test_full_decode_graph_replays_cascade_steps(vllm_config, monkeypatch):
    """The fixed arena as vLLM uses it: one CUDA graph of 24 rows captured with the capture batch (tails
    only) replays Model Runner V2's decode steps - nothing shared yet, then the prompt as a node, with a
    reorder, finished requests and new ones - after each step's inputs are copied into the graph's
    buffers and ``build`` planned it (the mixed step between runs eagerly, as vLLM runs it)."""
    dt, dev = torch.bfloat16, "cuda"
    layers = make_layers(vllm_config, 128, num_layers=2)
    builder = graph_builder(vllm_config, monkeypatch, layers, dev, dt)
    steps = [(Batch(block_size=16, head_size=128, dtype=dt, device=dev, **kw), g) for kw, g in graph_slot_steps()]
    cap = capture_batch(dev, dt)
    # the runner's fixed buffers, as wide and long as any step needs
    nb = max(b.kv_cache.shape[0] for b, _ in steps)
    width = max(b.block_table.shape[1] for b, _ in steps)
    kv = torch.zeros((nb, *cap.kv_cache.shape[1:]), dtype=dt, device=dev)
    table = torch.zeros(GRAPH_ROWS, width, dtype=torch.int32, device=dev)
    seq_lens = torch.ones(GRAPH_ROWS, dtype=torch.int32, device=dev)
    query, key, value, slot_mapping = cap.query.clone(), cap.key.clone(), cap.value.clone(), cap.slot_mapping.clone()
    names = [layer.layer_name for layer in layers]
    for layer in layers:
        layer.kv_cache, layer.use_direct_call = kv, True

    def forward(md):
        with set_forward_context({n: md for n in names}, vllm_config, slot_mapping={n: slot_mapping for n in names}):
            for layer in layers:
                out = layer(query.reshape(GRAPH_ROWS, -1), key.reshape(GRAPH_ROWS, -1), value.reshape(GRAPH_ROWS, -1))
        return out.view(GRAPH_ROWS, HQ, 128)

    def common(batch):
        return batch.common_metadata().replace(seq_lens=seq_lens, block_table_tensor=table, slot_mapping=slot_mapping)

    graph, out = captured(forward, builder.build(0, common(cap)))
    nodes = []
    for batch, graphable in steps:
        kv[:batch.kv_cache.shape[0]] = batch.kv_cache
        table.zero_()
        table[:batch.block_table.shape[0], :batch.block_table.shape[1]] = batch.block_table
        if not graphable:  # (vLLM runs a mixed batch eagerly, on its own metadata)
            batch.kv_cache = kv[:batch.kv_cache.shape[0]]
            md, _, outs = run_step(vllm_config, layers, batch, builder)
            check(batch, layers[-1], outs[-1], dt)
            continue
        seq_lens.copy_(torch.tensor(batch.seq_lens, dtype=torch.int32))
        for name, buf in (("query", query), ("key", key), ("value", value), ("slot_mapping", slot_mapping)):
            buf.copy_(getattr(batch, name))
        md = builder.build(0, common(batch))
        nodes.append(md.plans[None].num_nodes)
        graph.replay()
        torch.cuda.synchronize()
        batch.kv_cache = kv[:batch.kv_cache.shape[0]]  # (the buffers the replay wrote)
        check(batch, layers[-1], out, dt)
        assert not out[len(batch.req_idx):].any()
    assert nodes == [0, 1, 1, 1]


@pytest.mark.gpu
def test_decode_step_replays_in_cuda_graph(vllm_config, monkeypatch):
    """The declared UNIFORM_SINGLE_TOKEN_DECODE support, as vLLM uses it with Model Runner V1 (flat
    plans): a decode step captured in a CUDA graph from fixed buffers replays a later step of the same
    batch size after its inputs are copied into those buffers and ``build`` has refilled the same plan."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    comp = vllm_config.compilation_config
    comp.cudagraph_mode, comp.max_cudagraph_capture_size = CUDAGraphMode.FULL_DECODE_ONLY, 32
    layers = make_layers(vllm_config, 128, num_layers=2)
    # same shapes (lengths permuted: same block count and table width), other values
    first = Batch([37, 5, 64, 1, 18], [1] * 5, 16, 128, dtype=torch.bfloat16, device="cuda", seed=1)
    second = Batch([64, 18, 5, 37, 1], [1] * 5, 16, 128, dtype=torch.bfloat16, device="cuda", seed=2)
    seq_lens = torch.tensor(first.seq_lens, dtype=torch.int32, device="cuda")  # the runner's fixed buffer
    spec = FullAttentionSpec(block_size=16, num_kv_heads=HKV, head_size=128, dtype=torch.bfloat16)
    names = [layer.layer_name for layer in layers]
    builder = PagedAttentionBackend.get_builder_cls()(spec, names, vllm_config, torch.device("cuda"))
    for layer in layers:
        layer.kv_cache, layer.use_direct_call = first.kv_cache, True

    def step(md):
        with set_forward_context({n: md for n in names}, vllm_config, slot_mapping={n: first.slot_mapping for n in names}):
            x = first.query.reshape(5, -1)
            for layer in layers:
                out = layer(x, first.key.reshape(5, -1), first.value.reshape(5, -1))
        return out

    md = builder.build(0, first.common_metadata().replace(seq_lens=seq_lens))
    graph, out = captured(step, md)
    graph.replay()
    check(first, layers[-1], out.view(5, HQ, 128), torch.bfloat16)
    for name in ("kv_cache", "block_table", "key", "value", "query", "slot_mapping"):
        getattr(first, name).copy_(getattr(second, name))
    seq_lens.copy_(torch.tensor(second.seq_lens, dtype=torch.int32))
    md2 = builder.build(0, second.common_metadata().replace(
        seq_lens=seq_lens, block_table_tensor=first.block_table, slot_mapping=first.slot_mapping))
    assert md2.plans[None] is md.plans[None]  # the captured buffers, refilled
    graph.replay()
    torch.cuda.synchronize()
    second.kv_cache = first.kv_cache  # (the buffers the replay wrote)
    check(second, layers[-1], out.view(5, HQ, 128), torch.bfloat16)


def test_entry_point_registers_custom_backend():
    """vLLM's plug-in loader runs our entry point: ``--attention-backend CUSTOM`` resolves to us."""
    from importlib.metadata import entry_points

    from vllm.config import AttentionConfig
    from vllm.plugins import load_general_plugins
    assert any(ep.value == "paged_backend.integration.vllm:register"
               for ep in entry_points(group="vllm.general_plugins"))
    load_general_plugins()
    assert AttentionBackendEnum.CUSTOM.get_class() is PagedAttentionBackend
    assert AttentionConfig(backend="custom").backend == AttentionBackendEnum.CUSTOM
    assert PagedAttentionBackend.get_name() == "CUSTOM"


def test_attention_layer_selects_backend(vllm_config):
    layer = make_layers(vllm_config, 128)[0]
    assert layer.backend == AttentionBackendEnum.CUSTOM and isinstance(layer.impl, PagedAttentionImpl)


def _reasons(**changes) -> list[str]:
    """What vLLM's CUDA platform asks a selected backend (``validate_configuration``)."""
    cfg = AttentionSelectorConfig(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16)
    cap = changes.pop("device_capability", DeviceCapability(9, 0))
    return PagedAttentionBackend.validate_configuration(device_capability=cap, **cfg._replace(**changes)._asdict())


def test_supported_configurations():
    for head_size in HEAD_DIMS:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for block_size in (None, *BLOCK_SIZES, 48, 528):  # 528 = 33 kernel blocks of 16
                assert _reasons(head_size=head_size, dtype=dtype, block_size=block_size) == []
    assert _reasons(device_capability=DeviceCapability(8, 0)) == []
    assert _reasons(has_sink=True) == []  # gpt-oss's sinks
    assert _reasons(has_sliding_window=True) == []  # Mistral, Gemma 2/3, gpt-oss windows


@pytest.mark.parametrize("change, words", [
    (dict(head_size=32), "head_size"),
    (dict(use_mla=True), "MLA"),
    (dict(use_sparse=True), "sparse"),
    (dict(use_non_causal=True), "non-causal"),
    (dict(use_batch_invariant=True), "batch invariance"),
    (dict(attn_type=AttentionType.ENCODER_ONLY), "attention type"),
    (dict(use_dcp=True), "DCP"),
    (dict(use_adaptive_verification=True), "query lens mismatch"),
    (dict(use_pcp=True), "PCP"),
    (dict(use_mm_prefix=True), "multimodal"),
    (dict(use_per_head_quant_scales=True), "per-head quant"),
    (dict(device_capability=DeviceCapability(7, 5)), "compute capability"),
])
def test_unsupported_configurations_refused(change, words):
    reasons = _reasons(**change)
    assert reasons and words.lower() in " ".join(reasons).lower(), reasons


@pytest.mark.parametrize("kwargs, words", [
    (dict(alibi_slopes=[0.5, 0.25, 0.125, 0.0625]), "ALiBi"),
    (dict(kv_cache_dtype="int8_per_token_head"), "int8_per_token_head"),
    (dict(attn_type=AttentionType.ENCODER_DECODER), "attention type"),
])
def test_impl_refuses_features(kwargs, words):
    """Direct use of the impl (vLLM's checks come first) refuses what it cannot run, by name."""
    with pytest.raises(NotImplementedError, match=words):
        PagedAttentionImpl(HQ, 128, 128 ** -0.5, HKV, **kwargs)
