"""The engine on tiny randomly initialised models of each supported family (built offline): greedy
tokens equal transformers' own generate() with SDPA on the same weights, for a batch of prompts of
different lengths, forked samples and prefix-cache hits; models needing features the backend
lacks are refused at load time with the feature named."""
import copy
import itertools

import numpy as np
import pytest
import torch

import transformers

from paged_backend.cascade import CascadeCost
from paged_backend.kernels.dispatch import INTERPRET
from paged_backend.integration import LLM, SamplingParams

pytestmark = pytest.mark.xdist_group("engine")

SMALL = dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=512, eos_token_id=None, bos_token_id=None)
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "smollm": lambda: transformers.LlamaConfig(**dict(SMALL, num_attention_heads=6, num_key_value_heads=2,
                                                     hidden_size=384, tie_word_embeddings=True)),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL),
    # logit soft-capping on every layer; its sliding layers' window covers max_model_len (512)
    "gemma2": lambda: transformers.Gemma2Config(**dict(SMALL, sliding_window=512), attn_logit_softcapping=5.0),
}
PROMPTS = [[5, 17, 3], list(range(40, 77)), [9] * 16, list(range(100, 133))]  # lengths around the block size


def tiny(family, seed: int = 0, **overrides):
    """A tiny model of a family in FAMILIES, or of a config."""
    torch.manual_seed(seed)
    cfg = FAMILIES[family]() if isinstance(family, str) else family
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def hf_greedy(model, prompt, n):
    """transformers' generate with SDPA (eager where SDPA cannot soft-cap or add sinks) on a copy of
    the weights (the reference)."""
    ref = copy.deepcopy(model)
    eager = getattr(model.config, "attn_logit_softcapping", None) or model.config.model_type == "gpt_oss"
    ref.set_attn_implementation("eager" if eager else "sdpa")
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                       attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_equals_transformers_generate(family):
    model = tiny(family)
    want = [hf_greedy(model, p, 12) for p in PROMPTS]
    llm = LLM(model, device="cpu", block_size=16, num_blocks=64)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    # again: full prompt blocks now come from the prefix cache; n = 3 forks each prompt
    outs = llm.generate(prompts, SamplingParams(n=3, temperature=0, max_tokens=12), use_tqdm=False)
    assert llm.last_stats.cached_prompt_tokens >= 16 * 4
    for o, w in zip(outs, want):
        assert [c.token_ids for c in o.outputs] == [w] * 3


@pytest.mark.kernel  # the TRITON_INTERPRET=1 pass runs the engine on the Triton kernels, as on a GPU
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_engine_on_every_attention_path(device):
    """Prefill, flat decode and cascade decode (every shared block a node), greedy == generate()
    (fp32: the same tokens on the CPU paths and the GPU)."""
    model = tiny("qwen3")
    want = [hf_greedy(model, p, 6) for p in PROMPTS]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for cascade in (False, CascadeCost(0, 0, 0)):
        llm = LLM(model, device=device, dtype="float32", num_blocks=64, cascade=cascade)
        outs = llm.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=6), use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in outs] == [[w, w] for w in want]
        assert (llm.last_stats.cascade_steps > 0) == bool(cascade)


def test_chunked_prefill_steps_that_sample_nothing():
    """Prompts longer than a step's token budget run in chunks; steps of chunks alone draw no token."""
    model = tiny("qwen2", seed=2)
    long = list(range(3, 103))
    want = hf_greedy(model, long, 8)
    llm = LLM(model, device="cpu", num_blocks=64, max_num_seqs=4, max_num_batched_tokens=24)
    outs = llm.generate([{"prompt_token_ids": long}, {"prompt_token_ids": PROMPTS[0]}],
                        SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert outs[0].outputs[0].token_ids == want and outs[1].outputs[0].token_ids == hf_greedy(model, PROMPTS[0], 8)
    assert llm.last_stats.steps >= 100 // 24 + 8


@pytest.mark.kernel
def test_decode_graph_buffers_and_padding_on_the_cpu():
    """The CUDA-graph path's static buffers, padding rows, plan updates and warm-up, run eagerly
    (capture=False): the eager engine's tokens (5 rows padded to 8, then 4, 2, 1)."""
    from paged_backend.integration.graphs import DecodeGraphs
    model = tiny("llama", seed=3)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS + [[11, 12]]]
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (12, 20, 6, 9, 16)]
    want = [o.outputs[0].token_ids for o in LLM(model, device="cpu", num_blocks=64).generate(prompts, params,
                                                                                             use_tqdm=False)]
    llm = LLM(model, device="cpu", num_blocks=64, profile=True)
    llm.graphs = DecodeGraphs(llm.model, llm.cache, num_q_heads=llm.info.num_q_heads, max_num_seqs=8,
                              max_model_len=llm.max_model_len, capture=False)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert sorted(llm.graphs.graphs) == [1, 2, 4, 8]
    assert [s["kind"] for s in llm.last_stats.step_log].count("graph") == 19


def _samples(outs):
    return [[(c.token_ids, c.cumulative_logprob) for c in o.outputs] for o in outs]


def _no_graph_draws(llm):
    """The engine's graphs ignore their draws from now on: every step's draw is the sampler's, after them."""
    for g in (llm.graphs, llm.cascades):
        if g is not None:
            g.sample = None


# sampling settings of each kind the decode graphs draw (SampleMode): temperature alone, the filters,
# top-k alone (by torch.topk), greedy rows beside drawn ones with top log-probabilities
DRAW_SETTINGS = [dict(temperature=0.8), dict(temperature=1.1, top_p=0.9, top_k=20, min_p=0.05),
                 dict(temperature=0.9, top_k=20), dict(temperature=0.0, logprobs=3)]
# tokens each request draws: the batch runs 5, 5, 4, 4, 3, 2, 2, 1... rows (graphs of 8, 4, 2 and 1), and the
# second and third requests each take a new block in a graph step (its last, its first); short: the interpreter runs
# every kernel
DRAW_LENGTHS = (6, 13, 3, 5, 8)


@pytest.mark.kernel
def test_graphs_draw_the_samplers_tokens_on_the_cpu(monkeypatch):
    """Decode graphs (run eagerly, capture=False) that hold the step's draw, for settings of every
    kind (one graph a size per mode): the tokens and log-probabilities (top ones too) of the same
    graphs with the sampler run after them, bit for bit, and the eager engine's tokens (padding rows
    dropped); the sampler runs only for the prefill steps."""
    from paged_backend.integration.graphs import DecodeGraphs
    from paged_backend.integration.sampler import Sampler
    model = tiny("llama", seed=3)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS + [[11, 12]]]
    calls = []
    call = Sampler.__call__
    monkeypatch.setattr(Sampler, "__call__", lambda self, logits, rows: calls.append(len(logits)) or
                        call(self, logits, rows))
    llm, plain = (LLM(model, device="cpu", num_blocks=64, profile=True) for _ in range(2))
    for e in (llm, plain):
        e.graphs = DecodeGraphs(e.model, e.cache, num_q_heads=e.info.num_q_heads, max_num_seqs=8,
                                max_model_len=e.max_model_len, capture=False, sample=e.sampler.sample)
    _no_graph_draws(plain)
    outputs = lambda outs: [[(c.token_ids, c.cumulative_logprob, c.logprobs) for c in o.outputs] for o in outs]  # noqa: E731
    for kw in DRAW_SETTINGS:
        # (the last: every other request greedy, all with top log-probabilities)
        params = [SamplingParams(**{**kw, "temperature": kw["temperature"] if j % 2 or kw["temperature"] else 0.7},
                                 seed=j, max_tokens=m) for j, m in enumerate(DRAW_LENGTHS)]
        eager = LLM(model, device="cpu", num_blocks=64).generate(prompts, params, use_tqdm=False)
        want = outputs(plain.generate(prompts, params, use_tqdm=False))
        calls.clear()
        got = outputs(llm.generate(prompts, params, use_tqdm=False))
        assert got == want and [[t for t, _, _ in o] for o in got] == [[c.token_ids] for c in (o.outputs[0] for o in eager)]
        kinds = [s["kind"] for s in llm.last_stats.step_log]
        assert kinds.count("graph") == 12 and len(calls) == len(kinds) - 12
    assert sorted(llm.graphs.graphs) == [1, 2, 4, 8] and llm.graphs.captures == 4 * len(DRAW_SETTINGS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("path", ["flat", "cascade"])
def test_gpu_graphs_draw_the_samplers_tokens(monkeypatch, path):
    """Seeded samples drawn inside the decode graphs, flat or cascade, for settings of every kind
    (temperature alone, the filters, greedy rows with top log-probabilities) are the tokens and
    log-probabilities of the same graphs with the sampler run after them, bit for bit.
    Cascade: one graph kept a size and a new launch key every step, so each step drops the graph
    that drew the step before it, still in flight (its tokens must not hold the graphs' memory pool:
    torch fails the next capture into a pool whose graphs are gone but whose memory is in use)."""
    from paged_backend.cascade import CascadePlan
    from paged_backend.integration import cascade_graphs
    monkeypatch.setattr(cascade_graphs, "MAX_GRAPHS_PER_SIZE", 1)
    key, count = CascadePlan.launch_key, itertools.count()
    monkeypatch.setattr(CascadePlan, "launch_key", lambda self: (*key(self), next(count)))
    model = tiny("qwen3", seed=1)
    prompts = [{"prompt_token_ids": list(range(3, 3 + 50))}, {"prompt_token_ids": list(range(7, 7 + 35))}]
    kw = dict(device="cuda", dtype="bfloat16", num_blocks=96, max_num_seqs=8,
              cascade=CascadeCost(0, 0, 0) if path == "cascade" else False)
    llm, plain = LLM(model, **kw), LLM(model, **kw)
    _no_graph_draws(plain)
    outputs = lambda outs: [[(c.token_ids, c.cumulative_logprob, c.logprobs) for c in o.outputs] for o in outs]  # noqa: E731
    for e in (llm, plain):
        if path == "cascade":
            e.choice.PROBES = 10 ** 9
    for settings in DRAW_SETTINGS:
        # (greedy: the second prompt's samples draw at a temperature, beside the first's greedy ones)
        params = [SamplingParams(**{**settings, "temperature": settings["temperature"] or 0.9 * s}, n=4, seed=s,
                                 max_tokens=m) for s, m in ((0, 14), (1, 6))]
        got = outputs(llm.generate(prompts, params, use_tqdm=False))
        if path == "cascade":
            assert llm.last_stats.cascade_steps >= 10 and llm.cascades.captures >= llm.last_stats.cascade_steps
        assert outputs(plain.generate(prompts, params, use_tqdm=False)) == got


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("path", ["flat", "cascade"])
def test_gpu_steps_run_ahead_past_length_ends(path):
    """On the GPU, in graphs (flat or cascade), steps run ahead past samples that end by length - two
    prompts whose samples stop at different steps, the later steps' input ids gathered from the
    earlier tokens on the device - give the synchronous loop's tokens and log-probabilities."""
    model = tiny("qwen3", seed=1)
    prompts = [{"prompt_token_ids": list(range(3, 3 + 50))}, {"prompt_token_ids": list(range(7, 7 + 35))}]
    params = [SamplingParams(n=4, temperature=0.9, seed=s, max_tokens=m) for s, m in ((0, 14), (1, 6))]
    llm = LLM(model, device="cuda", dtype="bfloat16", num_blocks=96, max_num_seqs=8,
              cascade=CascadeCost(0, 0, 0) if path == "cascade" else False)
    if path == "cascade":
        llm.choice.PROBES = 10 ** 9
    runs = {}
    for on in (True, False):
        llm.async_scheduling = on
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[on] = [[(c.token_ids, c.cumulative_logprob) for c in o.outputs] for o in outs], llm.last_stats.ahead_steps
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] > 5 and runs[False][1] == 0


def _re_point(model, scale: float) -> None:
    """Each layer's q and o projections re-pointed at new tensors of other values (``p.data = t``)."""
    for layer in model.get_decoder().layers:
        for lin in (layer.self_attn.q_proj, layer.self_attn.o_proj):
            lin.weight.data = lin.weight.detach().clone() * scale


def _eager_graphs_engine(model):
    """A CPU engine whose decode graphs (sizes 1-8) run eagerly (capture=False): their plumbing."""
    from paged_backend.integration.graphs import DecodeGraphs
    llm = LLM(model, device="cpu", num_blocks=64, max_num_seqs=8)
    llm.graphs = DecodeGraphs(llm.model, llm.cache, num_q_heads=llm.info.num_q_heads, max_num_seqs=8,
                              max_model_len=llm.max_model_len, capture=False)
    return llm


def test_the_engine_follows_new_weights_on_the_cpu():
    """Weights changed between calls: updated in place (``load_state_dict``), the prefix cache is
    dropped and the decode graphs (run eagerly here, capture=False) kept; re-pointed (``p.data =
    t``), the graphs are made again too; written through ``.data`` (no version bump),
    ``reset_prefix_cache`` drops the cache. Each time the tokens are a fresh engine's on the changed
    model; unchanged weights keep the prefix cache."""
    model = tiny("llama", seed=3)
    prompts, params, llm = [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=8), \
        _eager_graphs_engine(model)
    tokens = lambda e: [o.outputs[0].token_ids for o in e.generate(prompts, params, use_tqdm=False)]  # noqa: E731
    fresh = lambda: tokens(LLM(model, device="cpu", num_blocks=64))  # noqa: E731
    before = tokens(llm)
    made = dict(llm.graphs.graphs)
    kept = lambda: all(llm.graphs.graphs[s] is g for s, g in made.items())  # noqa: E731
    assert tokens(llm) == before and llm.last_stats.cached_prompt_tokens > 0 and kept()
    model.load_state_dict({k: v * 1.3 if k.endswith("v_proj.weight") else v for k, v in model.state_dict().items()})
    got = tokens(llm)
    assert got == fresh() and got != before and llm.last_stats.cached_prompt_tokens == 0 and kept()
    _re_point(model, 1.7)
    again = tokens(llm)
    assert again == fresh() and again != got and sorted(llm.graphs.graphs) == [1, 2, 4, 8] and not kept()
    for layer in model.get_decoder().layers:
        layer.mlp.down_proj.weight.data.mul_(0.5)
    assert llm.reset_prefix_cache()
    assert tokens(llm) == fresh() != again


def test_sleep_frees_the_pool_and_the_next_call_wakes_it_on_the_cpu():
    """``sleep`` drops the KV pool, the decode graphs (run eagerly here, capture=False) and the prefix
    cache's contents; the next call allocates and makes them again and gives the same tokens (the
    prompt's KV computed anew, then cached again); ``wake_up`` does it ahead of a call. Sleeping
    while a ``generate_iter`` holds blocks is refused."""
    model = tiny("llama", seed=3)
    prompts, params, llm = [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=8), \
        _eager_graphs_engine(model)
    tokens = lambda: [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]  # noqa: E731
    before = tokens()
    llm.sleep()
    assert llm.cache.kv is None and llm.cache.k is None and not llm.graphs.graphs
    assert tokens() == before and llm.last_stats.cached_prompt_tokens == 0 and sorted(llm.graphs.graphs) == [1, 2, 4, 8]
    assert tokens() == before and llm.last_stats.cached_prompt_tokens > 0
    running = llm.generate_iter(prompts, [SamplingParams(temperature=0, max_tokens=m) for m in (2, 20, 20, 20)])
    next(running)  # (the first request done, the others running)
    with pytest.raises(RuntimeError, match="sleep"):
        llm.sleep()
    running.close()
    llm.sleep()
    llm.wake_up()
    assert llm.cache.kv is not None and sorted(llm.graphs.graphs) == [1, 2, 4, 8]
    assert tokens() == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_sleep_frees_the_pool_and_graphs():
    """On the GPU ``sleep`` hands back at least the KV pool's bytes (graphs and their buffers too),
    and the next call's tokens are the first call's, its decode steps replayed from graphs captured
    anew."""
    model = tiny("llama", seed=3)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=12)
    llm = LLM(model, device="cuda", dtype="float32", num_blocks=512, max_num_seqs=8, profile=True)
    tokens = lambda: [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]  # noqa: E731
    before = tokens()
    torch.cuda.synchronize()
    used = torch.cuda.memory_allocated()
    llm.sleep()
    assert used - torch.cuda.memory_allocated() >= llm.cache.nbytes
    assert tokens() == before
    assert [s["kind"] for s in llm.last_stats.step_log].count("graph") >= 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_graphs_follow_re_pointed_weights():
    """Captured decode graphs read the weights at their addresses: a weight re-pointed between calls
    (``p.data = t``, as an RL loop may load new weights) makes the engine capture them again (and
    drop its prefix cache), and the next call's tokens are a fresh eager engine's on the changed
    model (fp32, greedy), not the old weights' (nor freed memory's)."""
    model = tiny("llama", seed=3)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=12)
    tokens = lambda e: [o.outputs[0].token_ids for o in e.generate(prompts, params, use_tqdm=False)]  # noqa: E731
    llm = LLM(model, device="cuda", dtype="float32", num_blocks=64, max_num_seqs=8, profile=True)
    before, made = tokens(llm), dict(llm.graphs.graphs)
    _re_point(model, 1.7)
    torch.cuda.empty_cache()  # (the old weights' memory handed back: stale graphs would read whatever is there)
    got = tokens(llm)
    assert not any(llm.graphs.graphs.get(s) is g for s, g in made.items())
    assert [s["kind"] for s in llm.last_stats.step_log].count("graph") >= 8  # (the new graphs ran the decode steps)
    want = tokens(LLM(model, device="cuda", dtype="float32", num_blocks=64, enforce_eager=True))
    assert got == want and got != before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_decode_graphs_match_eager():
    """Flat decode steps replayed from CUDA graphs (5 and then fewer rows, padded to 8 and 4) give
    the eager engine's tokens (fp32), and the graphs were used."""
    model = tiny("llama", seed=3)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS + [[11, 12]]]
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (12, 20, 6, 9, 16)]
    eager = LLM(model, device="cuda", dtype="float32", num_blocks=64, enforce_eager=True)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    llm = LLM(model, device="cuda", dtype="float32", num_blocks=64, profile=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    log = llm.last_stats.step_log
    kinds = [s["kind"] for s in log]
    assert kinds.count("graph") >= 15 and set(llm.graphs.graphs) >= {8, 4}
    # GPU clock per step (events): a span, and from the second step on the gap after the last one
    assert log[0]["idle_s"] is None and all(s["gpu_s"] > 0 for s in log)
    assert all(s["idle_s"] >= 0 for s in log[1:])


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_compiled_layers_give_the_same_tokens(family):
    """Decoder layers compiled with torch.compile (AOT autograd's graphs, run eagerly: the CPU test
    of the tracing; Inductor runs on the GPU), attention a graph break, q/k/v and gate/up one GEMM
    each (test_fused_linears): the uncompiled engine's
    tokens, n samples of two prompts (prefill, cascade and flat decode). The layers run compiled
    inside the engine's calls only: the user's model object is left as it was."""
    from paged_backend.integration.compiled import CompiledForward, decoder_parts
    model = tiny(family, seed=2)
    prompts = [{"prompt_token_ids": list(range(3, 3 + 50))}, {"prompt_token_ids": list(range(7, 7 + 35))}]
    params = SamplingParams(n=3, temperature=0, max_tokens=8)
    kw = dict(device="cpu", num_blocks=96, cascade=CascadeCost(0, 0, 0), max_num_seqs=8)
    want = [[c.token_ids for c in o.outputs] for o in LLM(model, **kw).generate(prompts, params, use_tqdm=False)]
    decoder = model.get_decoder()
    layers, parts = decoder.layers, decoder_parts(model)
    assert parts == [decoder.norm, decoder.rotary_emb]  # (the final norm and the cos/sin tables)
    modules = [*layers, *parts]
    seen = []  # per model call: were the compiled calls in place?
    model.register_forward_pre_hook(lambda m, args: seen.append(all(x._compiled_call_impl is not None for x in modules)))
    llm = LLM(model, compile_model="aot_eager", **kw)
    assert isinstance(llm.forward, CompiledForward) and len(llm.forward.projections.groups) == 2 * len(layers)  # qkv, gate/up
    assert [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert seen and all(seen) and all(x._compiled_call_impl is None for x in modules)
    k = layers[0].self_attn.k_proj.weight
    k.data = k.detach().clone()  # re-pointed (same values): put back end to end before the next call
    assert [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert k.storage_offset() > 0 and llm.forward.projections.keep() == 0
    assert CompiledForward.of(torch.nn.Linear(2, 2)).__class__ is torch.nn.Linear  # no decoder layers: not compiled
    with pytest.raises(TypeError, match="compile_model"):
        LLM(model, compile_model=3, **kw)


def test_every_layer_shares_one_compiled_code(caplog):
    """Ten layers (more than Dynamo's recompile limit of 8), three batch sizes: Dynamo never reaches
    its limit, so no layer runs uncompiled - one backend callable serves every layer (a callable per
    layer made Dynamo recompile for each, and the layers past the 8th ran uncompiled on the H200)."""
    torch._dynamo.reset()
    model = tiny("llama", seed=2, num_hidden_layers=10)
    llm = LLM(model, device="cpu", num_blocks=96, max_num_seqs=8, compile_model="aot_eager")
    with caplog.at_level("WARNING", logger="torch._dynamo"):
        for n in (1, 3, 8):
            llm.generate([{"prompt_token_ids": list(range(3, 30 + n))}],
                         SamplingParams(n=n, max_tokens=3, ignore_eos=True, temperature=1.0, seed=0), use_tqdm=False)
    assert not [r for r in caplog.records if "recompile_limit" in r.getMessage()]


def test_a_model_that_does_not_compile_runs_uncompiled(caplog):
    """A torch.compile backend that fails: one warning naming the error, the uncompiled engine's
    tokens (the failed call runs again uncompiled), and no further attempt."""
    calls = []

    def failing(gm, example_inputs):
        calls.append(1)
        raise RuntimeError("this backend cannot compile")
    model = tiny("llama", seed=2)
    prompts = [{"prompt_token_ids": list(range(3, 3 + 50))}]
    params = SamplingParams(n=2, temperature=0, max_tokens=6)
    kw = dict(device="cpu", num_blocks=64, max_num_seqs=4)
    want = [[c.token_ids for c in o.outputs] for o in LLM(model, **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(model, compile_model=failing, **kw)
    with caplog.at_level("WARNING", logger="paged_backend.integration.compiled"):
        got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want and len(calls) == 1 and llm.forward.failed is not None
    assert [r.getMessage() for r in caplog.records if "run uncompiled" in r.getMessage()] == [
        "torch.compile failed on LlamaForCausalLM's decoder layers, which run uncompiled from now on: "
        "RuntimeError: this backend cannot compile"]
    assert all(layer._compiled_call_impl is None for layer in model.get_decoder().layers)


@pytest.mark.kernel
@pytest.mark.skipif(not INTERPRET, reason="replays through earlier plans need the kernels, which read the plans' "
                                          "buffers (the torch path reads host copies): the TRITON_INTERPRET=1 pass")
def test_cascade_graph_buffers_and_padding_on_the_cpu(monkeypatch):
    """The cascade CUDA-graph path run eagerly (capture=False): static inputs with padding rows, plans
    in arenas, and every step after the first of a launch key run through the first step's plan
    objects (as its graph would): the eager cascade's tokens (6 rows padded to 8, then 3 to 4). With
    stand-ins for CUDA events, every step (prefill, cascade graph, flat graph) records its start
    once, after its planning, and its end after it."""
    from paged_backend.integration import engine as engine_mod
    from paged_backend.integration.cascade_graphs import CascadeGraphs
    order = []

    class Event:  # records where in the run it was recorded; elapsed_time = steps between
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self, stream=None):
            assert self.at is None, "an event recorded twice"
            self.at = len(order)
            order.append(self)

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return float(end.at - self.at)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(engine_mod, "_events", lambda device: (Event(), Event()))
    from paged_backend.integration.graphs import DecodeGraphs
    from paged_backend.integration.path_choice import PathChoice
    model = tiny("qwen3", seed=1)
    prompts = [{"prompt_token_ids": list(range(3, 3 + 50))}, {"prompt_token_ids": list(range(7, 7 + 35))}]
    params = [SamplingParams(n=3, temperature=0, max_tokens=m) for m in (9, 5)]
    kw = dict(device="cpu", num_blocks=96, cascade=CascadeCost(0, 0, 0), max_num_seqs=8)
    want = [[c.token_ids for c in o.outputs] for o in LLM(model, **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(model, profile=True, **kw)
    shape = dict(max_num_seqs=8, max_model_len=llm.max_model_len)
    llm.graphs = DecodeGraphs(llm.model, llm.cache, num_q_heads=llm.info.num_q_heads, capture=False, **shape)
    llm.cascades = CascadeGraphs(llm.model, llm.cache, llm.builder, capture=False, **shape)
    llm.choice = PathChoice(llm.model, 1, llm.device)
    llm.choice.PROBES, llm.choice.bandwidth = 10 ** 9, 1e12  # every shared step a cascade; no device copy timed
    got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    log = llm.last_stats.step_log
    steps = [s["kind"] for s in log].count("cascade")
    assert steps == 8 and sorted(llm.cascades.graphs) == [4, 8] and llm.cascades.captures < steps
    assert llm.last_stats.graph_captures == llm.cascades.captures
    assert {"prefill", "cascade"} <= {s["kind"] for s in log}
    assert all(s["gpu_s"] > 0 for s in log) and log[0]["idle_s"] is None and all(s["idle_s"] > 0 for s in log[1:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family,dtype", [("qwen3", "float32"), ("qwen3", "bfloat16"), ("gemma2", "bfloat16")])
def test_gpu_cascade_graphs_match_eager(family, dtype):
    """Cascade decode steps replayed whole from CUDA graphs give the eager cascade's tokens (8 rows,
    then 4 padded to 4; Gemma 2: soft-capping and its sliding layers), and graphs replayed steps
    planned after their capture."""
    model = tiny(family, seed=1)
    prompts = [{"prompt_token_ids": list(range(3, 3 + 50))}, {"prompt_token_ids": list(range(7, 7 + 35))}]
    params = [SamplingParams(n=4, temperature=0, max_tokens=m) for m in (14, 6)]
    kw = dict(device="cuda", dtype=dtype, num_blocks=96, cascade=CascadeCost(0, 0, 0), max_num_seqs=8)
    eager = LLM(model, enforce_eager=True, **kw)
    want = [[c.token_ids for c in o.outputs] for o in eager.generate(prompts, params, use_tqdm=False)]
    llm = LLM(model, **kw)
    assert set(llm.graphs.graphs) == {8, 4, 2, 1}  # flat steps' graphs captured when the engine started
    llm.choice.PROBES = 10 ** 9  # every decode step with shared blocks takes the cascade
    got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert llm.last_stats.cascade_steps >= 10 and llm.cascades.captures < llm.last_stats.cascade_steps


def test_cascade_decode_in_the_engine_matches_flat():
    """Every shared prompt block kept as a cascade node (cost model off): same greedy tokens."""
    model = tiny("qwen3", seed=1)
    prompts = [{"prompt_token_ids": list(range(3, 3 + 50))}, {"prompt_token_ids": list(range(7, 7 + 35))}]
    params = SamplingParams(n=4, temperature=0, max_tokens=10)
    flat = LLM(model, device="cpu", num_blocks=96, cascade=False).generate(prompts, params, use_tqdm=False)
    llm = LLM(model, device="cpu", num_blocks=96, cascade=CascadeCost(0, 0, 0))
    casc = llm.generate(prompts, params, use_tqdm=False)
    assert llm.last_stats.cascade_steps > 0
    assert [[c.token_ids for c in o.outputs] for o in casc] == [[c.token_ids for c in o.outputs] for o in flat]


WINDOWED = {  # sliding windows of 24 tokens: prompts up to 37 tokens + 12 new ones outgrow them
    "mistral": lambda: tiny("mistral", sliding_window=24),  # every layer
    "qwen2": lambda: tiny(transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=24,
                                                   max_window_layers=1)),  # layer 1 only
    "gemma2": lambda: tiny(transformers.Gemma2Config(**dict(SMALL, sliding_window=24),
                                                     attn_logit_softcapping=5.0)),  # alternating, soft-capped
    "gpt_oss": lambda: tiny(transformers.GptOssConfig(**dict(SMALL, num_local_experts=2, num_experts_per_tok=1,
                                                             sliding_window=24))),  # alternating, with sinks
}


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_sliding_windows_match_transformers(family):
    """Windows that cut in prefill and in decode, flat and as a cascade (forked samples share their
    prompt's blocks; every shared block a node): greedy tokens equal transformers' generate()."""
    model = WINDOWED[family]()
    windows = {getattr(m, "sliding_window", None) or getattr(m.config, "sliding_window", None)
               for m in model.modules() if type(m).__name__.endswith("Attention")}
    assert 24 in windows
    want = [hf_greedy(model, p, 12) for p in PROMPTS]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for cascade in (False, CascadeCost(0, 0, 0)):
        llm = LLM(model, device="cpu", block_size=16, num_blocks=96, cascade=cascade)
        assert 24 in llm.info.windows
        outs = llm.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=12), use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in outs] == [[w, w] for w in want]
        assert (llm.last_stats.cascade_steps > 0) == bool(cascade)


def test_gemma2_soft_capping_matches_transformers():
    """Large attention scores (q/k weights x6) under a cap of 2: the capped model's greedy tokens
    differ from the uncapped one's (so the cap matters here), and the engine's equal transformers'."""
    model = tiny("gemma2", attn_logit_softcapping=2.0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
            layer.self_attn.k_proj.weight.mul_(6)
    want = [hf_greedy(model, p, 12) for p in PROMPTS]
    uncapped = copy.deepcopy(model)
    for layer in uncapped.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert [hf_greedy(uncapped, p, 12) for p in PROMPTS] != want
    llm = LLM(model, device="cpu", block_size=16, num_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=12),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_gpt_oss_attention_sinks_match_transformers():
    """gpt-oss's learned per-head sinks (set to matter: the tokens differ with sinks at -1e4) go to
    the ops' ``sinks``; greedy tokens equal transformers' eager attention."""
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(**dict(SMALL, num_local_experts=2, num_experts_per_tok=1, sliding_window=512))
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-1.0, 6.0, SMALL["num_attention_heads"]))
    want = [hf_greedy(model, p, 12) for p in PROMPTS]
    sinkless = copy.deepcopy(model)
    with torch.no_grad():
        for layer in sinkless.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    assert [hf_greedy(sinkless, p, 12) for p in PROMPTS] != want
    llm = LLM(model, device="cpu", block_size=16, num_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=12),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_models_needing_missing_features_are_refused():
    model = tiny("qwen2")
    model.config.layer_types = ["full_attention", "chunked_attention"]  # (Llama 4's chunked local attention)
    with pytest.raises(ValueError, match=r"layer types \['chunked_attention'\]"):
        LLM(model, device="cpu", num_blocks=16, max_model_len=256)


def test_unsupported_head_dim_is_refused():
    with pytest.raises(ValueError, match="head dim 32"):
        LLM(tiny("llama", head_dim=32), device="cpu", num_blocks=16)


def fp8_reference(model, dtype):
    """A copy of ``model`` whose attention (SDPA) sees K and V rounded to ``dtype`` after RoPE, as an
    fp8 cache with scales 1.0 stores them."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask
    name = f"fp8_reference_{str(dtype).split('_')[-1]}"

    def attention(module, q, k, v, mask, **kw):
        return sdpa_attention_forward(module, q, k.to(dtype).to(q.dtype), v.to(dtype).to(q.dtype), mask, **kw)
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    ref = copy.deepcopy(model)
    ref.set_attn_implementation(name)
    return ref


# (torch path only: Triton's interpreter flushes fp8 subnormals to zero when write_kv quantizes, so
# its cache differs from torch's rounding, which the reference uses; tests/test_fp8.py runs the fp8
# kernels in the interpreter against the cache they wrote, and on the GPU)
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_kv_cache(kv_cache_dtype):
    """An fp8 pool holds four times the blocks of an fp32 one in the same bytes; greedy tokens equal
    transformers' generate() with K and V rounded to fp8 the same way, flat and as a cascade."""
    model = tiny("llama")
    dtype = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
    ref = fp8_reference(model, dtype)
    want = []
    for p in PROMPTS:
        out = ref.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, min_new_tokens=10,
                           attention_mask=torch.ones(1, len(p), dtype=torch.long))
        want.append(out[0, len(p):].tolist())
    assert want != [hf_greedy(model, p, 10) for p in PROMPTS]  # fp8 rounding changes the tokens here
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for cascade in (False, CascadeCost(0, 0, 0)):
        llm = LLM(model, device="cpu", num_blocks=64, cascade=cascade, kv_cache_dtype=kv_cache_dtype)
        assert llm.cache.kv.dtype == dtype and llm.cache.spec.bytes_per_block * 4 == \
            LLM(model, device="cpu", num_blocks=1).cache.spec.bytes_per_block
        outs = llm.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=10), use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in outs] == [[w, w] for w in want]
        assert (llm.last_stats.cascade_steps > 0) == bool(cascade)
        if not cascade:  # the default cost model counts the fp8 cache's bytes
            assert llm.builder.cascade_cost.kv_elem_bytes == 1


def test_bad_kv_cache_dtype():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(tiny("llama"), device="cpu", num_blocks=8, kv_cache_dtype="int8")


def test_path_choice_times_both_paths_and_holds_its_path():
    """The cascade/flat choice: the first steps probe the cascade; then the median of recent cascade
    steps against the flat step's bytes times the flat graph steps' measured ratio to them; a path
    changes only for a gain over the margin, and the step after a change is not timed; the cascade
    is timed again after REPROBE_FIRST flat steps in a row, then after twice as many each time the
    flat path holds (up to REPROBE), and at each engine call's start."""
    from types import SimpleNamespace

    from paged_backend.integration.path_choice import PathChoice
    choice = PathChoice(torch.nn.Linear(1, 1, bias=False), kv_bytes_per_token=1, device=torch.device("cpu"))
    choice.bandwidth = 1000.0  # bytes/s: a flat step of 10 rows x 100 tokens (+ 4 weight bytes) takes ~1 s
    batch = SimpleNamespace(seq_lens=np.full(10, 100))
    assert choice.cascade(batch) and choice.cascade(batch)  # probes
    for s in (0.9, 3.0, 0.95):  # one slow step does not move the median
        choice.note_cascade(s)
    assert choice.cascade(batch)
    for s in (1.05, 1.06):  # median 1.05: within the margin of flat's 1.004 s, so the cascade holds
        choice.note_cascade(s)
        assert choice.cascade(batch)
    for _ in range(3):  # median 1.2: past the margin
        choice.note_cascade(1.2)
    assert not choice.cascade(batch)
    choice.note_flat(9.0, batch)  # the step after the change: not timed
    assert not choice.cascade(batch)
    choice.note_flat(1.5, batch)  # flat graph steps at 1.5x their bytes: the cascade is faster by the margin
    assert choice.cascade(batch)
    choice.note_cascade(5.0)  # (not timed either)
    assert list(choice.cascade_s)[-1] == 1.2
    for s in (3.0, 3.0, 3.0, 3.0):  # the cascade slow now: flat again, REPROBE_FIRST shared steps in a row
        choice.note_cascade(s)
    wait = choice.REPROBE_FIRST
    for _ in range(5):  # each probe that keeps flat waits twice as long for the next one, up to REPROBE
        assert not any(choice.cascade(batch) for _ in range(wait - choice.flat_run))
        assert choice.cascade(batch) and choice.cascade(batch)  # then the cascade is timed afresh
        choice.note_cascade(3.0)  # (the step after the change: not timed)
        choice.note_cascade(3.0)
        choice.note_cascade(3.0)
        assert not choice.cascade(batch)  # slow still: flat
        choice.note_flat(9.0, batch)  # (not timed)
        wait = min(2 * wait, choice.REPROBE)
        assert choice.reprobe == wait and choice.flat_run == 1
    assert wait == choice.REPROBE == 128
    assert not any(choice.cascade(batch) for _ in range(wait - 1))
    assert choice.cascade(batch) and choice.cascade(batch)
    for s in (0.5, 0.5, 0.5):  # fast now: the cascade wins on its times, the next flat spell is probed early
        choice.note_cascade(s)
    assert choice.cascade(batch) and choice.reprobe == choice.REPROBE_FIRST
    choice.note_flat(1.5, batch)
    choice.new_run()  # an engine call starts: the cascade's earlier times are dropped, it probes
    assert not choice.cascade_s and choice.cascade(batch)
    for _ in range(choice.SETTLE):  # the call's first steps are not timed
        choice.note_cascade(9.0)
    choice.note_cascade(1.0)
    assert list(choice.cascade_s) == [1.0]
