"""Pretrained weights streamed in (`weights=`, `load_weights`) and out (`save_pretrained`, `zeroshard
export`), part of pretrained_scenarios.SCENARIOS: round trips bit for bit, the files' errors, a base
model's weights, and saving over an earlier save.
"""
from __future__ import annotations

import os

import torch

import zeroshard
from distributed import error_on_every_rank, every_rank
from models import batches, make_sgd, max_diff
from pretrained_common import SMALL_CHUNKS, _equal_to_files, _files, _train, build, folder

SCENARIOS = {}


def weights_round_trip(rank, world, stage):
    """save_pretrained (one file, and a sharded set with an index) of a trained model; then
    `weights=` at initialize and `load_weights` of either give full_state_dict() equal to the files
    bit for bit, at another stage too; from_pretrained of the folder equals the saved model."""
    from transformers import GPT2LMHeadModel
    src = zeroshard.initialize(build("gpt2", meta=True), make_sgd, {"stage": stage, "chunk_size": SMALL_CHUNKS,
                                                                    "init_seed": 1})
    _train(src, batches(1, world, 1, vocab=96, seq=16), rank)
    single, sharded = folder(f"single{stage}"), folder(f"sharded{stage}")
    src.save_pretrained(single)
    src.save_pretrained(sharded, max_shard_size=20_000)
    saved = src.full_state_dict()
    out = {"files_single": sorted(os.listdir(single)), "files_sharded": sorted(os.listdir(sharded))}
    files = {name: _files(path) for name, path in (("single", single), ("sharded", sharded))}
    out["files_equal_saved"] = all(_equal_to_files(saved, f) for f in files.values())
    out["tied_written_once"] = "lm_head.weight" not in files["single"]
    other = (stage + 2) % 4
    for name, path in (("single", single), ("sharded", sharded)):
        at_init = zeroshard.initialize(build("gpt2", meta=True), make_sgd,
                                       {"stage": other, "chunk_size": 5000, "init_seed": 2}, weights=path)
        out[f"weights_{name}"] = _equal_to_files(at_init.full_state_dict(), files[name])
        later = zeroshard.initialize(build("gpt2", meta=True), make_sgd, {"stage": stage, "init_seed": 3})
        result = later.load_weights(path)
        out[f"load_weights_{name}"] = _equal_to_files(later.full_state_dict(), files[name])
        out[f"load_weights_{name}_missing"] = list(result.missing) + list(result.unexpected)
    if rank == 0:
        reloaded = GPT2LMHeadModel.from_pretrained(sharded).state_dict()
        out["from_pretrained"] = set(reloaded) == set(saved) and all(torch.equal(reloaded[k], saved[k]) for k in saved)
    # bf16 training from weights= equals bf16 training from from_pretrained + plain initialize
    cfg = {"stage": stage, "precision": "bf16", "chunk_size": SMALL_CHUNKS}
    data = batches(2, world, 1, vocab=96, seq=16)
    a = zeroshard.initialize(build("gpt2", meta=True), make_sgd, cfg, weights=single)
    b = zeroshard.initialize(GPT2LMHeadModel.from_pretrained(single), make_sgd, cfg)
    out["bf16_start_equal"] = max_diff(a.full_state_dict(), b.full_state_dict())
    _train(a, data, rank)
    _train(b, data, rank)
    out["bf16_trained_equal"] = max_diff(a.full_state_dict(), b.full_state_dict())
    return out


for _stage in range(4):
    SCENARIOS[f"weights_stage{_stage}"] = (lambda rank, world, s=_stage: weights_round_trip(rank, world, s))


def export_output(rank, world):
    """A `zeroshard export` output (a folder whose model.safetensors holds every state_dict key, the
    tied lm_head.weight too) loads through weights= and load_weights, strictly."""
    from zeroshard.state.export import export
    src = zeroshard.initialize(build("gpt2", meta=True), make_sgd, {"stage": 2, "init_seed": 5})
    _train(src, batches(1, world, 1, vocab=96, seq=16), rank)
    src.save_checkpoint(folder("ckpt"))
    saved = src.full_state_dict()
    if rank == 0:
        export(folder("ckpt"), folder("exported"), progress=lambda line: None)
    every_rank(None)
    at_init = zeroshard.initialize(build("gpt2", meta=True), make_sgd, {"stage": 3, "chunk_size": SMALL_CHUNKS},
                                   weights=folder("exported"))
    later = zeroshard.initialize(build("gpt2", meta=True), make_sgd, {"stage": 1})
    result = later.load_weights(folder("exported"))
    return {"weights": max_diff(at_init.full_state_dict(), saved), "load_weights": max_diff(later.full_state_dict(), saved),
            "missing_unexpected": result.missing + result.unexpected}


SCENARIOS["export_output"] = export_output


def weights_errors(rank, world):
    """Shape mismatch, missing and unexpected keys: WeightsError on every rank, naming each, before
    anything is written; strict=False loads what matches and reports the rest."""
    from safetensors.torch import save_file
    engine = zeroshard.initialize(build("gpt2", meta=True), make_sgd, {"stage": 3, "chunk_size": SMALL_CHUNKS})
    before = engine.full_state_dict()
    good = folder("errors_good")
    engine.save_pretrained(good)
    bad = folder("errors_bad")
    if rank == 0:
        sd = _files(good)
        sd["transformer.wpe.weight"] = torch.zeros(16, 32)  # another shape
        del sd["transformer.h.0.ln_1.bias"]
        sd["transformer.extra.weight"] = torch.zeros(3)
        os.makedirs(bad, exist_ok=True)
        save_file(sd, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
    every_rank(None)  # the file is written before anyone reads it
    out = {"strict": error_on_every_rank(lambda: engine.load_weights(bad))}
    out["unchanged"] = max_diff(engine.full_state_dict(), before)
    out["at_init"] = error_on_every_rank(lambda: zeroshard.initialize(build("gpt2", meta=True), make_sgd, {"stage": 2},
                                                                      weights=bad))
    out["no_folder"] = error_on_every_rank(lambda: engine.load_weights(folder("nothing_here")))
    if rank == 0:  # without the mismatched tensor, strict=False loads the rest and reports it
        sd = _files(bad)
        del sd["transformer.wpe.weight"]
        os.makedirs(folder("errors_partial"), exist_ok=True)
        save_file(sd, os.path.join(folder("errors_partial"), "model.safetensors"), metadata={"format": "pt"})
    every_rank(None)
    result = engine.load_weights(folder("errors_partial"), strict=False)
    out["partial_missing"], out["partial_unexpected"] = sorted(result.missing), sorted(result.unexpected)
    # at initialize, what the file lacks is initialised (a meta model) and the rest comes from the file
    got = zeroshard.initialize(build("gpt2", meta=True), make_sgd, {"stage": 3, "chunk_size": SMALL_CHUNKS},
                               weights=folder("errors_partial")).full_state_dict()
    files = _files(folder("errors_partial"))
    out["init_missing_rest_equal"] = all(torch.equal(got[k], v) for k, v in files.items() if k in got)
    out["init_missing_wpe_std"] = got["transformer.wpe.weight"].std().item()
    out["init_missing_bias_zero"] = bool((got["transformer.h.0.ln_1.bias"] == 0).all())
    return out


SCENARIOS["weights_errors"] = weights_errors


def base_model_weights(rank, world):
    """Weights saved from the base model (GPT2Model: no `transformer.` prefix, no head) load into the
    model with a head, as from_pretrained loads them."""
    base = folder("base_model")
    if rank == 0:
        build("gpt2", meta=False, seed=4, base=True).save_pretrained(base)
    every_rank(None)
    engine = zeroshard.initialize(build("gpt2", meta=True), make_sgd, {"stage": 3, "chunk_size": SMALL_CHUNKS},
                                  weights=base)
    got, files = engine.full_state_dict(), _files(base)
    return {"equal": all(torch.equal(got["transformer." + k], v) for k, v in files.items()),
            "keys": len(files)}


SCENARIOS["base_model_weights"] = base_model_weights


def save_over_a_folder(rank, world):
    """save_pretrained into a folder that holds an earlier save (sharded, then one file) and other
    files: the earlier weight files go, the others stay; into a path that is a file: WeightsError on
    every rank."""
    e = zeroshard.initialize(build("gpt2", meta=True), make_sgd, {"stage": 3, "chunk_size": SMALL_CHUNKS})
    path = folder("over")
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "tokenizer.json"), "w") as f:
            f.write("{}")
        with open(folder("a_file"), "w") as f:
            f.write("not a folder")
    every_rank(None)
    e.save_pretrained(path, max_shard_size=20_000)
    first = sorted(os.listdir(path))
    e.save_pretrained(path)
    return {"first": first, "second": sorted(os.listdir(path)),
            "equal": _equal_to_files(e.full_state_dict(), _files(path)),
            "into_a_file": error_on_every_rank(lambda: e.save_pretrained(folder("a_file")))}


SCENARIOS["save_over_a_folder"] = save_over_a_folder
