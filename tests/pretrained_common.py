"""What the pretrained scenario modules share (pretrained_scenarios.py): the small transformers models
they build, their loss and training loop, the folder the scenarios save into, and reading back the
safetensors files saved there.
"""
from __future__ import annotations

import os

import torch
import torch.nn as nn

ARCHS = ("gpt2", "opt", "llama")
SMALL_CHUNKS = 3000  # elements: several chunks, parameters across shard boundaries at worlds 2 and 3


def build(arch: str, meta: bool, seed: int = 0, base: bool = False) -> nn.Module:
    """A small transformers model of `arch` (GPT-2 with tied embeddings, OPT, Llama with rotary
    buffers), dropout off, on the meta device or built normally (seeded)."""
    import transformers
    transformers.logging.set_verbosity_error()
    if arch == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=32, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        cls = transformers.GPT2Model if base else transformers.GPT2LMHeadModel
    elif arch == "opt":
        cfg = transformers.OPTConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, ffn_dim=64,
                                     vocab_size=96, max_position_embeddings=32, word_embed_proj_dim=32, dropout=0.0,
                                     attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=1)
        cls = transformers.OPTForCausalLM
    else:
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=64, vocab_size=96, max_position_embeddings=32,
                                       bos_token_id=0, eos_token_id=0, pad_token_id=None)
        cls = transformers.LlamaForCausalLM
    if meta:
        with torch.device("meta"):
            return cls(cfg)
    torch.manual_seed(seed)
    return cls(cfg)


def loss_of(m, x):
    return m(input_ids=x, labels=x).loss


def folder(name: str) -> str:
    return os.path.join(_ROOT["dir"], name)


_ROOT = {}


def _train(engine, data, rank):
    for step in data:
        engine.backward(loss_of(engine, step[0][rank]))
        engine.step()


def _files(path: str) -> dict:
    from safetensors.torch import load_file
    if os.path.isfile(path):
        return load_file(path)
    out = {}
    for n in sorted(os.listdir(path)):
        if n.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, n)))
    return out


def _equal_to_files(sd: dict, files: dict) -> bool:
    """Every file tensor equals the state dict's, bit for bit (the file holds tied weights once)."""
    return set(files) <= set(sd) and all(torch.equal(sd[k], files[k].to(sd[k].dtype)) for k in files)
