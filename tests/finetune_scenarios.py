"""Multi-process halves of tests/test_finetune.py (issue 29): fine-tuning as users write it, gradual
unfreezing and LoRA through peft, against single-process PyTorch on the global batch.

`run(rank, world, out_path)` runs them all in one process group (rank 0 writes {name: figures}).
"""
from __future__ import annotations

import os
import tempfile

import torch

import zeroshard
from distributed import shared_temp_dir
from models import batches, make_adamw, make_sgd, max_diff, tiny_gpt2
from scenarios import run_all

SCENARIOS = {}
OPTIMIZERS = {"sgd": make_sgd, "adamw": make_adamw}


def loss_of(m, x):
    return m(input_ids=x, labels=x).loss


# -- gradual unfreezing ------------------------------------------------------------------------------------
FROZEN = ["transformer.h.0.mlp.c_fc.weight", "transformer.h.1.attn.c_attn.weight", "transformer.h.1.attn.c_attn.bias"]
STEPS = 6


def thaw(params, k):
    """ULMFiT-style: frozen for steps 0-1, trained from step 2; the first frozen again from step 4."""
    for i, p in enumerate(params):
        p.requires_grad_(k >= 2 and not (i == 0 and k >= 4))


def frozen_model(seed=0):
    model = tiny_gpt2(seed=seed)
    params = [model.get_parameter(n) for n in FROZEN]  # before initialize: stage 3 puts placeholders in
    for p in params:
        p.requires_grad_(False)
    return model, params


def unfreeze_reference(make_opt, data):
    model, params = frozen_model()
    opt = make_opt(list(model.parameters()))  # over every parameter, frozen ones too, as for unfreezing in torch
    for k, step in enumerate(data):
        thaw(params, k)
        loss_of(model, step.reshape(-1, step.shape[-1])).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.state_dict()


def gradual_unfreezing(rank, world, make_opt, stage, extra=None, form="instance"):
    """Parameters frozen at initialize, unfrozen after 2 steps, one frozen again after 4 (issue 29,
    defect 6: FrozenParameterError at the forward after unfreezing). form 'factory': the optimizer
    is a callable over the tensors zeroshard hands it, and the unfrozen ones join its one group."""
    data = batches(STEPS, world, 2)
    ref = unfreeze_reference(make_opt, data)
    model, params = frozen_model()
    opt = make_opt(list(model.parameters())) if form == "instance" else make_opt
    engine = zeroshard.initialize(model, opt, {"stage": stage, "chunk_size": 20000, **(extra or {})})
    frozen_chunks = sum(not c.trainable for c in engine.chunks)
    for k, step in enumerate(data):
        thaw(params, k)
        engine.backward(loss_of(engine, step[0, rank]))
        engine.step()
    return {"diff": max_diff(engine.full_state_dict(), ref), "frozen_chunks_at_start": frozen_chunks,
            "frozen_chunks_at_end": sum(not c.trainable for c in engine.chunks)}


for _opt in OPTIMIZERS:
    for _stage in range(4):
        SCENARIOS[f"unfreeze_{_opt}_stage{_stage}"] = (lambda rank, world, opt=_opt, stage=_stage:
                                                      gradual_unfreezing(rank, world, OPTIMIZERS[opt], stage))
for _stage in (1, 2, 3):
    SCENARIOS[f"unfreeze_offload_stage{_stage}"] = (lambda rank, world, stage=_stage: gradual_unfreezing(
        rank, world, make_adamw, stage, {"offload_optimizer": True}))
SCENARIOS["unfreeze_offload_params_stage3"] = lambda rank, world: gradual_unfreezing(
    rank, world, make_adamw, 3, {"offload_optimizer": True, "offload_params": True})
SCENARIOS["unfreeze_bf16_stage3"] = lambda rank, world: gradual_unfreezing(rank, world, make_adamw, 3,
                                                                           {"precision": "bf16"})
SCENARIOS["unfreeze_factory_stage2"] = lambda rank, world: gradual_unfreezing(rank, world, make_sgd, 2,
                                                                              form="factory")


def unfreeze_then_resume(rank, world, stage):
    """A checkpoint saved after unfreezing, loaded into a fresh engine whose parameters are frozen
    at initialize again (the script unfreezes at step 2, as before): the unfrozen parameters'
    optimizer states come back and training continues as if uninterrupted."""
    data = batches(STEPS, world, 2)
    ref = unfreeze_reference(make_adamw, data)
    root = shared_temp_dir()

    def engine_of():
        model, params = frozen_model()
        return zeroshard.initialize(model, make_adamw(list(model.parameters())),
                                    {"stage": stage, "chunk_size": 20000}), params
    first, params = engine_of()
    for k, step in enumerate(data[:3]):
        thaw(params, k)
        first.backward(loss_of(first, step[0, rank]))
        first.step()
    first.save_checkpoint(root, tag="mid")
    second, params = engine_of()
    second.load_checkpoint(root, tag="mid")
    for k, step in enumerate(data[3:], 3):
        thaw(params, k)
        second.backward(loss_of(second, step[0, rank]))
        second.step()
    return {"diff": max_diff(second.full_state_dict(), ref)}


for _stage in (2, 3):
    SCENARIOS[f"unfreeze_then_resume_stage{_stage}"] = lambda rank, world, stage=_stage: unfreeze_then_resume(
        rank, world, stage)


def unfreeze_with_groups_by_position(rank, world):
    """An optimizer callable that splits the tensors it is handed into two groups by position:
    an unfrozen parameter has no group to join: FrozenParameterError, on every rank."""
    model, params = frozen_model()

    def two_groups(ps):
        return torch.optim.SGD([{"params": ps[:2]}, {"params": ps[2:], "lr": 0.01}], lr=0.05)
    engine = zeroshard.initialize(model, two_groups, {"stage": 2, "chunk_size": 20000})
    x = batches(1, world, 2)[0, 0, rank]
    engine.backward(loss_of(engine, x))
    engine.step()
    thaw(params, 2)
    engine(input_ids=x, labels=x)
    return {"raised": False}


SCENARIOS["unfreeze_with_groups_by_position"] = unfreeze_with_groups_by_position


# -- LoRA through peft ---------------------------------------------------------------------------------------
def lora_llama():
    import peft
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=128))
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                      target_modules=["q_proj", "v_proj"]))
    for n, p in model.named_parameters():  # peft starts lora_B at zero: give every adapter tensor a value
        if "lora_B" in n:
            with torch.no_grad():
                p.normal_(0, 0.02)
    return model


def lora_optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)


def lora(rank, world, stage):
    """LoRA: a tiny Llama through peft's get_peft_model, AdamW over the trainable (adapter) tensors,
    as peft's examples build it: trains as single-process PyTorch; the frozen base holds no gradient
    or optimizer memory; engine.save_pretrained writes the adapters in peft's format, which
    PeftModel.from_pretrained opens with the trained values."""
    import peft
    data = batches(3, world, 2)
    ref = lora_llama()
    opt = lora_optimizer(ref)
    for step in data:
        loss_of(ref, step.reshape(-1, step.shape[-1])).backward()
        opt.step()
        opt.zero_grad()
    model = lora_llama()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    engine = zeroshard.initialize(model, lora_optimizer(model), {"stage": stage})
    for step in data:
        engine.backward(loss_of(engine, step[0, rank]))
        engine.step()
    full = engine.full_state_dict()
    by_kind, _ = engine.model_state_bytes()
    out = {"diff": max_diff(full, ref.state_dict()), "trainable_numel": trainable,
           "grad_bytes": by_kind.get("grads", 0), "optimizer_bytes": by_kind.get("optimizer", 0),
           "trainable_chunk_numel": sum(c.padded_numel for c in engine.chunks if c.trainable),
           "frozen_chunk_numel": sum(c.padded_numel for c in engine.chunks if not c.trainable)}
    path = shared_temp_dir()
    engine.save_pretrained(path)
    if rank == 0:
        import transformers
        torch.manual_seed(1)
        base = transformers.LlamaForCausalLM(ref.get_base_model().config)
        base.load_state_dict({k.replace("base_model.model.", "", 1).replace(".base_layer", ""): v
                              for k, v in full.items() if "lora_" not in k})
        loaded = peft.PeftModel.from_pretrained(base, path).state_dict()
        out["files"] = sorted(os.listdir(path))
        out["adapter_diff"] = max(float((loaded[k] - full[k]).abs().max()) for k in full if "lora_" in k)
        out["adapter_keys"] = sum("lora_" in k for k in full)
    return out


for _stage in range(4):
    SCENARIOS[f"lora_stage{_stage}"] = lambda rank, world, stage=_stage: lora(rank, world, stage)


# What peft decides by method to save beside ".<adapter>." tensors: a ParameterDict's entries (LoRA's
# embedding adapters, IA3's scales), modules_to_save (read from the module's own state_dict, at
# stage 3 a gather), trainable tokens, and a targeted embedding's whole base layer.
PEFT_SAVES = {
    "embedding_and_head": dict(kind="lora", target_modules=["embed_tokens", "q_proj"], modules_to_save=["lm_head"]),
    "ia3": dict(kind="ia3", target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
    "trainable_tokens": dict(kind="lora", target_modules=["q_proj"], trainable_token_indices={"embed_tokens": [1, 2, 5]}),
}


def peft_model(setting: dict):
    import peft
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=64))
    kw = {k: v for k, v in setting.items() if k != "kind"}
    config = peft.LoraConfig(r=4, init_lora_weights=False, **kw) if setting["kind"] == "lora" else peft.IA3Config(**kw)
    return peft.get_peft_model(base, config)


def peft_saves(rank, world, stage, name):
    """engine.save_pretrained of a peft model writes what peft's own save_pretrained writes for the
    trained model (every key, every value), and PeftModel.from_pretrained opens it."""
    import peft
    from safetensors.torch import load_file
    model = peft_model(PEFT_SAVES[name])
    engine = zeroshard.initialize(model, lambda ps: torch.optim.SGD(ps, lr=0.5), {"stage": stage, "chunk_size": 4000})
    for step in batches(2, world, 1, vocab=64, seq=8):
        engine.backward(loss_of(engine, step[0, rank]))
        engine.step()
    full = engine.full_state_dict()
    path = shared_temp_dir()
    engine.save_pretrained(path)
    if rank != 0:
        return {}
    plain = peft_model(PEFT_SAVES[name])
    plain.load_state_dict(full)
    plain_path = tempfile.mkdtemp()
    plain.save_pretrained(plain_path)
    mine, want = (load_file(os.path.join(d, "adapter_model.safetensors")) for d in (path, plain_path))
    loaded = peft.PeftModel.from_pretrained(peft_model(PEFT_SAVES[name]).get_base_model(), path).state_dict()
    trained = [k for k, p in plain.named_parameters() if p.requires_grad]
    return {"keys": sorted(mine), "plain_keys": sorted(want),
            "value_diff": max(float((mine[k] - want[k]).abs().max()) for k in want if k in mine),
            "loaded_diff": max(float((loaded[k] - full[k]).abs().max()) for k in trained),
            "trained_moved": min(float((full[k] - v).abs().max()) for k, v in
                                 peft_model(PEFT_SAVES[name]).state_dict().items() if k in trained)}


for _stage in (0, 3):
    for _name in PEFT_SAVES:
        SCENARIOS[f"peft_saves_{_name}_stage{_stage}"] = \
            lambda rank, world, stage=_stage, name=_name: peft_saves(rank, world, stage, name)


def run(rank, world, out_path, only=None):
    run_all(rank, world, out_path, only, registry=SCENARIOS)
