"""Issue 29: fine-tuning as users write it (tests/finetune_scenarios.py), at worlds 1, 2 and 3.
Tolerances: fp32 SGD with momentum 1e-5, AdamW ADAMW_TOL (tests/models.py); bf16 against the fp32
reference 1e-2 (as tests/test_contract.py's 16-bit cases; a parameter frozen in bf16 is kept in bf16
only, so it unfreezes from its rounded value)."""
import pytest

pytest.importorskip("transformers")

from distributed import WorldResults, ok  # noqa: E402
from finetune_scenarios import PEFT_SAVES, run  # noqa: E402
from models import ADAMW_TOL, TOL  # noqa: E402

_results = WorldResults(run, "finetune")
RESULTS = _results  # read by the `res` fixture (conftest.py)


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_gradual_unfreezing_trains_as_pytorch(res, opt, stage):
    got = ok(res[0], f"unfreeze_{opt}_stage{stage}")
    assert got["frozen_chunks_at_start"] == 2 and got["frozen_chunks_at_end"] == 0  # c_fc, then c_attn
    assert got["diff"] <= TOL[opt]


@pytest.mark.parametrize("name", ["offload_stage1", "offload_stage2", "offload_stage3", "offload_params_stage3"])
def test_gradual_unfreezing_with_offload(res, name):
    assert ok(res[0], f"unfreeze_{name}")["diff"] <= ADAMW_TOL


def test_gradual_unfreezing_in_bf16(res):
    assert ok(res[0], "unfreeze_bf16_stage3")["diff"] <= 1e-2


def test_unfrozen_parameters_join_an_optimizer_callables_group(res):
    assert ok(res[0], "unfreeze_factory_stage2")["diff"] <= TOL["sgd"]


@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_saved_after_unfreezing_resumes_exactly(res, stage):
    assert ok(res[0], f"unfreeze_then_resume_stage{stage}")["diff"] <= ADAMW_TOL


def test_unfreezing_with_param_groups_made_by_position_is_refused(res):
    got = res[0]["unfreeze_with_groups_by_position"]
    assert got.get("error", "").startswith("FrozenParameterError"), got


@pytest.mark.parametrize("stage", range(4))
def test_lora_through_peft(res, stage):
    got = ok(res[0], f"lora_stage{stage}")
    assert got["diff"] <= ADAMW_TOL
    # The frozen base holds no gradient or optimizer memory: only the adapters' chunk has them.
    trainable, world = got["trainable_chunk_numel"], res[1]
    assert trainable < got["trainable_numel"] + 64 * world and got["frozen_chunk_numel"] > 20 * trainable
    held = trainable if stage <= 1 else trainable // world  # stages 0-1 keep the full gradient
    assert got["grad_bytes"] == 4 * held
    assert got["optimizer_bytes"] <= 2 * 4 * trainable  # AdamW's two moments of this rank's adapter part
    if "files" in got:  # rank 0 opened the save
        assert "adapter_model.safetensors" in got["files"] and "adapter_config.json" in got["files"]
        assert got["adapter_keys"] == 8 and got["adapter_diff"] == 0.0


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("name", list(PEFT_SAVES))
def test_a_peft_models_save_holds_what_peft_saves(res, name, stage):
    """engine.save_pretrained of a peft model writes peft's own file for the trained model: the same
    keys and values as peft's save_pretrained of that model, loaded by PeftModel.from_pretrained.
    Before, adapters in a ParameterDict (LoRA's embedding adapters, IA3's scales) and a targeted
    embedding's base layer were left out (the load kept their initial values, silently), trainable
    tokens raised KeyError, and modules_to_save at stage 3 above a world of 1 raised DivergedError."""
    got = ok(res[0], f"peft_saves_{name}_stage{stage}")
    assert got["keys"] == got["plain_keys"] and got["keys"]
    assert got["value_diff"] == 0.0 and got["loaded_diff"] == 0.0
    assert got["trained_moved"] > 0  # every trained tensor differs from its initial value
