"""Issue 30: every weight file checked before its values are used (tests/file_scenarios.py, world
2: each refusal is the same WeightsError on both ranks)."""
import pytest

pytest.importorskip("transformers")

from distributed import WorldResults, ok  # noqa: E402
from file_scenarios import run  # noqa: E402

RESULTS = WorldResults(run, "files", worlds=(2,))  # read by the `res` fixture (conftest.py)


def same_on_every_rank(errors: list[str], world: int) -> str:
    assert len(errors) == world and len(set(errors)) == 1, errors
    return errors[0]


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlinked_dir", "symlinked_file"])
def test_an_index_naming_a_file_outside_its_folder_is_refused(res, kind):
    text = same_on_every_rank(ok(res[0], "index_paths")[kind], res[1])
    assert text.startswith("WeightsError") and "model.safetensors.index.json names" in text, text
    assert "outside" in text and "refused" in text, text


def test_a_folder_of_symlinks_into_a_blob_store_loads(res):
    assert ok(res[0], "index_paths")["cache_diff"] == 0.0


def test_a_weight_map_that_is_not_a_mapping_is_refused(res):
    text = same_on_every_rank(ok(res[0], "index_paths")["weight_map_list"], res[1])
    assert text.startswith("WeightsError") and "'weight_map' must map tensor names to file names" in text, text


@pytest.mark.parametrize("when", ["at_init", "load"])
def test_a_file_dtype_of_another_kind_is_refused(res, when):
    got = ok(res[0], "impossible_values")
    text = same_on_every_rank(got[f"int_{when}"], res[1])
    assert text.startswith("WeightsError") and "dtype of another kind for transformer.h.0.attn.c_attn.weight" in text
    assert "torch.int32" in text and got["int_unchanged"] == 0.0


@pytest.mark.parametrize("when", ["at_init", "load"])
def test_an_unknown_dtype_is_refused(res, when):
    got = ok(res[0], "impossible_values")
    text = same_on_every_rank(got[f"fp8_{when}"], res[1])
    assert text.startswith("WeightsError") and "transformer.h.0.mlp.c_fc.weight" in text and "'F8_E4M3'" in text
    assert got["fp8_unchanged"] == 0.0


@pytest.mark.parametrize("when", ["at_init", "load"])
def test_nan_or_inf_in_a_file_is_refused_naming_the_tensors(res, when):
    got = ok(res[0], "impossible_values")
    text = same_on_every_rank(got[f"nonfinite_{when}"], res[1])
    assert text.startswith("WeightsError") and "NaN or inf" in text
    assert "transformer.h.0.mlp.c_proj.weight" in text and "transformer.h.1.attn.c_proj.bias" in text, text
    assert got["nonfinite_unchanged"] == 0.0  # load_weights wrote nothing


def test_allow_nonfinite_weights_loads_them(res):
    got = ok(res[0], "impossible_values")
    assert got["allowed_nan"] and got["allowed_inf"]
