"""The projections that read one input as one GEMM: q/k/v, and gate/up, of each decoder layer.

A decode step of 64 rows reads each weight once per GEMM, and small GEMMs read theirs slowly: on
the H200 (2026-11-28, Llama-3-8B shape) cuBLAS took 5.8 us for a 4096 x 1024 k or v projection
(1.4 TB/s, plus a split-K reduction each) against 12.6 us for the 4 x larger q (2.7 TB/s), and the
SmolLM2 shape's seven GEMMs a layer are 3-4 us each, latency more than bytes. vLLM builds its models
with fused ``qkv_proj`` and ``gate_up_proj`` weights; we run transformers' models as they are, so:

1. :func:`rehome` moves the weights of each layer's ``q_proj, k_proj, v_proj`` (and ``gate_proj,
   up_proj``) into one buffer, end to end, and points each ``nn.Linear``'s weight at its part (the
   same parameters and values; the old storage is freed, no memory is added).
2. :func:`fuse_linears`, a pass over the graph torch.compile captures of a layer, replaces linear
   calls on one input whose weights lie end to end in one storage by one linear over the whole
   buffer (an ``as_strided`` view from the first weight), split after. It checks each group on the
   real tensors it is compiled with; weights elsewhere are left as they are.

The compiled code serves every layer (their parameters are its inputs), so every layer must keep
the layout: :func:`rehome` does all of them; weights updated in place (``copy_``, an optimizer's
step, ``load_state_dict``) keep it, and a parameter re-pointed at another tensor (``p.data = t``)
is moved back before the engine's next model call (:meth:`Projections.keep`: Dynamo's guards do
not see it, and the joined linear would read past the new tensor). The CUDA graphs read the
weights at the addresses they were captured with: the engine captures them again when a weight
moved (``LLM._ready``, before each call).
"""
from __future__ import annotations

import copy
import logging
import operator
from dataclasses import dataclass

import torch
from torch._dynamo.exc import RestartAnalysis

log = logging.getLogger(__name__)

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # transformers' names
LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)


@dataclass
class Projections:
    """The projection groups :func:`rehome` moved (``groups``: tuples of ``nn.Linear``) and the
    addresses their parameters had then (``ptrs``)."""
    groups: list
    ptrs: list

    @staticmethod
    def params(group) -> list:
        """The group's parameter runs that lie end to end: its weights, and its biases if any."""
        runs = [[m.weight for m in group]]
        return runs + [[m.bias for m in group]] if group[0].bias is not None else runs

    def addresses(self) -> list:
        return [p.data_ptr() for g in self.groups for run in self.params(g) for p in run]

    def keep(self) -> int:
        """Puts back end to end each group whose parameters were re-pointed since (``p.data = t``;
        the joined linears of the compiled graphs read a group's weights as one buffer, from the
        first one's start: apart, they would read past its end). In-place updates keep the layout.
        -> the groups moved again."""
        if self.addresses() == self.ptrs:  # (the usual case: ~0.3 us a parameter)
            return 0
        moved = [g for g in self.groups if not all(_end_to_end(run) for run in self.params(g))]
        for g in moved:
            _join(g)
        self.ptrs = self.addresses()
        return len(moved)


def rehome(layers: torch.nn.ModuleList) -> Projections:
    """Puts each module's ``GROUPS`` of plain ``nn.Linear`` children (same input width, dtype,
    device; all with a bias or none) end to end in one buffer, where they are not already (a second
    engine on the same model must not move the weights the first one's CUDA graphs read). -> the
    groups so laid out."""
    groups = []
    for module in (m for layer in layers for m in layer.modules()):
        for names in GROUPS:
            lins = tuple(getattr(module, n, None) for n in names)
            if not all(type(m) is torch.nn.Linear for m in lins):
                continue
            ws = [m.weight for m in lins]
            if len({(w.shape[1], w.dtype, w.device) for w in ws}) != 1 or len({m.bias is None for m in lins}) != 1 \
                    or ws[0].device.type == "meta":
                continue
            if not all(_end_to_end(run) for run in Projections.params(lins)):
                _join(lins)  # (a group already joined stays where it is: another engine's graphs read it there)
            groups.append(lins)
    proj = Projections(groups, [])
    proj.ptrs = proj.addresses()
    return proj


def _join(group) -> None:
    """The group's weights (and biases) copied into one buffer each, end to end; each parameter a view of its part."""
    for run in Projections.params(group):
        with torch.inference_mode(False):  # (a normal tensor: the model may train after)
            buf = torch.cat([p.detach() for p in run])
        at = 0
        for p in run:
            p.data = buf[at: at + p.shape[0]]
            at += p.shape[0]


def _end_to_end(ts) -> bool:
    """Whether tensors ``ts`` (all but the first dim alike, contiguous) follow each other in one storage."""
    a = ts[0]
    if not all(isinstance(t, torch.Tensor) and t.is_contiguous() and t.dtype == a.dtype and t.device == a.device
               and t.shape[1:] == a.shape[1:] for t in ts):
        return False
    if isinstance(a, torch._subclasses.FakeTensor):
        return False
    ptr = a.untyped_storage().data_ptr()
    at = a.storage_offset()
    for t in ts:
        if t.untyped_storage().data_ptr() != ptr or t.storage_offset() != at:
            return False
        at += t.numel()
    return True


def _operands(node):
    args = list(node.args) + [None] * (3 - len(node.args))
    return args[0], node.kwargs.get("weight", args[1]), node.kwargs.get("bias", args[2])


def fuse_linears(gm: torch.fx.GraphModule, example_inputs) -> int:
    """Rewrites ``gm`` (a Dynamo graph; ``example_inputs`` its placeholders' values): each run of
    linear calls on one input whose weights (and biases) are placeholders end to end in one storage
    becomes one linear and a split. -> the number of runs fused."""
    value = {n: t for n, t in zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs)}
    by_input = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in LINEARS:
            x, w, b = _operands(n)
            if w in value and (b is None or b in value):
                by_input.setdefault(x, []).append(n)
    runs = []
    for calls in by_input.values():
        run = calls[:1]
        for n in calls[1:] + [None]:  # (None closes the last run)
            if n is not None and _joins(run + [n], value):
                run.append(n)
                continue
            if len(run) > 1:
                runs.append(run)
            run = [n]
    for run in runs:
        _fuse(gm.graph, run, value)
    if runs:
        gm.graph.lint()
        gm.recompile()
    return len(runs)


def _joins(run, value) -> bool:
    """Whether the linear calls ``run`` can be one: weights end to end, biases none or end to end."""
    bs = [_operands(n)[2] for n in run]
    if any(b is None for b in bs) and not all(b is None for b in bs):
        return False
    return _end_to_end([value[_operands(n)[1]] for n in run]) and (
        bs[0] is None or _end_to_end([value[b] for b in bs]))


def _fuse(graph, run, value) -> None:
    """One linear over the run's weights (a view from the first one's start), split into the run's outputs."""
    ws = [value[_operands(n)[1]] for n in run]
    sizes = [w.shape[0] for w in ws]
    rows, k = sum(sizes), ws[0].shape[1]
    x, w0, b0 = _operands(run[0])
    with graph.inserting_before(run[0]):
        w = graph.call_function(torch.as_strided, (w0, (rows, k), (k, 1)))
        b = None if b0 is None else graph.call_function(torch.as_strided, (b0, (rows,), (1,)))
        y = graph.call_function(torch._C._nn.linear, (x, w, b))
        parts = graph.call_function(torch.split, (y, sizes, -1))
        outs = [graph.call_function(operator.getitem, (parts, i)) for i in range(len(run))]
    for n, out in zip(run, outs):
        n.replace_all_uses_with(out)
        graph.erase_node(n)


def fusing(backend):
    """A torch.compile backend: ``backend`` (a name or a callable) on the graph with :func:`fuse_linears`
    applied, or on the graph as captured where the fused one fails to compile (logged once)."""
    inner = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend

    def compile_fn(gm, example_inputs):
        fused = copy.deepcopy(gm)
        if not fuse_linears(fused, example_inputs):
            return inner(gm, example_inputs)
        try:
            return inner(fused, example_inputs)
        except RestartAnalysis:  # Dynamo's signal to capture again (e.g. a float made dynamic once
            raise                # seen with two values, then specialized): not a failure to fall back from
        except Exception as e:  # noqa: BLE001 - the graph as captured still compiles
            log.warning("fused projections did not compile (%s: %s); this layer graph runs them apart",
                        type(e).__name__, str(e).strip().split("\n")[0])
            return inner(gm, example_inputs)
    return compile_fn
