"""Estimate: model-state bytes per device for ZeRO stages 0-3, with and without offload, before
anything is built (the ZeRO paper's section 5 and Table 1).

Per parameter, in bytes (p, g, k: docs/vocabulary.md):
- p: one copy of the parameters in the compute dtype (2 for bf16/fp16, 4 for fp32);
- g: one copy of the gradients, in the compute dtype;
- k: the optimizer's own bytes: its states (Adam 8, SGD with momentum 4, plain SGD 0) plus, in
  16-bit training, the fp32 master copy (4). Mixed-precision Adam has k = 12, as in the paper.

What each stage keeps per rank, Psi parameters over N ranks (zeroshard's runtime keeps exactly this,
padding aside; `telemetry.stats.chunk_state_bytes` counts it):
- stage 0: (p + g + k) Psi; stage 1: (p + g) Psi + k Psi / N; stage 2: p Psi + (g + k) Psi / N;
  stage 3: (p + g + k) Psi / N.
- with tensor (model) parallelism of degree MP beside the N data-parallel ranks, each rank holds
  1/MP of every parameter, so every figure above is divided by MP (the paper's Table 2).
- offload "optimizer" (offload_optimizer) moves k to the host, and from stage 2 the gradient shard
  too (stages 1: the full gradient stays on the device, its owned slice is copied down); "params"
  (offload_params, stage 3) moves the parameter shard. Buffers of the stage-3 cache, activations and the
  allocator's slack are not model states and are not counted.
- offload "disk" (offload_optimizer='disk', the disk tier) keeps the host's share of "optimizer"
  but its optimizer states and fp32 master (4 bytes even in fp32 training: the compute copy is not
  written to disk) on disk: (k_states + 4) Psi / N there; the host keeps the gradient shard. The
  tier's few host frames (runtime/disk_tier.py) are buffers, not model states. "disk+params"
  keeps the parameter shard on the host as "params" does; "disk+params-on-disk" (offload_params=
  'disk', stage 3) puts it on disk too: p Psi / N more there, none on the host.

Activation checkpoints (ZeRO-R, the paper's sections 6.1 and 8): a transformer checkpointed at each
block's input keeps layers x batch x seq x hidden values per rank. Tensor parallelism replicates
them on its MP ranks; P_a partitions each across them (1/MP per rank), P_a+cpu keeps that part in
host memory. Communication per step, in elements (the paper's accounting): Megatron's MP with
checkpointing all-reduces 12 x batch x seq x hidden per block (two all-reduces each in forward,
recomputation and backward, an all-reduce counting twice its message), P_a adds one all-gather of
the block's checkpoint (batch x seq x hidden); ZeRO's data parallelism moves 2 Psi / MP per rank at
stages 0-2 and 3 Psi / MP at stage 3.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from ..errors import ConfigError

OPTIMIZER_BYTES = {"adam": 8, "sgd-momentum": 4, "sgd": 0}
COMPUTE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
PARAMS_ON_DISK = "disk+params-on-disk"
OFFLOADS = ("none", "optimizer", "params", "optimizer+params", "disk", "disk+params", PARAMS_ON_DISK)


@dataclass(frozen=True)
class Estimate:
    """Model-state bytes per rank, on the device and on the host."""

    stage: int
    offload: str  # one of OFFLOADS
    device: float
    host: float
    disk: float = 0.0


def per_param(stage: int, world: int, precision: str = "bf16", optimizer: str = "adam",
              offload: str = "none", mp: int = 1) -> tuple[float, float]:
    """(device, host) bytes per parameter of the model on one rank: `world` data-parallel ranks,
    each parameter split over `mp` tensor-parallel ranks."""
    if not isinstance(mp, int) or mp < 1:
        raise ConfigError(f"mp (the tensor-parallel degree) must be an integer >= 1, got {mp!r}")
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"stage must be 0-3, got {stage}")
    if offload not in OFFLOADS:
        raise ConfigError(f"offload must be one of {', '.join(map(repr, OFFLOADS))}, got {offload!r}")
    if offload != "none" and stage == 0:
        raise ConfigError("offload needs stage >= 1")
    if "params" in offload and stage != 3:
        raise ConfigError("offloading parameters needs stage 3")
    p = g = COMPUTE_BYTES[precision]
    k = OPTIMIZER_BYTES[optimizer] + (4 if precision != "fp32" else 0)
    n = world
    params = p / n if stage == 3 else p
    grads = g / n if stage >= 2 else g
    opt = k / n if stage >= 1 else k
    device, host = params + grads + opt, 0.0
    if "optimizer" in offload or "disk" in offload:
        device -= opt
        host += 0.0 if "disk" in offload else opt  # the disk tier's share: disk_per_param
        if stage >= 2:  # the reduced gradient shard goes to the host with the optimizer
            device -= grads
            host += grads
        else:  # stages 0-1 keep the full gradient on the device; its owned slice is copied down
            host += g / n
    if "params" in offload:
        device -= params
        host += 0.0 if offload == PARAMS_ON_DISK else params
    return device / mp, host / mp


def disk_per_param(stage: int, world: int, precision: str = "bf16", optimizer: str = "adam",
                   offload: str = "none", mp: int = 1) -> float:
    """Bytes per parameter in the disk tier on one rank (before dividing by `mp`, as per_param's
    figures are before their last step): the fp32 master and the optimizer states of its shard
    (and with "disk+params-on-disk", the parameter shard)."""
    shard = COMPUTE_BYTES[precision] / world if offload == PARAMS_ON_DISK else 0.0
    return (OPTIMIZER_BYTES[optimizer] + 4) / world + shard if "disk" in offload else 0.0


def estimate(params: float, stage: int, world: int, **kw) -> Estimate:
    """Model-state bytes per rank for `params` parameters."""
    d, h = per_param(stage, world, **kw)
    mp = kw.get("mp", 1)
    disk = disk_per_param(stage, world, **{k: v for k, v in kw.items() if k != "mp"}) / mp
    return Estimate(stage, kw.get("offload", "none"), d * params, h * params, disk * params)


def activation_checkpoint_bytes(layers: int, batch: int, seq: int, hidden: int, precision: str = "bf16",
                                mp: int = 1, partitioned: bool = False, on_host: bool = False) -> tuple[float, float]:
    """(device, host) bytes of activation checkpoints per rank for a transformer checkpointed at
    each block's input: replicated on the `mp` tensor-parallel ranks, or with P_a (`partitioned`)
    1/mp each, on the host with P_a+cpu (`on_host`)."""
    if on_host and not partitioned:
        raise ConfigError("P_a+cpu offloads the partitioned checkpoints: on_host needs partitioned")
    total = layers * batch * seq * hidden * COMPUTE_BYTES[precision]
    mine = total / mp if partitioned else total
    return (0.0, mine) if on_host else (mine, 0.0)


def communication_per_step(params: float, stage: int, mp: int, layers: int, batch: int, seq: int,
                           hidden: int, partitioned: bool = False) -> dict[str, float]:
    """Elements each rank moves per optimizer step of one micro-batch, as the paper counts them:
    'mp' (Megatron's all-reduces with checkpointing; 0 without tensor parallelism), 'p_a' (P_a's
    all-gathers) and 'dp' (ZeRO's data-parallel traffic for this rank's 1/mp of the model)."""
    block = batch * seq * hidden
    return {"mp": 12.0 * block * layers if mp > 1 else 0.0,
            "p_a": float(block * layers) if partitioned and mp > 1 else 0.0,
            "dp": (3 if stage == 3 else 2) * params / mp}


def load_host_bytes(params: float, largest: float | None, ranks_per_node: int, meta: bool) -> float | None:
    """Host bytes per node while the model is built and its weights loaded, beyond its model states
    (materialize.py, pretrained.py). Built normally, every rank holds the whole model as built, in
    fp32: 4 * params per rank (DeepSpeed's estimator without zero.Init says the same). Built on the
    meta device, a rank holds one tensor at a time beside its states: at most the largest, whole and
    in fp32, while an initialiser fills it (a stage-3 rank loading pretrained weights reads only its
    1/N of it, in 16 MiB blocks): 4 * largest per rank. None when the largest tensor is unknown."""
    if not meta:
        return 4 * params * ranks_per_node
    return None if largest is None else 4 * largest * ranks_per_node


def largest_model(device_bytes: float, stage: int, world: int, **kw) -> float:
    """The most parameters whose model states fit in `device_bytes` per device (activations and
    buffers not counted); inf when nothing stays on the device."""
    d, _ = per_param(stage, world, **kw)
    return math.inf if d == 0 else device_bytes / d


# -- the paper's tables, rounded as the paper rounds ------------------------------------------------
TABLE1_MODELS = (7.5e9, 128e9, 1e12)
TABLE1_WORLDS = (1, 4, 16, 64, 256, 1024)


def paper_gb(x: float) -> str:
    """Table 1's rounding of a size in GB (1e9 bytes): below 10, two decimals; below 100, one
    decimal (half up); from 100, whole GB, truncated. Trailing zeros dropped. (Read off the table:
    41.25 -> 41.3, 1.875 -> 1.88, 0.46875 -> 0.47, 513.5 -> 513, 4187.5 -> 4187.)"""
    d = Decimal(repr(x))
    if x >= 100:
        return str(int(x))
    q = Decimal("0.01") if x < 10 else Decimal("0.1")
    text = str(d.quantize(q, rounding=ROUND_HALF_UP))
    return text.rstrip("0").rstrip(".") if "." in text else text


def table1() -> list[list[str]]:
    """ZeRO Table 1: per-device model-state GB of P_os, P_os+g, P_os+g+p (stages 1-3), mixed-precision
    Adam, for 7.5B, 128B and 1T parameters over DP degrees 1-1024. Rows: [DP, 9 cells]."""
    return [[str(n)] + [paper_gb(estimate(psi, stage, n).device / 1e9) for psi in TABLE1_MODELS for stage in (1, 2, 3)]
            for n in TABLE1_WORLDS]


def table2() -> list[list[str]]:
    """ZeRO Table 2, theoretical columns: the largest model that fits 32 GB V100s at 64-way data
    parallelism times an MP degree of 1-16 (MP splits the model, so the size scales with it).
    Rows: [MP, GPUs, baseline, P_os, P_os+g, P_os+g+p]. The paper rounds the MP-1 size to 0.1B and
    scales that; from 512B it writes T = 1024B."""
    out = []
    for mp in (1, 2, 4, 8, 16):
        row = [str(mp), str(64 * mp)]
        for stage in (0, 1, 2, 3):
            base = round(largest_model(32e9, stage, 64) / 1e9, 1)
            b = base * mp
            row.append(f"{b / 1024:g}T" if b >= 512 else f"{b:g}B")
        out.append(row)
    return out
