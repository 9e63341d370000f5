"""Behaviour scenarios ported from DeepSpeed's and FSDP2's test suites (tests/peer_scenarios.py and
the modules it merges name the peer file of each), at world sizes 1, 2 and 3 and every stage.
Tolerances: fp32 SGD with momentum 1e-5; Adam, AdamW and Adagrad ADAMW_TOL (see tests/models.py)."""
import pytest

from distributed import WorldResults, ok
from models import ADAMW_TOL
from peer_scenarios import run

SGD_TOL = 1e-5
_results = WorldResults(run, "peer")
RESULTS = _results  # read by the `res` fixture (conftest.py)


stages = pytest.mark.parametrize("stage", range(4))


@stages
def test_an_unused_layer_is_never_stepped(res, stage):
    got = ok(res[0], f"unused_layer_stage{stage}")
    assert got["unused_kept"] and got["diff"] <= ADAMW_TOL


@stages
def test_a_forward_output_left_out_of_the_loss(res, stage):
    assert ok(res[0], f"unused_forward_output_stage{stage}")["diff"] <= ADAMW_TOL


@stages
def test_parameters_trainable_in_alternate_micro_batches(res, stage):
    assert ok(res[0], f"unbalanced_gradients_stage{stage}")["diff"] <= SGD_TOL


@stages
def test_a_child_weight_read_by_its_parent(res, stage):
    assert ok(res[0], f"external_parameter_read_stage{stage}")["diff"] <= SGD_TOL


@stages
def test_one_layer_applied_three_times(res, stage):
    assert ok(res[0], f"repeat_forward_loop_stage{stage}")["diff"] <= SGD_TOL


@stages
def test_a_module_called_twice(res, stage):
    assert ok(res[0], f"multi_forward_module_stage{stage}")["diff"] <= SGD_TOL


@stages
def test_one_module_registered_twice(res, stage):
    got = ok(res[0], f"same_module_twice_stage{stage}")
    assert got["chunked_params"] == 4 and got["both_paths_equal"] and got["diff"] <= SGD_TOL


@stages
def test_tied_embeddings_with_an_uneven_vocabulary(res, stage):
    got = ok(res[0], f"tied_uneven_stage{stage}")
    assert got["all_rows_changed"] and got["tied_equal"] and got["diff"] <= ADAMW_TOL


@stages
def test_a_loss_through_the_engine_and_the_bare_module(res, stage):
    assert ok(res[0], f"engine_and_module_branches_stage{stage}")["diff"] <= SGD_TOL


@stages
def test_frozen_and_trainable_layers_reused_under_no_grad(res, stage):
    got = ok(res[0], f"frozen_multi_forward_stage{stage}")
    assert got["frozen_kept"] and got["diff"] <= ADAMW_TOL


@stages
def test_zero_element_parameters(res, stage):
    got = ok(res[0], f"zero_element_parameters_stage{stage}")
    for layout, figures in got.items():
        assert figures["shapes_kept"] and figures["diff"] <= SGD_TOL, layout


@stages
def test_shapes_that_do_not_divide_by_the_world_size(res, stage):
    assert ok(res[0], f"odd_shapes_stage{stage}")["diff"] <= ADAMW_TOL


@stages
def test_one_element_parameters_and_a_frozen_first_layer(res, stage):
    got = ok(res[0], f"single_element_parameters_stage{stage}")
    for freeze, figures in got.items():
        assert figures["diff"] <= ADAMW_TOL and not figures["frozen_state"], freeze


@stages
def test_fewer_elements_than_ranks(res, stage):
    assert ok(res[0], f"fewer_elements_than_ranks_stage{stage}")["diff"] <= SGD_TOL


@stages
def test_three_micro_batches_per_step(res, stage):
    assert ok(res[0], f"accumulation_three_micro_batches_stage{stage}")["diff"] <= SGD_TOL


@stages
def test_two_forwards_then_one_backward(res, stage):
    assert ok(res[0], f"two_forwards_one_backward_stage{stage}")["diff"] <= SGD_TOL


@stages
def test_a_frozen_middle_layer_and_a_tuple_output(res, stage):
    got = ok(res[0], f"frozen_middle_layer_stage{stage}")
    assert got["frozen_kept"] and got["diff"] <= ADAMW_TOL


@stages
def test_bitfit_frozen_before_or_after_initialize(res, stage):
    got = ok(res[0], f"bitfit_stage{stage}")
    assert got["before"] <= ADAMW_TOL and got["after"] <= ADAMW_TOL


@stages
def test_a_no_grad_forward_between_steps_changes_nothing(res, stage):
    got = ok(res[0], f"no_grad_forward_between_steps_stage{stage}")
    assert got["steps"] == 3 and got["diff"] <= SGD_TOL


@stages
def test_switching_between_train_and_eval(res, stage):
    r, world = res
    got = ok(r, f"train_eval_switching_stage{stage}")
    assert got["finite"] and got["ranks_agree_on_weights"]
    if world == 1:
        assert got["eval_diff"] <= SGD_TOL


@stages
def test_weights_loaded_into_the_wrapped_model_reach_the_next_forward(res, stage):
    assert ok(res[0], f"reload_then_no_grad_forward_stage{stage}")["outs"] == [9.0, 18.0, 27.0]


@stages
def test_clipping_below_and_above_the_norm(res, stage):
    got = ok(res[0], f"clip_values_stage{stage}")
    for clip, figures in got.items():
        assert figures["diff"] <= SGD_TOL and figures["norm_diff"] <= 1e-5, clip


@stages
def test_all_zero_gradients_with_clipping(res, stage):
    got = ok(res[0], f"zero_gradients_with_clipping_stage{stage}")
    assert got["norm"] == 0.0 and got["diff"] <= ADAMW_TOL


@stages
def test_adagrad_param_groups(res, stage):
    got = ok(res[0], f"adagrad_param_groups_stage{stage}")
    assert got["groups_kept"] and got["diff"] <= ADAMW_TOL


@stages
def test_sgd_groups_and_a_frozen_layer_through_a_checkpoint(res, stage):
    got = ok(res[0], f"sgd_groups_through_a_checkpoint_stage{stage}")
    assert got["weight_decay"] == [0.01, 0.0] and got["diff"] <= SGD_TOL


@stages
def test_forward_output_containers(res, stage):
    got = ok(res[0], f"output_containers_stage{stage}")
    types = {"dict": "dict", "namedtuple": "Point", "typed": "Typed", "tuple": "tuple", "list": "list"}
    for kind, figures in got.items():
        assert figures["type"] == types[kind] and figures["diff"] <= SGD_TOL, kind


@stages
def test_container_inputs_and_activations(res, stage):
    got = ok(res[0], f"container_inputs_stage{stage}")
    assert got["inputs_kept"] and got["diff"] <= SGD_TOL


@stages
def test_bare_parameters_at_every_level(res, stage):
    got = ok(res[0], f"bare_parameters_at_every_level_stage{stage}")
    assert got["names"] and got["diff"] <= ADAMW_TOL
