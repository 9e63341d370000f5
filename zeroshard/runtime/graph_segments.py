"""Graph segments (words: docs/vocabulary.md): a forward compiled whole at stages 0-2, its graph cut
where about one chunk of trainable parameters has been used, each segment compiled on its own.

Note: graph segments. A forward compiled as one graph runs its backward as one autograd node, so
every parameter's gradient arrives at the backward's end: no chunk's reduction can start while
the backward computes (on a GPU nothing overlaps the reductions), and the whole model's gradient
exists at once beside the chunks' buffers (at stage 2, whose model states are 2Ψ + 14Ψ/N bytes,
another 4Ψ of fp32 gradient for a moment). Cut into segments of about one chunk's elements, each
segment's backward is a node of its own: its gradients arrive as it ends, the chunks they complete
are reduced while the earlier segments' backward runs, as in eager mode or with each layer block
compiled, and about one chunk of fresh gradient lives at a time. The cut is torch's DDPOptimizer
(torch/_dynamo/backends/distributed.py, what DDP + torch.compile cuts its graph with at its
buckets): it walks the graph backwards and starts a segment once the trainable parameters counted
reach the cap. It counts a parameter's storage, which for a view of a chunk is the whole chunk, so
here each counts its own elements (_Cutter). A segment's end need not fall on a chunk's: a chunk is
reduced once its last gradient arrived, whichever segment brings it.

Measured (gpt2-small-cpu, seven chunks, 2 ranks on 2 cores, compiled stage 0, 120 interleaved
steps, step time vs DDP + compile): each block compiled 1.011, whole in segments 0.988, whole in
one graph 0.969 (a prototype of this cut, outside the package). On two shared cores the
reductions' overlap is worth less than a segment boundary costs (the reductions' gloo threads take
the cores from the compute); on a GPU the overlap is the point, and the one graph's extra gradient
memory is what stage 2 exists to avoid: segments wherever a model of several trainable chunks is
compiled whole.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch


# torch.compile reads these options itself, before its backend sees them: a compile naming them is
# left whole (compile_in_segments)
_OPTIONS_FOR_TORCH_COMPILE = ("guard_filter_fn", "use_aoti")


def compile_in_segments(compile_kwargs: dict, elements: int) -> Callable | None:
    """A compiler like torch.compile(**compile_kwargs) (a callable: function -> compiled function)
    whose graphs are cut into segments of about `elements` trainable elements (Note: graph
    segments); the backend, mode and options compile each segment, as torch.compile would have
    compiled the whole graph. None for options torch.compile reads itself (_OPTIONS_FOR_TORCH_COMPILE)."""
    kwargs = dict(compile_kwargs)
    backend, mode, options = kwargs.pop("backend", None), kwargs.pop("mode", None), kwargs.pop("options", None)
    if options and any(k in options for k in _OPTIONS_FOR_TORCH_COMPILE):
        return None
    if backend is None:
        from torch._dynamo.backends.registry import get_default_backend
        backend = get_default_backend()
    if mode is None and options is None:
        mode = "default"
    dynamic = kwargs.get("dynamic")
    # What torch.compile wraps its backend in (torch/__init__.py)
    inner = torch._TorchCompileInductorWrapper(mode, options, dynamic) if backend == "inductor" else \
        torch._TorchCompileWrapper(backend, mode, options, dynamic)
    cutter = _cutter()(elements, inner, first_bucket_cap=elements)
    return functools.partial(torch.compile, backend=cutter.compile_fn, **kwargs)


@functools.cache
def _cutter() -> type:
    """DDPOptimizer counting each parameter's own elements (Note: graph segments); the class is made
    on first use, so importing zeroshard imports no dynamo."""
    from torch._dynamo.backends.distributed import DDPOptimizer

    class _Cutter(DDPOptimizer):
        def add_param(self, bucket, param, name: str) -> None:
            bucket.size += param.numel()
            bucket.params.append(name)
            bucket.param_ids.append(id(param))
    return _Cutter

