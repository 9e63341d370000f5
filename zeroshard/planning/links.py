"""Planning past one node: two link classes, and the three stage-3 layouts that use them
differently (full sharding, HSDP at the node, hpZ at the node). `zeroshard plan MODEL --nodes ...`
prints `compare`'s table; the runtime side is distributed/shard_groups.py.

The link model (per GPU, per optimizer step; Psi parameter elements, W = nodes x GPUs per node
ranks, G = GPUs per node, k micro-batches per step, e bytes per element in the compute dtype):

- Two link classes. Inside a node each GPU moves `intra` bytes/s of collective bus bandwidth
  (NVLink); a collective whose group spans nodes runs at `inter` bytes/s per GPU (the GPU's share
  of the node's network: a ring or tree across nodes is bound by it, whatever the NVLink). Nothing
  else is shared: the node's G GPUs drive their own collectives at the same time.
- A collective over n ranks that the ZeRO paper counts as V elements (all-gather, reduce-scatter:
  the full size M; all-reduce: 2M) takes V e (n-1)/n / B, plus a latency of `latency` x
  ceil(log2 n) per collective (tree- or PAT-like schedules; one collective per chunk of
  `chunk_elements`). B and the latency are the node's when the group lies in one node.
- The rCache: either every chunk stays gathered from its first gather to the step (Psi e more
  bytes per GPU; the runtime with cache_chunks=None), or two chunks are (each micro-batch
  gathers every chunk in forward and again in backward: `regather`). Each layout is predicted
  both ways and keeps the faster that fits.
- Volumes per rank (elements; the runtime's counts in tests/test_hybrid.py equal these with
  every chunk cached and k = 1):
    full sharding: over W: gathers 2k Psi (regather; else Psi), reduce-scatters k Psi.
    HSDP:          over G: the same; across the replica groups (W/G ranks, one per node): the
                   all-reduce of the 1/G gradient shard at the step, 2 Psi / G.
    hpZ:           over W: the first gather Psi and the reduce-scatters k Psi; over G: the
                   other gathers, (2k - 1) Psi (regather; else 0), from the secondary shards.
- Time: compute = flops per token per parameter (6; 8 with activation checkpointing) x Psi x
  the rank's tokens / `flops`; the gathers and reduce-scatters overlap compute (prefetch), the
  HSDP all-reduce does not (the runtime issues it blocking at the step); the optimizer steps
  the rank's shard at `adam` elements/s. Step = max(compute, overlapped) + blocking + optimizer.
- Memory per GPU: model states (2 + 2 + K) Psi / W (HSDP: / G; hpZ: + 2 Psi / G for the
  secondary shards, in 16 bits), K = 12 for mixed-precision Adam; the rCache (the whole model, or
  two chunks) and one chunk's gradient buffer; activations when the transformer's shape is known
  (checkpointing: one hidden-state checkpoint per layer, plus one layer's working set, 34 s b h
  bytes: Korthikanti et al.'s count without the attention scores, which fused attention never
  keeps); the driver's reserve. It fits when all but the reserve is within 95% of the rest.
- The global batch (tokens per step) stays fixed as nodes are added: k = the micro-batches each
  rank runs to reach it (at least 1: past W x micro-batch x sequence length the batch grows).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from ..errors import ConfigError

LAYOUTS = ("full sharding", "HSDP (node)", "hpZ (node)")
FRAGMENTATION = 0.95


@dataclass(frozen=True)
class Links:
    """The cluster: GPUs per node and the two link classes (bytes/s per GPU, seconds per hop)."""
    gpus_per_node: int = 8
    intra: float = 300e9
    inter: float = 25e9
    intra_latency: float = 5e-6
    inter_latency: float = 20e-6

    def collective(self, elements: float, ranks: int, elem_bytes: int, chunk_elements: int,
                   spans_nodes: bool) -> float:
        """Seconds for collectives of `elements` (the ZeRO count) over groups of `ranks`."""
        if ranks <= 1 or elements <= 0:
            return 0.0
        bw, lat = (self.inter, self.inter_latency) if spans_nodes else (self.intra, self.intra_latency)
        count = math.ceil(elements / chunk_elements)
        return elements * elem_bytes * (ranks - 1) / ranks / bw + count * lat * math.ceil(math.log2(ranks))


@dataclass(frozen=True)
class Job:
    """What trains: Psi parameters, a global batch of tokens, and each GPU's figures."""
    params: float
    gpu_memory: float = 80e9
    flops: float = 400e12  # achieved matmul flop/s per GPU in the compute dtype
    adam: float = 50e9  # optimizer elements/s per GPU
    global_tokens: int = 4 * 2**20
    seq_len: int = 4096
    micro_batch: int = 1  # sequences per micro-batch per GPU
    checkpointing: bool = True
    layers: int | None = None
    hidden: int | None = None
    elem_bytes: int = 2  # compute dtype
    optimizer_bytes: int = 12  # K: fp32 master and Adam's two moments
    chunk_elements: int = 2**27
    reserve: float = 2 * 2**30


@dataclass
class Prediction:
    """One layout at one scale: bytes per GPU, seconds per step, and the volumes behind them."""
    layout: str
    nodes: int
    world: int
    accumulation: int
    regather: bool  # a two-chunk rCache; False: every chunk stays gathered until the step
    state_bytes: float
    transient_bytes: float
    activation_bytes: float | None
    reserve: float
    gpu_memory: float
    compute_s: float
    overlapped_s: float
    blocking_s: float
    optimizer_s: float
    volumes: dict = field(default_factory=dict)  # elements per rank and step: {"W": .., "G": .., "replicas": ..}
    across_elements: float = 0.0  # of those, what crosses nodes

    @property
    def device_bytes(self) -> float:
        return self.state_bytes + self.transient_bytes + (self.activation_bytes or 0.0) + self.reserve

    @property
    def fits(self) -> bool:
        return self.device_bytes - self.reserve <= FRAGMENTATION * (self.gpu_memory - self.reserve)

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.overlapped_s) + self.blocking_s + self.optimizer_s


def volumes(layout: str, psi: float, world: int, group: int, accumulation: int, regather: bool) -> dict:
    """Elements per rank and step over each group kind: "W" (every rank), "G" (a node's ranks),
    "replicas" (HSDP's replica groups), as the ZeRO paper counts them (the module docstring)."""
    k = accumulation
    gathers = 2 * k * psi if regather else psi
    if layout == "full sharding" or group >= world:
        return {"W": gathers + k * psi, "G": 0.0, "replicas": 0.0}
    if layout == "HSDP (node)":
        return {"W": 0.0, "G": gathers + k * psi, "replicas": 2 * psi / group}
    if layout == "hpZ (node)":
        return {"W": psi + k * psi, "G": gathers - psi, "replicas": 0.0}
    raise ConfigError(f"unknown layout {layout!r}; one of {LAYOUTS}")


def predict(layout: str, nodes: int, job: Job, links: Links, regather: bool) -> Prediction:
    """`layout` on `nodes` nodes of `links.gpus_per_node` GPUs, with a two-chunk rCache
    (`regather`) or every chunk kept gathered."""
    g = links.gpus_per_node
    world = nodes * g
    psi, e = job.params, job.elem_bytes
    k = max(1, math.ceil(job.global_tokens / (world * job.micro_batch * job.seq_len)))
    vol = volumes(layout, psi, world, g, k, regather)
    sharded_over = g if layout == "HSDP (node)" else world
    states = (2 + 2 + job.optimizer_bytes) * psi / sharded_over
    if layout == "hpZ (node)" and g < world:
        states += e * psi / g
    chunk = min(job.chunk_elements, psi)
    transient = (2 * chunk if regather else psi) * e + chunk * e
    acts = None
    if job.layers and job.hidden:
        sbh = job.seq_len * job.micro_batch * job.hidden
        acts = (job.layers * sbh * e if job.checkpointing else 0) + 34 * sbh * (1 if job.checkpointing else job.layers)
    tokens = k * job.micro_batch * job.seq_len
    compute = (8 if job.checkpointing else 6) * psi * tokens / job.flops
    spans = world > g
    t_world = links.collective(vol["W"], world, e, job.chunk_elements, spans)
    t_node = links.collective(vol["G"], min(g, world), e, job.chunk_elements, False)
    t_replicas = links.collective(vol["replicas"], world // g, e, max(1, 2 * job.chunk_elements // g), True)
    across = vol["W"] * (1 if spans else 0) + vol["replicas"]
    return Prediction(layout, nodes, world, k, regather, states, transient, acts, job.reserve, job.gpu_memory, compute,
                      t_world + t_node, t_replicas, psi / sharded_over / job.adam, vol, across)


def compare(nodes: list[int], job: Job, links: Links) -> list[tuple[list[Prediction], Prediction | None]]:
    """At each node count, every layout's prediction (with the rCache that makes it fastest while
    fitting; when neither fits, the smaller) and the pick: the fastest step that fits (ties: the
    fewest bytes), or None."""
    out = []
    for n in nodes:
        preds = [min((predict(layout, n, job, links, regather) for regather in (False, True)),
                     key=lambda p: (0, p.step_s) if p.fits else (1, p.device_bytes)) for layout in LAYOUTS]
        fitting = [p for p in preds if p.fits]
        out.append((preds, min(fitting, key=lambda p: (round(p.step_s, 6), p.device_bytes)) if fitting else None))
    return out
