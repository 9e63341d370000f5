"""Scenarios of tests/test_tensor_parallel.py: a Llama from a transformers config, split by
PyTorch's tensor parallelism over zeroshard.device_mesh(2)["tp"], trained by zeroshard over the
data-parallel dimension; each rank 0 result compared with single-process PyTorch on the global batch."""
from __future__ import annotations

import functools
import math
import os

import torch

from distributed import record
from models import max_diff

STEPS, BATCH, SEQ, VOCAB = 3, 4, 16, 128

SCENARIOS = {  # name -> (stage, optimizer, P_a: None / "on" / "cpu", activation checkpointing)
    "stage0_sgd": (0, "sgd", None, False),
    "stage1_sgd": (1, "sgd", None, False),
    "stage2_sgd": (2, "sgd", None, False),
    "stage3_sgd": (3, "sgd", None, False),
    "stage3_adamw": (3, "adamw", None, False),
    "stage3_cache2": (3, "sgd", None, False),  # an rCache of 2 chunks (BOUNDED_CACHE)
    "stage2_checkpointed": (2, "sgd", None, True),
    "stage2_pa": (2, "sgd", "on", True),
    "stage3_checkpointed": (3, "sgd", None, True),
    "stage3_pa": (3, "sgd", "on", True),
    "stage3_pa_cpu": (3, "sgd", "cpu", True),
    "stage1_pa_cpu_adamw": (1, "adamw", "cpu", True),
    "stage0_clip": (0, "sgd", None, False),
    "stage1_clip_adamw": (1, "adamw", None, False),
    "stage2_clip": (2, "sgd", None, False),
    "stage3_clip": (3, "sgd", None, False),
    "stage3_pa_clip": (3, "sgd", "on", True),
    "stage2_torch_clip": (2, "sgd", None, False),  # torch.nn.utils.clip_grad_norm_ in the loop
    "stage2_delayed_clip": (2, "sgd", None, False),  # the clipping norm agreed in the delayed update's thread
    "stage2_inf_one_tp_rank": (2, "sgd", None, False),  # INF_ON_TP1
}

# nonfinite="skip", and at this step an inf in one split weight's gradient on TP rank 1 alone: every
# rank skips the step (TP rank 0's groups too, whose gradients are finite), or the replicas of a
# replicated parameter would part and TP rank 0 would train a step that TP rank 1 skipped.
INF_ON_TP1 = {"stage2_inf_one_tp_rank": 1}

# Clipped scenarios: the max global L2 norm, below every step's norm (about 1.9 at the start), so
# each step clips; a TP rank clipping by its own shards' norm lands ~1e-4 away.
CLIP = {"stage0_clip": 0.5, "stage1_clip_adamw": 0.5, "stage2_clip": 0.5, "stage3_clip": 0.5,
        "stage3_pa_clip": 0.5, "stage2_torch_clip": 0.5, "stage2_delayed_clip": 0.5}
TORCH_CLIP = {"stage2_torch_clip"}
DELAYED = {"stage2_delayed_clip": 1}  # delay_update_after: step 1 exact, steps 2-3 delayed


BOUNDED_CACHE = {"stage3_cache2": 2}


class SavedByReference:
    """Counts split weights (DTensors viewing a gathered stage-3 chunk) that the saved-tensor hooks
    keep as references, so the chunk can be released between forward and backward."""

    def __init__(self):
        import zeroshard.runtime.saved_tensors as saved
        self.count, self._cls = 0, saved.SplitChunkView
        self._init = self._cls.__init__

        def counted(view, *args):
            self.count += 1
            self._init(view, *args)
        self._cls.__init__ = counted

    def close(self):
        self._cls.__init__ = self._init


class TensorParallelTraffic:
    """Counts the all-reduces DTensor issues (the Megatron side's traffic), in elements as the ZeRO
    paper counts them: an all-reduce of M elements moves 2M."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(mode, func, types, args=(), kwargs=None):
                if func.overloadpacket is torch.ops._c10d_functional.all_reduce:
                    self.count += 1
                    self.elements += 2 * args[0].numel()
                return func(*args, **(kwargs or {}))
        self.mode, self.count, self.elements = Mode(), 0, 0


def llama(checkpointing: bool):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    m = LlamaForCausalLM(cfg)
    if checkpointing:  # reentrant: the checkpoints are saved through saved-tensor hooks (README)
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return m


def tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    col, row = ColwiseParallel, RowwiseParallel
    return {"self_attn.q_proj": col(), "self_attn.k_proj": col(), "self_attn.v_proj": col(),
            "self_attn.o_proj": row(), "mlp.gate_proj": col(), "mlp.up_proj": col(), "mlp.down_proj": row()}


def make_optimizer(kind):
    if kind == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    return lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1)


def data():
    return torch.randint(0, VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def reference(kind: str, clip: float | None = None, norms: list | None = None, skip: int | None = None) -> dict:
    """Single-process PyTorch on the global batch, clipped to `clip` (each step's gradient norm,
    before clipping, appended to `norms`), step `skip` skipped."""
    m = llama(False)
    opt = make_optimizer(kind)(list(m.parameters()))
    for k, x in enumerate(data()):
        m(x, labels=x).loss.backward()
        if k == skip:
            opt.zero_grad()
            continue
        norm = torch.nn.utils.clip_grad_norm_(m.parameters(), math.inf if clip is None else clip)
        if norms is not None:
            norms.append(float(norm))
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in m.state_dict().items()}


def scenario(name, world):
    import zeroshard
    stage, kind, pa, checkpointing = SCENARIOS[name]
    mesh = zeroshard.device_mesh(2)
    m = split_llama(mesh, checkpointing)
    cfg = {"stage": stage, "tensor_parallel": 2, "chunk_size": 5000, "collective_timeout_s": 120,
           "partition_activations": pa is not None, "offload_activations": pa == "cpu",
           "cache_chunks": BOUNDED_CACHE.get(name),
           "clip_grad_norm": None if name in TORCH_CLIP else CLIP.get(name)}
    if name in DELAYED:
        cfg.update(offload_optimizer=True, delay_update_after=DELAYED[name])
    if name in INF_ON_TP1:
        cfg["nonfinite"] = "skip"
    engine = zeroshard.initialize(m, make_optimizer(kind), config=cfg)
    inf_at = INF_ON_TP1.get(name) if mesh["tp"].get_local_rank() == 1 else None
    weight = m.model.layers[1].self_attn.o_proj.weight
    by_reference = SavedByReference()
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    per = BATCH // dp
    figures = {"mp_all_reduces": [], "mp_elements": [], "grad_norms": [], "torch_clip_norms": []}
    timeline = engine.record_memory(steps=1)
    try:
        for k, x in enumerate(data()):
            xb = x[dp_rank * per:(dp_rank + 1) * per]
            hook = weight.register_hook(lambda g: g * math.inf) if k == inf_at else None
            traffic = TensorParallelTraffic()
            with traffic.mode:
                engine.backward(engine(xb, labels=xb).loss)
            if name in TORCH_CLIP:  # a plain loop's clipping, over the split model's parameters
                norm = torch.nn.utils.clip_grad_norm_(engine.module.parameters(), CLIP[name])
                figures["torch_clip_norms"].append(float(norm))
            engine.step()
            if hook is not None:
                hook.remove()
            figures["grad_norms"].append(engine.stats()["grad_norm"])
            figures["mp_all_reduces"].append(traffic.count)
            figures["mp_elements"].append(traffic.elements)
    finally:
        by_reference.close()
    figures["saved_by_reference"] = by_reference.count
    stats = engine.stats()
    full = engine.full_state_dict()
    ref_norms = []
    if name in DELAYED:
        from models import delayed_reference
        ref = delayed_reference(llama(False), data(), make_optimizer(kind), DELAYED[name], clip=CLIP[name])
    else:
        ref = reference(kind, CLIP.get(name), ref_norms, skip=INF_ON_TP1.get(name))
    figures.update(ref_norms=ref_norms,
        diff=max_diff(full, ref), keys_match=sorted(full) == sorted(ref),
        peak_activations=timeline.peak("activations"), peak_host_activations=timeline.peak("host_activations"),
        **{k: stats[k] for k in ("comm_elements", "skipped_steps", "padded_elements", "num_params", "world_size", "tensor_parallel", "grad_norm",
                                 "saved_activation_bytes", "pa_elements", "pa_fingerprints", "pa_partitioned_elements")
                 if k in stats},
        full_numel=sum(v.numel() for v in ref.values()), local_batch=per, hidden=64, layers=2, seq=SEQ, vocab=VOCAB)
    return figures


def split(m, mesh):
    """`m` split by PyTorch's tensor parallelism: each block by tp_plan over mesh["tp"]."""
    from torch.distributed.tensor.parallel import parallelize_module
    for layer in m.model.layers:
        parallelize_module(layer, mesh["tp"], tp_plan())
    return m


def split_llama(mesh, checkpointing=False):
    return split(llama(checkpointing), mesh)


def auto(world):
    """offload/stage 'auto' on the split model: the profile is this rank's part (its local shards,
    flops and TP all-reduces); planned at a generous cap and at a cap that ZeRO-3 without offload
    exceeds, each trains the single-process model."""
    import zeroshard
    from zeroshard.distributed.collectives import default_device
    from zeroshard.planning.hardware import probe
    from zeroshard.planning.auto_plan import optimizer_state_bytes
    from zeroshard.planning.planner import FRAGMENTATION, Planner, Target
    mesh = zeroshard.device_mesh(2)
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    per = BATCH // dp
    x = data()[0][:per]
    example = {"input_ids": x, "labels": x}
    prof = zeroshard.profile(split_llama(mesh), example)
    whole = zeroshard.profile(llama(False), example)
    hw = probe(default_device())

    def planner(cap):
        return Planner(prof, Target(hw.with_(device_memory=cap), world=dp, tensor_parallel=2,
                                    optimizer_state_bytes=optimizer_state_bytes(make_optimizer("sgd"))))
    base = {b.name: b.device_bytes for b in planner(1 << 40).baselines()}
    caps = {"generous": 1 << 40, "tight": int((base["ZeRO-3"] + base["ZeRO-3 offload"]) / 2 / FRAGMENTATION)}
    out = {"profile": {"numel": prof.numel, "flops": prof.flops, "collectives": prof.collectives,
                       "collective_bytes": prof.collective_bytes, "whole_numel": whole.numel,
                       "whole_flops": whole.flops, "whole_collectives": whole.collectives},
           "zero3_need": {b.name: b.device_bytes for b in planner(caps["tight"]).baselines()}["ZeRO-3"] / FRAGMENTATION}
    ref = reference("sgd")
    for name, cap in caps.items():
        engine = zeroshard.initialize(split_llama(mesh), make_optimizer("sgd"), example_inputs=example,
                                      config={"stage": "auto", "offload": "auto", "device_memory": cap,
                                              "tensor_parallel": 2, "collective_timeout_s": 120})
        for xs in data():
            xb = xs[dp_rank * per:(dp_rank + 1) * per]
            engine.backward(engine(xb, labels=xb).loss)
            engine.step()
        full, stats, plan = engine.full_state_dict(), engine.stats(), engine.plan
        out[name] = {"diff": max_diff(full, ref), "cap": cap,
                     "plan": plan.describe(), "fits": plan.fits, "offloaded_chunks": plan.offloaded_chunks,
                     "tp_seconds": plan.time.model_collectives, "predicted": plan.device_model_bytes,
                     "device_model_bytes": stats["device_model_bytes"],
                     "host_bytes": stats["model_state_bytes_by_device"]["host"]}
    return out


def meta_split_llama(mesh):
    """The test Llama built on the meta device (no storage), then split: as a model no process
    could hold is made."""
    from transformers import LlamaForCausalLM
    cfg = llama(False).config
    with torch.device("meta"):
        m = LlamaForCausalLM(cfg)
    return split(m, mesh)


def pretrained(world, directory):
    """The pretrained path of a split model that is never whole in a process: built on meta and split,
    its weights read shard by shard from a transformers folder (weights=), trained, saved with
    save_pretrained (several files, written by every rank), opened by transformers; then
    load_weights and load_state_dict back into the split engine, a folder of other shapes refused
    on every rank, and meta initialisation giving the values it gives an unsplit model."""
    import torch.distributed as dist
    import zeroshard
    from transformers import LlamaConfig, LlamaForCausalLM
    mesh = zeroshard.device_mesh(2)
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    per = BATCH // dp
    ref_dir, out_dir, other_dir = (os.path.join(directory, n) for n in ("ref", "out", "other"))
    if dist.get_rank() == 0:
        llama(False).save_pretrained(ref_dir)
        cfg = LlamaConfig(**{**llama(False).config.to_dict(), "intermediate_size": 96})
        LlamaForCausalLM(cfg).save_pretrained(other_dir)
    dist.barrier()
    stage = 2 if world == 4 else 3
    m = meta_split_llama(mesh)
    engine = zeroshard.initialize(m, make_optimizer("sgd"), config={"stage": stage, "tensor_parallel": 2},
                                  weights=ref_dir)
    for x in data():
        xb = x[dp_rank * per:(dp_rank + 1) * per]
        engine.backward(engine(xb, labels=xb).loss)
        engine.step()
    ref, start = reference("sgd"), llama(False).state_dict()
    out = {"stage": stage, "trained": max_diff(engine.full_state_dict(), ref)}
    engine.save_pretrained(out_dir, max_shard_size=100_000)
    dist.barrier()
    if dist.get_rank() == 0:
        out["files"] = sorted(n for n in os.listdir(out_dir) if n.endswith(".safetensors"))
        out["saved"] = max_diff(LlamaForCausalLM.from_pretrained(out_dir).state_dict(), ref)
    engine.load_weights(ref_dir)
    out["load_weights"] = max_diff(engine.full_state_dict(), start)
    m.load_state_dict(ref)
    out["load_state_dict"] = max_diff(engine.full_state_dict(), ref)
    m.load_state_dict(split_llama(mesh).state_dict())  # DTensor values, laid out as the model's
    out["load_dtensor_state_dict"] = max_diff(engine.full_state_dict(), start)
    m.load_state_dict(ref)
    try:
        engine.load_weights(other_dir)
    except zeroshard.WeightsError as e:
        out["other_shapes"] = str(e)
    out["after_refusal"] = max_diff(engine.full_state_dict(), ref)  # nothing written
    split = zeroshard.initialize(meta_split_llama(mesh), make_optimizer("sgd"), config={"stage": 3, "tensor_parallel": 2})
    with torch.device("meta"):
        whole = LlamaForCausalLM(llama(False).config)
    unsplit = zeroshard.initialize(whole, make_optimizer("sgd"), config={"stage": 0})
    a, b = split.full_state_dict(), unsplit.full_state_dict()
    out["meta_keys_match"], out["meta_init"] = sorted(a) == sorted(b), max_diff(a, b)
    return out


def resume(directory):
    """Save after step 1 at stage 3, resume in a new engine at stage 1 (another layout of the
    same local shards), train steps 2-3: the reference's model, momentum included."""
    import zeroshard
    mesh = zeroshard.device_mesh(2)
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    per = BATCH // dp
    xs = [x[dp_rank * per:(dp_rank + 1) * per] for x in data()]
    paths = []
    for stage, steps in ((3, xs[:1]), (1, xs[1:])):
        m = split_llama(mesh)
        engine = zeroshard.initialize(m, make_optimizer("sgd"), config={"stage": stage, "tensor_parallel": 2})
        if stage == 1:
            client = engine.load_checkpoint(directory)
        for xb in steps:
            engine.backward(engine(xb, labels=xb).loss)
            engine.step()
        if stage == 3:
            paths.append(engine.save_checkpoint(directory, client_state={"step": 1}))
            at_save = engine.full_state_dict()
    full, ref = engine.full_state_dict(), reference("sgd")
    out = {"diff": max_diff(full, ref), "client": client,
           "layout": sorted(os.listdir(directory)), "path": paths[0]}
    import torch.distributed as dist
    if dist.get_rank() == 0:  # export joins the TP ranks' shards into the whole model, offline
        from safetensors.torch import load_file
        from zeroshard.state.export import export
        exported = load_file(export(directory, os.path.join(directory, "..", "exported.safetensors"),
                                    progress=lambda line: None))
        out["export_keys_match"] = sorted(exported) == sorted(at_save)
        out["export_diff"] = max_diff(exported, at_save)
        try:
            export(paths[0], os.path.join(directory, "..", "one-rank.safetensors"), progress=lambda line: None)
        except zeroshard.CheckpointError as e:
            out["one_rank"] = str(e)
    return out


def refusals(directory):
    """What does not take a tensor-parallel model yet raises a named error on every rank."""
    import zeroshard
    mesh = zeroshard.device_mesh(2)
    m = llama(False)
    got = {}
    try:
        zeroshard.initialize(m, config={"tensor_parallel": 2})
    except ValueError as e:
        got["unsplit"] = str(e)
    split(m, mesh)
    engine = zeroshard.initialize(m, make_optimizer("sgd"), config={"tensor_parallel": 2})
    try:
        engine.load_checkpoint(directory)
    except zeroshard.CheckpointError as e:
        got["load_checkpoint"] = str(e)
    return got


def run(rank, world, out):
    here = os.path.dirname(out)

    def refusals_in_empty():
        os.makedirs(os.path.join(here, "empty"), exist_ok=True)
        return refusals(os.path.join(here, "empty"))
    record(rank, out, [*((name, functools.partial(scenario, name, world)) for name in SCENARIOS),
                       ("resume", lambda: resume(os.path.join(here, "checkpoints"))),
                       ("pretrained", lambda: pretrained(world, os.path.join(here, "pretrained"))),
                       ("auto", lambda: auto(world)),
                       # the test sets the directory the world-4 run saves to and the world-2 run loads from
                       ("across", lambda: across(world, os.environ["ZEROSHARD_TP_ACROSS"])),
                       ("refusals", refusals_in_empty)], traceback_limit=None)


def across(world, directory):
    """World 4 (TP 2 x DP 2): step 1 at stage 2, saved to `directory`. World 2 (TP 2 x DP 1): that
    checkpoint loaded at stage 3, steps 2-3, compared with the reference."""
    import zeroshard
    mesh = zeroshard.device_mesh(2)
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    per = BATCH // dp
    m = split_llama(mesh)
    engine = zeroshard.initialize(m, make_optimizer("sgd"), config={"stage": 2 if world == 4 else 3,
                                                                     "tensor_parallel": 2})
    if world == 2:
        engine.load_checkpoint(directory)
    for x in data()[:1] if world == 4 else data()[1:]:
        xb = x[dp_rank * per:(dp_rank + 1) * per]
        engine.backward(engine(xb, labels=xb).loss)
        engine.step()
    if world == 4:
        return {"saved": engine.save_checkpoint(directory)}
    full, ref = engine.full_state_dict(), reference("sgd")
    return {"diff": max_diff(full, ref)}
