"""integration/fused_linears.py: projection weights moved end to end (same parameters, same values),
the compiled graphs' linear calls on one input joined where - and only where - their weights lie end
to end, the layers' outputs unchanged; a fused graph that does not compile runs as captured."""
import copy

import pytest
import torch

from paged_backend.integration.fused_linears import LINEARS, fuse_linears, fusing, rehome
from paged_backend.integration import LLM, SamplingParams
from test_engine_models import tiny


def _layer_inputs(model, batch=2, length=5):
    h = torch.randn(batch, length, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    return h, model.get_decoder().rotary_emb(h, torch.arange(length)[None])


def _run(layer, h, pos):
    with torch.inference_mode():
        out = layer(h, position_embeddings=pos, attention_mask=None)
    return out[0] if isinstance(out, tuple) else out


def _capture(layer, h, pos, backend):
    """The layer compiled with ``backend`` and run once -> its output."""
    torch._dynamo.reset()
    return _run_compiled(torch.compile(layer._call_impl, backend=backend), h, pos)


def _run_compiled(call, h, pos):
    with torch.inference_mode():
        out = call(h, position_embeddings=pos, attention_mask=None)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_rehome_keeps_parameters_and_values_and_lays_weights_end_to_end(family):
    model = tiny(family, seed=1)
    layers = model.get_decoder().layers
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    assert len(rehome(layers).groups) == 2 * len(layers)  # q/k/v and gate/up of every layer
    for n, p in model.named_parameters():
        assert p is before[n][0] and torch.equal(p, before[n][1]), n
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        for group in ((a.q_proj, a.k_proj, a.v_proj), (m.gate_proj, m.up_proj)):
            ws = [x.weight for x in group]
            assert len({w.untyped_storage().data_ptr() for w in ws}) == 1
            assert [w.storage_offset() for w in ws] == [sum(v.numel() for v in ws[:i]) for i in range(len(ws))]
        assert a.o_proj.weight.untyped_storage().data_ptr() != a.q_proj.weight.untyped_storage().data_ptr()
    # a second engine on the same model: the groups are kept where they lie (the first engine's CUDA
    # graphs read them at these addresses)
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert len(rehome(layers).groups) == 2 * len(layers) and [p.data_ptr() for p in model.parameters()] == ptrs


def test_a_rehomed_model_still_trains_and_keeps_the_layout():
    """RL loops train the model they sample from: after rehome (even called under inference mode)
    gradients reach each projection's weight, and an optimizer's in-place step keeps the weights end
    to end, with the values the step gave them."""
    model = tiny("llama", seed=6)
    with torch.inference_mode():
        rehome(model.get_decoder().layers)
    a = model.get_decoder().layers[0].self_attn
    model(torch.tensor([[3, 4, 5, 6]]), labels=torch.tensor([[3, 4, 5, 6]])).loss.backward()
    assert a.k_proj.weight.grad is not None and a.k_proj.weight.grad.shape == a.k_proj.weight.shape
    before = a.k_proj.weight.detach().clone()
    want = before - 0.1 * a.k_proj.weight.grad
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert not torch.equal(a.k_proj.weight.detach(), before)
    assert torch.allclose(a.k_proj.weight.detach(), want, rtol=0, atol=1e-7)  # (SGD's own rounding)
    assert a.k_proj.weight.storage_offset() == a.q_proj.weight.numel()
    assert a.k_proj.weight.untyped_storage().data_ptr() == a.q_proj.weight.untyped_storage().data_ptr()


def test_a_re_pointed_weight_is_put_back_before_the_compiled_layer_runs():
    """A weight replaced by another tensor (``p.data = t``, as some weight loaders do) leaves its
    group apart: the joined linear would read past the new tensor's end. ``keep`` moves the group
    back end to end (the new values), and the compiled layer gives the plain layer's output."""
    model = tiny("llama", seed=7)
    h, pos = _layer_inputs(model)
    layer = model.get_decoder().layers[0]
    proj = rehome(model.get_decoder().layers)
    torch._dynamo.reset()
    call = torch.compile(layer._call_impl, backend=fusing("aot_eager"))
    _run_compiled(call, h, pos)
    assert proj.keep() == 0
    a = layer.self_attn
    a.q_proj.weight.data = a.q_proj.weight.detach() * 2  # a fresh tensor: q/k/v apart
    a.v_proj.weight.data = a.v_proj.weight.detach().clone()
    want = _run(layer, h, pos)
    assert proj.keep() == 1 and proj.keep() == 0
    assert torch.equal(_run(layer, h, pos), want)  # the new values kept
    assert torch.allclose(_run_compiled(call, h, pos), want, atol=1e-5, rtol=1e-5)


class _Biased(torch.nn.Module):
    """q/k/v with biases (as Qwen2's) and a projection of another width that must stay apart."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = torch.nn.Linear(8, 6), torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
        self.gate_proj, self.up_proj = torch.nn.Linear(8, 5), torch.nn.Linear(6, 5)  # widths differ: not moved

    def forward(self, x):
        return torch.cat([self.q_proj(x), self.k_proj(x) * self.v_proj(x)], -1).sum(-1) + self.gate_proj(x).sum(-1)


def test_biases_are_joined_and_mismatched_groups_left_alone():
    torch.manual_seed(0)
    m = _Biased()
    x = torch.randn(3, 8)
    want = m(x)
    assert len(rehome(torch.nn.ModuleList([m])).groups) == 1
    assert m.k_proj.bias.storage_offset() == 6 and m.up_proj.weight.storage_offset() == 0
    seen = []

    def count(gm, example_inputs):
        seen.append(fuse_linears(gm, example_inputs))
        assert sum(n.op == "call_function" and n.target in LINEARS for n in gm.graph.nodes) == 2  # qkv, gate
        return gm.forward
    torch._dynamo.reset()
    got = torch.compile(m, backend=count)(x)
    assert seen == [1] and torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_compiled_layer_is_unchanged_and_fused_only_where_weights_lie_end_to_end(family):
    model = tiny(family, seed=3)
    plain = copy.deepcopy(model)
    h, pos = _layer_inputs(model)
    layer = model.get_decoder().layers[1]
    want = _run(plain.get_decoder().layers[1], h, pos)
    counts = []

    def backend(gm, example_inputs):
        counts.append(fuse_linears(gm, example_inputs))
        return gm.forward
    assert torch.equal(_capture(layer, h, pos, backend), want) and counts == [0]  # weights apart: nothing joined
    rehome(model.get_decoder().layers)
    counts.clear()
    got = _capture(layer, h, pos, backend)
    assert counts == [2] and torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
    assert torch.allclose(_run_compiled(torch.compile(layer._call_impl, backend=fusing("aot_eager")), h, pos), want,
                          atol=1e-5, rtol=1e-5)


def test_a_fused_graph_that_does_not_compile_runs_as_captured(caplog):
    model = tiny("llama", seed=4)
    h, pos = _layer_inputs(model)
    want = _run(model.get_decoder().layers[0], h, pos)
    rehome(model.get_decoder().layers)
    seen = []

    def picky(gm, example_inputs):  # refuses the fused graphs (they hold as_strided calls)
        fused = any(n.target is torch.as_strided for n in gm.graph.nodes)
        seen.append(fused)
        if fused:
            raise RuntimeError("no as_strided here")
        return gm.forward
    with caplog.at_level("WARNING", logger="paged_backend.integration.fused_linears"):
        got = _capture(model.get_decoder().layers[0], h, pos, fusing(picky))
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5) and seen == [True, False]
    assert ["RuntimeError: no as_strided here" in r.getMessage() for r in caplog.records] == [True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_gpu_inductor_runs_the_fused_projections(family):
    """On the GPU, Inductor compiles the joined linears (an as_strided view of a parameter input):
    two runs fused in the layer's graph, its bf16 output the plain layer's within rounding."""
    model = tiny(family, seed=5).to("cuda", torch.bfloat16)
    h, pos = _layer_inputs(model, batch=4, length=1)
    h, pos = h.to("cuda", torch.bfloat16), tuple(p.to("cuda", torch.bfloat16) for p in pos)
    want = _run(model.get_decoder().layers[0], h, pos)
    rehome(model.get_decoder().layers)
    counts = []

    def counting(gm, example_inputs):
        counts.append(fuse_linears(copy.deepcopy(gm), example_inputs))
        return fusing("inductor")(gm, example_inputs)
    got = _capture(model.get_decoder().layers[0], h, pos, counting)
    assert counts == [2] and torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)



def test_dynamos_restart_is_passed_on_and_the_recapture_fused(caplog):
    """A second model in the process whose attention scale differs: Dynamo makes the float
    dynamic, and AOTAutograd, which cannot keep it so (it goes out to our attention, a graph
    break), asks for a capture again (TensorifyScalarRestartAnalysis) - a signal, not a failure.
    Taken for one, the layers ran q/k/v and gate/up apart (the 8B shape profiled after SmolLM2 in
    one process on the H200: 0.25 ms of a 3.5 ms step)."""
    torch._dynamo.reset()
    fused, left = [], []

    def spy(gm, example_inputs):  # what the inner backend gets: the graph fused, or as captured
        fused[-1].append(any(n.target is torch.as_strided for n in gm.graph.nodes))
        left.append(fuse_linears(copy.deepcopy(gm), example_inputs))
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
    with caplog.at_level("WARNING", logger="paged_backend.integration.fused_linears"):
        for head_dim in (64, 128):
            fused.append([])
            llm = LLM(tiny("llama", seed=6, head_dim=head_dim), device="cpu", num_blocks=32, max_num_seqs=4,
                      compile_model=spy)
            llm.generate([{"prompt_token_ids": list(range(3, 20))}],
                         SamplingParams(n=2, max_tokens=2, ignore_eos=True, temperature=0), use_tqdm=False)
            assert llm.forward.failed is None
    assert not caplog.records and not any(left)  # no graph kept projections it could have joined
    assert all(any(graphs) for graphs in fused)
