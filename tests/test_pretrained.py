"""Models bigger than one process (issue 15): construction on the meta device, pretrained weights
streamed into the shards, save_pretrained streamed out. World sizes 1, 2 and 3, stages 0-3.

Tolerances: a meta-built model and the same model built normally with the same values train through
the same engine to bit-identical parameters (0); against plain single-process PyTorch on the global
batch, fp32 SGD with momentum within 1e-5 as everywhere. Loaded and saved weights are compared bit
for bit. Statistics of meta-initialised tensors are compared with the normal constructor's within
five standard errors of the sampling (see test_meta_values_have_the_initialisers_statistics).
"""
import math

import pytest

from distributed import WorldResults, ok
from pretrained_scenarios import ARCHS, build, run

_results = WorldResults(run, "pretrained")
RESULTS = _results  # read by the `res` fixture (conftest.py)


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("arch", ARCHS)
def test_meta_model_trains_exactly_like_the_model_built_normally(res, arch, stage):
    r, _ = res
    got = ok(r, f"meta_{arch}_stage{stage}")
    assert got["params_on_meta"] == 0
    assert got["vs_normal"] == 0.0
    assert got["vs_torch"] <= 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_meta_values_are_the_same_at_every_world_size_stage_and_chunk_size(arch, tmp_path_factory):
    digests = set()
    for world in (1, 2, 3):
        r = _results.get(world, tmp_path_factory)
        for stage in range(4):
            got = ok(r, f"meta_{arch}_stage{stage}")
            digests.add(got["digest"])
            if stage == 3:
                digests.add(got["digest_one_chunk"])
    assert len(digests) == 1, digests


@pytest.mark.parametrize("arch", ARCHS)
def test_meta_values_have_the_initialisers_statistics(arch, tmp_path_factory):
    """Per tensor, mean and standard deviation against the normal constructor's (transformers'
    _init_weights, GPT-2's scaled residual projections included). Two independent samples of n
    elements: their means differ by about std*sqrt(2/n), their standard deviations by about
    std/sqrt(n) (normal data; uniform data varies less); five of those is the bound. Constant
    tensors (norm weights, biases) must be equal."""
    stats = ok(_results.get(1, tmp_path_factory), f"meta_{arch}_stage0")["stats"]
    normal = build(arch, meta=False, seed=11).state_dict()
    checked = 0
    for key, (mean, std, n) in stats.items():
        ref = normal[key].float()
        ref_mean, ref_std = ref.mean().item(), ref.std().item() if n > 1 else 0.0
        if ref_std == 0.0:
            assert mean == ref_mean and std == 0.0, key
            continue
        assert abs(mean - ref_mean) <= 5 * ref_std * math.sqrt(2 / n), (key, mean, ref_mean)
        assert abs(std - ref_std) <= 5 * ref_std / math.sqrt(n), (key, std, ref_std)
        checked += 1
    assert checked >= 8


@pytest.mark.parametrize("stage", range(4))
def test_weights_round_trip_bit_for_bit(res, stage):
    r, _ = res
    got = ok(r, f"weights_stage{stage}")
    assert got["files_single"] == ["config.json", "generation_config.json", "model.safetensors"]
    assert "model.safetensors.index.json" in got["files_sharded"] and len(got["files_sharded"]) > 4
    assert got["files_equal_saved"] and got["tied_written_once"]
    for name in ("single", "sharded"):
        assert got[f"weights_{name}"], name
        assert got[f"load_weights_{name}"], name
        assert got[f"load_weights_{name}_missing"] == []
    assert got["from_pretrained"]
    assert got["bf16_start_equal"] == 0.0 and got["bf16_trained_equal"] == 0.0


def test_a_zeroshard_export_output_loads(res):
    r, _ = res
    got = ok(r, "export_output")
    assert got["weights"] == 0.0 and got["load_weights"] == 0.0 and got["missing_unexpected"] == []


def test_weights_errors_name_every_key_on_every_rank(res):
    r, world = res
    got = ok(r, "weights_errors")
    assert len(got["strict"]) == world and len(set(got["strict"])) == 1
    text = got["strict"][0]
    assert text.startswith("WeightsError") and "size mismatch for transformer.wpe.weight" in text
    assert "missing keys: transformer.h.0.ln_1.bias" in text and "unexpected keys: transformer.extra.weight" in text
    assert got["unchanged"] == 0.0
    assert all(e.startswith("WeightsError") and "size mismatch" in e and "missing" not in e for e in got["at_init"])
    assert all(e.startswith("WeightsError") and "neither a folder" in e for e in got["no_folder"])
    assert got["partial_missing"] == ["transformer.h.0.ln_1.bias", "transformer.wpe.weight"]
    assert got["partial_unexpected"] == ["transformer.extra.weight"]
    assert got["init_missing_rest_equal"] and got["init_missing_bias_zero"]
    assert 0.015 < got["init_missing_wpe_std"] < 0.025  # normal(0, 0.02) over 1024 elements


def test_save_pretrained_over_a_folder_and_into_a_file(res):
    r, _ = res
    got = ok(r, "save_over_a_folder")
    assert "model.safetensors.index.json" in got["first"] and "tokenizer.json" in got["first"]
    assert got["second"] == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert got["equal"]
    assert all(e.startswith("WeightsError") and "a_file" in e for e in got["into_a_file"])


def test_meta_model_with_frozen_parameters_and_offload_trains_exactly(res):
    r, _ = res
    got = ok(r, "meta_variants")
    assert got == {"offload_bf16_stage2": 0.0, "offload_all_stage3": 0.0}


def test_initialisers_see_one_tensor_and_cannot_compute_from_meta_values(res):
    r, _ = res
    got = ok(r, "initialiser_isolation")
    assert got["same_bias_object"] and got["bias"] == [0.5, 0.5, 0.5] and 0.3 < got["weight_std"] < 2.0
    assert all(e.startswith("UninitializedTensorError") and "weight" in e and "meta device" in e for e in got["scaled"])
    assert got["gated"] == [1.0, 1.0, 1.0, 1.0]


def test_base_model_weights_load_into_a_model_with_a_head(res):
    r, _ = res
    got = ok(r, "base_model_weights")
    assert got["equal"] and got["keys"] == 28  # GPT2Model: no lm_head


def test_tensors_no_initialiser_writes_raise_on_every_rank(res):
    r, world = res
    got = ok(r, "uninitialised")
    assert len(got["plain"]) == world
    assert all(e.startswith("UninitializedTensorError") and "mask (Custom)" in e and "scale (Custom)" in e
               for e in got["plain"])
    assert got["init_fn"] and got["weights"]


def test_buffers_of_a_meta_model(res):
    r, _ = res
    got = ok(r, "buffers")
    assert got["bn"] and got["rotary"]
    assert got["rotary_names"] == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    # xavier_uniform over the packed [3d, d] projection: std sqrt(2 / (d + 3d)) = 0.289 for d=6; 108
    # uniform samples have a standard error of about 0.012 (a Linear's default would give 0.236)
    assert abs(got["attn_in_proj_std"] - (2 / 24) ** 0.5) < 0.035
    assert got["saved_equal"] and got["weights_equal"] and got["load_weights_equal"]
    assert got["saved_keys"] == got["state_keys"]  # the persistent buffers too
    assert got["running_stats_from_file"]


def test_stage3_frees_the_model_as_built(res):
    r, _ = res
    got = ok(r, "stage3_frees_model")
    assert got["elements_before"] > 0 and got["elements_left"] == 0


def test_reading_any_range_of_any_tensor_in_blocks(tmp_path, monkeypatch):
    """WeightFiles.read: every [lo, hi) of 2-D, 1-D, scalar, empty and bf16 tensors, in blocks of
    READ_BLOCK = 40 bytes (two rows of `a`, ten elements of `b`, six rows of `h`): ranges of one
    block and of several."""
    import torch
    from safetensors.torch import save_file

    import zeroshard.files.weight_files as zp
    monkeypatch.setattr(zp, "READ_BLOCK", 40)
    tensors = {"a": torch.randn(7, 5), "b": torch.randn(23), "c": torch.tensor(2.0), "e": torch.randn(0, 4),
               "h": torch.randn(9, 3).to(torch.bfloat16)}
    save_file(tensors, str(tmp_path / "x.safetensors"))
    files = zp.WeightFiles(tmp_path / "x.safetensors")
    for key, value in tensors.items():
        flat = value.reshape(-1)
        for lo in range(flat.numel() + 1):
            for hi in range(lo, flat.numel() + 1):
                got = files.read(key, lo, hi)
                assert got.dtype == value.dtype and torch.equal(got, flat[lo:hi]), (key, lo, hi)


def test_the_readme_fine_tuning_example_runs(tmp_path):
    """examples/finetune.py (the README's fine-tuning path) under torchrun, 2 ranks: the loss falls
    and the folder it saves opens with from_pretrained."""
    import os
    import subprocess
    import sys

    import transformers
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4)).save_pretrained(
        tmp_path / "pretrained")
    script = os.path.join(os.path.dirname(__file__), "..", "examples", "finetune.py")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          script, "pretrained", "finetuned"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [float(line.split()[1]) for line in run.stdout.splitlines() if line.startswith("loss ")]
    assert len(losses) == 5 and losses[-1] < losses[0] - 0.5, losses
    assert "saved finetuned -> GPT2LMHeadModel" in run.stdout
