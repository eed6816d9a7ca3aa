"""The model's small ops fused by ``torch.compile``, our attention left as it is.

A decode step of 64 rows spends most of its GPU time outside attention and the GEMMs: each
decoder layer runs its norms (7 kernels each in transformers' RMSNorm), RoPE (slices, negations,
concatenations), casts and residual adds as separate 1-3 us kernels (SmolLM2 shape, H200: ~1.6 ms
of a 2.8 ms cascade step, ``benchmarks/results/sweeps/engine_step_profile_cascade_graphs_h200.txt``).
:class:`CompiledForward` compiles each decoder layer with the attention function
(``hf_attention.paged_attention``) as a graph break - it is ``torch.compiler.disable``-d - so
Inductor fuses what lies between two attention calls and our kernels, plans and K/V writes run as
they do eagerly; the CUDA graphs then capture the fused kernels. One compiled code serves every
layer of a model (their parameters are inputs); a new batch size is compiled once with dynamic
shapes. Compiling happens in the first runs of each shape (the graphs' warm-ups), never inside a
capture.

The decoder's own small modules that run once a forward - its final norm and rotary embeddings
(:func:`decoder_parts`) - are compiled the same way: eagerly the final RMSNorm is 8 kernels (a
9 us mean over 64 rows among them) and the cos/sin tables 10, ~50 us of an 8B-shaped decode step
on the H200 with their gaps; compiled, one kernel each.

Each layer's q/k/v and gate/up projections run as one GEMM each (:mod:`.fused_linears`: their
weights moved end to end in one buffer, the compiled graphs' linear calls joined).

The user's model keeps its modules, parameters and values (only where the projections' weights
live changes): the compiled calls are put on its layers only while the engine runs it (a
``model.generate`` of the same model object afterwards runs its plain layers). A model that
torch.compile cannot compile still runs: the first failure is logged and the layers run uncompiled
from then on.
"""
from __future__ import annotations

import contextlib
import logging

import torch
from torch._dynamo.exc import TorchDynamoException

from .fused_linears import fusing, rehome

log = logging.getLogger(__name__)


def decoder_layers(model: torch.nn.Module):
    """The model's decoder layers (an ``nn.ModuleList``), or None where they are not where
    transformers' decoder-only models keep them (``model.get_decoder().layers``)."""
    get = getattr(model, "get_decoder", None)
    layers = getattr(get() if callable(get) else None, "layers", None)
    return layers if isinstance(layers, torch.nn.ModuleList) and len(layers) else None


def decoder_parts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules the decoder (``model.get_decoder()``) runs once a forward outside its layers and
    keeps as attributes of these names: its final norm (``norm``) and rotary embeddings
    (``rotary_emb``; Gemma 3's ``rotary_emb_local`` too). The embedding is a gather: nothing to fuse."""
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    parts = (getattr(decoder, name, None) for name in ("norm", "rotary_emb", "rotary_emb_local"))
    return [m for m in parts if isinstance(m, torch.nn.Module)]


class CompiledForward:
    """Calls ``model(**kwargs)`` with each decoder layer and :func:`decoder_parts` module compiled
    (``backend``: a ``torch.compile`` backend, a name or a callable; tests use ``"aot_eager"``).

    Each module's compiled call is what ``nn.Module.compile`` would set (``_compiled_call_impl``,
    which ``nn.Module.__call__`` runs in place of the plain call), set here only for the duration of
    a call and restored after it. ``failed``: the error that made them run uncompiled (a call
    whose compiling failed runs again uncompiled: its K/V writes are the same), or None.
    ``projections``: the projection groups whose weights now lie end to end (joined in the compiled
    graphs), put back end to end before a call where a parameter was re-pointed since."""

    def __init__(self, model: torch.nn.Module, layers: torch.nn.ModuleList, backend="inductor"):
        self.model = model
        self.modules = [*layers, *decoder_parts(model)]  # what runs compiled: the layers, the decoder's parts
        self.projections = rehome(layers)
        backend = fusing(backend)  # (one callable for every layer: Dynamo recompiles for another backend)
        self.calls = [torch.compile(m._call_impl, backend=backend, dynamic=None) for m in self.modules]
        self.failed: Exception | None = None

    @classmethod
    def of(cls, model: torch.nn.Module, backend="inductor"):
        """-> a CompiledForward of ``model``, or the model itself where it keeps no decoder layers
        at ``get_decoder().layers`` (nothing compiled, a warning logged)."""
        layers = decoder_layers(model)
        if layers is None:
            log.warning("torch.compile skipped: %s keeps no decoder layers at get_decoder().layers", type(model).__name__)
            return model
        return cls(model, layers, backend)

    def __call__(self, **kwargs):
        if self.failed is None:
            self.projections.keep()
            try:
                with self.active():
                    return self.model(**kwargs)
            except TorchDynamoException as e:  # (our attention's own errors are not Dynamo's: they pass)
                self.failed = e
                cause = getattr(e, "inner_exception", None) or e  # (a backend's own error, as it raised it)
                log.warning("torch.compile failed on %s's decoder layers, which run uncompiled from now on: %s: %s",
                            type(self.model).__name__, type(cause).__name__, str(cause).strip().split("\n")[0])
        return self.model(**kwargs)

    @contextlib.contextmanager
    def active(self):
        """The compiled calls in place (those of an enclosing call kept and restored)."""
        saved = [m._compiled_call_impl for m in self.modules]
        for m, call in zip(self.modules, self.calls):
            m._compiled_call_impl = call
        try:
            yield
        finally:
            for m, call in zip(self.modules, saved):
                m._compiled_call_impl = call
