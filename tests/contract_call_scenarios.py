"""Contract scenarios on how the wrapped model is called (contract_scenarios.py): `model(x)` in a
plain loop, as the README shows it, against `engine(x)`. Both run the engine's forward bracket
(engine_forward.py): at stage 3 a chunk released in forward is kept by reference for backward, not
held by the tensors autograd saved; the model called as itself held every one of them from forward
to backward (the whole model, where engine(x) holds its rCache). So did a loop calling the model's
modules directly (`through_layers`), until every module holding parameters opened the bracket too.
"""
from __future__ import annotations

import torch

import zeroshard
from zeroshard.runtime.chunks import Chunk
from models import max_diff

SCENARIOS = {}
LAYERS, WIDTH = 6, 32


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def through_layers(model, x):
    """The model's forward, written in the loop: each layer called directly, not the model."""
    for layer in model.layers:
        x = torch.tanh(layer(x))
    return x


class ReleasedStorages:
    """Inside it, weak references to the storage of every chunk released (Chunk.release) since
    `clear`: how many are still alive says what autograd's saved tensors hold of them."""

    def __init__(self):
        self.refs = []
        self._release = Chunk.release

    def __enter__(self):
        release = self._release

        def recording(chunk, *args, **kwargs):
            if chunk.full is not None:
                self.refs.append(chunk.full.untyped_storage()._weak_ref())
            return release(chunk, *args, **kwargs)
        Chunk.release = recording
        return self

    def __exit__(self, *exc):
        Chunk.release = self._release  # the rank goes on to other scenarios
        self.clear()

    def alive(self) -> int:
        return sum(not torch.UntypedStorage._expired(r) for r in self.refs)

    def clear(self) -> None:
        for r in self.refs:
            torch.UntypedStorage._free_weak_ref(r)
        self.refs = []


def called_as_itself(rank, world):
    """Stage 3, one layer a chunk, a 1-chunk rCache: 3 steps through `engine(x)`, 3 through
    `model(x)` and 3 through its layers called directly, SGD with momentum against plain torch on the global batch; at each step's end of
    forward, the chunks released in that forward that are still alive."""
    g = torch.Generator().manual_seed(4)
    data = torch.randn(3, world, 4, WIDTH, generator=g)
    ref = Stack()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in data:
        ref(step.reshape(-1, WIDTH)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    out = {}
    with ReleasedStorages() as released:
        for how in ("engine", "model", "layers"):
            out[how] = _train(how, rank, data, ref, released)
    return out


def _train(how, rank, data, ref, released) -> dict:
    model = Stack()
    engine = zeroshard.initialize(model, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                  {"stage": 3, "chunk_size": WIDTH * WIDTH + WIDTH, "cache_chunks": 1})
    call = {"engine": engine, "model": model, "layers": lambda x: through_layers(model, x)}[how]
    alive = []
    for step in data:
        released.clear()
        y = call(step[rank])
        alive.append(released.alive())
        y.pow(2).mean().backward()
        engine.step()
    return {"diff": max_diff(engine.full_state_dict(), ref.state_dict()), "alive": alive,
            "chunks": len(engine.chunks), "recording": engine.cache.recording}


SCENARIOS["called_as_itself"] = called_as_itself
