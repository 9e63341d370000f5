"""Single-process tests of the config: what it refuses and how it names the key, its files (JSON,
TOML), the warnings below stage 3, and engine attributes that fall through to the model."""
import json

import pytest
import torch

import zeroshard
from zeroshard.config import Config, load_config


# -- config ---------------------------------------------------------------------------------------
def test_tensor_parallel_config_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="partition_activations .* needs tensor_parallel > 1"):
        load_config({"partition_activations": True})
    assert load_config({"tensor_parallel": 2, "offload": "auto"}).planned  # the planner takes TP models
    with pytest.raises(ValueError, match="tensor_parallel"):
        load_config({"tensor_parallel": 0})
    assert load_config({"tensor_parallel": 2, "partition_activations": True}).tensor_parallel == 2


def test_shard_group_size_config_refuses_what_it_cannot_do():
    for bad in (0, -2, "gpu", 2.0, True):
        with pytest.raises(zeroshard.ConfigError, match="shard_group_size"):
            load_config({"shard_group_size": bad})
    for combo, words in (({"stage": 0}, "stage 0 shards nothing"),):
        with pytest.raises(zeroshard.ConfigError, match=words):
            load_config({"shard_group_size": 2, **combo})
    assert load_config({"shard_group_size": "node", "stage": 3}).shard_group_size == "node"
    assert load_config({"shard_group_size": 2, "offload": "auto", "stage": "auto"}).planned


def test_shard_optimizer_across_replicas_refuses_what_it_cannot_do():
    for combo, words in (({}, "set shard_group_size"), ({"shard_group_size": 2, "stage": 3}, "stage 1 or 2"),
                         ({"shard_group_size": 2, "offload_optimizer": True}, "stay on the device"),
                         ({"shard_group_size": 2, "offload": "auto"}, "stay on the device")):
        with pytest.raises(zeroshard.ConfigError, match=words):
            load_config({"shard_optimizer_across_replicas": True, **combo})
    with pytest.raises(zeroshard.ConfigError, match="true or false"):
        load_config({"shard_optimizer_across_replicas": "yes", "shard_group_size": 2})
    assert load_config({"shard_optimizer_across_replicas": True, "shard_group_size": 2}).shard_optimizer_across_replicas


def test_hpz_group_size_config_refuses_what_it_cannot_do():
    for bad in (0, "gpu", 2.0):
        with pytest.raises(zeroshard.ConfigError, match="hpz_group_size"):
            load_config({"hpz_group_size": bad, "stage": 3})
    for combo, words in (({"stage": 2}, "needs stage 3"), ({"stage": 3, "shard_group_size": 2}, "choose one"),
                         ({"stage": 3, "offload": "auto"}, "not planned")):
        with pytest.raises(zeroshard.ConfigError, match=words):
            load_config({"hpz_group_size": 2, **combo})
    assert load_config({"hpz_group_size": "node", "stage": 3}).hpz_group_size == "node"


def test_shard_group_size_must_divide_the_data_parallel_world(monkeypatch):
    from zeroshard.distributed.shard_groups import resolve_group_size
    assert resolve_group_size(None, 6) == 6 and resolve_group_size(3, 6) == 3
    with pytest.raises(zeroshard.ConfigError, match="does not divide the 6 data-parallel ranks"):
        resolve_group_size(4, 6)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resolve_group_size("node", 8) == 4 and resolve_group_size("node", 4, tensor_parallel=2) == 2
    with pytest.raises(zeroshard.ConfigError, match="do not split into tensor-parallel groups of 3"):
        resolve_group_size("node", 6, tensor_parallel=3)


@pytest.mark.parametrize("key,value,valid", [
    ("stage", 4, "0, 1, 2, 3 or 'auto'"), ("stage", True, "0, 1, 2, 3 or 'auto'"), ("precision", "fp8", "'bf16'"),
    ("gradient_accumulation_steps", 0, ">= 1"), ("clip_grad_norm", -1.0, "> 0"),
    ("chunk_size", "big", "'auto'"), ("cache_chunks", 0, ">= 1"), ("prefetch", 1, "true or false"),
    ("initial_loss_scale", float("inf"), "finite"), ("initial_loss_scale", float("nan"), "finite"),
    ("initial_loss_scale", 0.0, "> 0"), ("compile_scope", "layers", "'auto', 'model' or 'blocks'"),
])
def test_bad_config_value_names_key_and_valid_values(key, value, valid):
    with pytest.raises(ValueError) as e:
        load_config({key: value})
    assert key in str(e.value) and valid in str(e.value)


@pytest.mark.parametrize("name, text, words", [
    ("bad.json", '{"stage": 3,,}', "does not parse as JSON: Expecting property name"),
    ("bad.toml", "stage = = 3", "does not parse as TOML: Invalid value"),
    ("binary.json", b"\xff\xfe\x00", "does not parse as JSON"),
    ("missing.json", None, "cannot read"),
    ("missing.toml", None, "No such file or directory"),
])
def test_a_config_file_that_cannot_be_read_is_named(tmp_path, name, text, words):
    """Issue 30, point 6: a bare JSONDecodeError/TOMLDecodeError without the file's name, or a
    FileNotFoundError, is a ConfigError (a ValueError) naming the file and why, in one line."""
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    elif text is not None:
        path.write_text(text)
    with pytest.raises(ValueError) as e:
        load_config(str(path))
    assert isinstance(e.value, zeroshard.ConfigError) and str(path) in str(e.value) and words in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="does not parse" if text is not None else "cannot read"):
        zeroshard.initialize(torch.nn.Linear(2, 2), lambda ps: torch.optim.SGD(ps, lr=0.1), str(path))


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stage3_only_keys_warn_below_stage3(stage):
    with pytest.warns(UserWarning, match=f"cache_chunks=2 has no effect at stage {stage}"):
        load_config({"stage": stage, "cache_chunks": 2})
    with pytest.warns(UserWarning, match=f"prefetch=False has no effect at stage {stage}"):
        load_config({"stage": stage, "prefetch": False})


def test_stage3_keys_at_stage3_do_not_warn():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config({"stage": 3, "cache_chunks": 2, "prefetch": False})


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_engine_attributes_fall_through_to_the_model(stage):
    """As DeepSpeed's engine: engine.config is the transformers config, engine.generate generates
    (the same tokens as a plain copy of the trained weights, at stage 3 through the gather hooks)."""
    from models import make_sgd, tiny_gpt2
    engine = zeroshard.initialize(tiny_gpt2(), make_sgd, {"stage": stage, "chunk_size": 20000})
    x = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    assert type(engine.config).__name__ == "GPT2Config" and engine.config.n_layer == 2
    assert engine.zeroshard_config.stage == stage
    plain = tiny_gpt2()
    plain.load_state_dict(engine.full_state_dict())
    engine.eval()
    plain.eval()
    with torch.no_grad():
        got = engine.generate(x[:, :4], max_new_tokens=3, do_sample=False)
        want = plain.generate(x[:, :4], max_new_tokens=3, do_sample=False)
    assert torch.equal(got, want)
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
        engine.no_such_thing


def test_unknown_config_key_lists_valid_keys():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['stagee'\].*'stage'"):
        load_config({"stagee": 3})


def test_config_from_json_and_toml(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"stage": 3, "precision": "bf16"}))
    (tmp_path / "c.toml").write_text('stage = 1\nclip_grad_norm = 1.0\nchunk_size = 4096\n')
    assert load_config(str(tmp_path / "c.json")) == Config(stage=3, precision="bf16")
    assert load_config(tmp_path / "c.toml") == Config(stage=1, clip_grad_norm=1.0, chunk_size=4096)
    with pytest.raises(ValueError, match="json or .toml"):
        load_config(str(tmp_path / "c.yaml"))
