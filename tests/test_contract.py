"""The PyTorch contract (issue 14): ordinary PyTorch training code, run through the engine, trains
what plain single-process PyTorch trains on the global batch, at world sizes 1, 2 and 3 and every
stage. Tolerances as tests/test_parity.py: fp32 SGD with momentum 1e-5, fp32 AdamW ADAMW_TOL.
"""
import pytest

from contract_call_scenarios import LAYERS
from contract_optimizer_scenarios import CLIP_TO
from contract_scenarios import run
from distributed import WorldResults, ok
from models import TOL

_results = WorldResults(run, "contract")
RESULTS = _results  # read by the `res` fixture (conftest.py)


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_two_backwards_before_a_step_add_up(res, opt, stage):
    r, _ = res
    got = ok(r, f"two_backwards_{opt}_stage{stage}")
    assert got["applied"] == [True] * 3
    assert got["diff"] <= TOL[opt]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_backwards_before_a_step_add_up_with_the_optimizer_offloaded(res, stage):
    r, _ = res
    got = ok(r, f"two_backwards_offload_sgd_stage{stage}")
    assert got["applied"] == [True] * 3
    assert got["diff"] <= TOL["sgd"]


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_step_without_backward_changes_nothing(res, opt, stage):
    r, _ = res
    got = ok(r, f"step_without_backward_{opt}_stage{stage}")
    assert got["extra_applied"] == [False] * 4 and got["steps"] == 3
    assert got["diff"] <= TOL[opt]


@pytest.mark.parametrize("stage", range(4))
def test_ranks_whose_first_forward_differs_pack_chunks_alike(res, stage):
    r, world = res
    got = r[f"first_forward_differs_stage{stage}"]
    if stage == 3 and world > 1:  # odd ranks gather in another order in every forward
        assert got.get("error", "").startswith("DivergedError"), got
        return
    got = ok(r, f"first_forward_differs_stage{stage}")
    assert got["diff"] <= TOL["sgd"] and got["ranks_agree"]
    assert got["chunks"][1] == ["a.weight", "a.bias"]  # rank 0's order: a before b


@pytest.mark.parametrize("form", ["", "_factory"])
@pytest.mark.parametrize("stage", range(4))
def test_param_groups_train_as_in_torch_through_an_lr_schedule(res, stage, form):
    """Issue 14: decay / no-decay / second-lr groups, exact against torch (AdamW tolerance), and the
    schedule's per-group learning rates visible in engine.optimizer.param_groups."""
    r, _ = res
    got = ok(r, f"param_groups{form}_stage{stage}")
    assert got["groups"] == 3 and got["lrs_match"] and got["same_optimizer"]
    assert got["diff"] <= TOL["adamw"]


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("form", ["offload", "cpu_adam"])
def test_param_groups_with_the_optimizer_offloaded(res, form, stage):
    """torch's AdamW, or zeroshard.CPUAdamW, stepping on the host: AdamW tolerance in fp32."""
    r, _ = res
    got = ok(r, f"param_groups_{form}_stage{stage}")
    assert got["groups"] == 3 and got["lrs_match"] and got["same_optimizer"]
    assert got["diff"] <= TOL["adamw"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_param_groups_with_the_cpu_adam_in_bf16(res, stage):
    """bf16 compute against the fp32 reference: 16-bit tolerance 1e-2 after 4 steps."""
    r, _ = res
    got = ok(r, f"param_groups_cpu_adam_bf16_stage{stage}")
    assert got["groups"] == 3 and got["lrs_match"] and got["diff"] <= 1e-2


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("when", ["before_forward", "after_steps", "at_initialize_direct"])
def test_a_parameter_frozen_after_initialize_is_not_stepped(res, when, stage):
    """at_initialize_direct: frozen before initialize, the wrapped model called, not the engine;
    unfrozen after 2 steps, it trains from then on."""
    r, _ = res
    assert ok(r, f"requires_grad_{when}_stage{stage}")["diff"] <= TOL["adamw"]


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_a_module_skipped_in_some_steps_is_left_alone(res, opt, stage):
    r, _ = res
    assert ok(r, f"dynamic_control_flow_{opt}_stage{stage}")["diff"] <= TOL[opt]


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_backward_of_another_models_loss_applies_no_update(res, opt, stage):
    r, _ = res
    got = ok(r, f"loss_from_another_model_{opt}_stage{stage}")
    assert got["applied"] is False and got["steps"] == 0 and got["diff"] == 0.0


@pytest.mark.parametrize("name", [f"stage{s}" for s in range(4)] + ["offload_stage2", "offload_stage3",
                                                                    "offload_params_stage3"])
def test_load_state_dict_into_the_wrapped_model_reaches_the_masters(res, name):
    r, _ = res
    got = ok(r, f"load_state_dict_{name}")
    assert got["loaded"] == 0.0 and got["diff"] == 0.0


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_a_parameter_returned_from_its_modules_forward_trains(res, opt, stage):
    r, _ = res
    got = ok(r, f"returned_parameter_{opt}_stage{stage}")
    assert got["chunks"] >= 3 and got["diff"] <= TOL[opt]


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_multihead_attention_trains_at_every_stage(res, opt, stage):
    r, _ = res
    got = ok(r, f"multihead_attention_{opt}_stage{stage}")
    assert got["chunks"] >= 3 and got["eval_finite"] and got["diff"] <= TOL[opt]


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_parameters_read_outside_every_forward_train_as_in_torch(res, opt, stage):
    r, world = res
    got = ok(r, f"read_outside_forward_{opt}_stage{stage}")
    assert got["chunks"] >= 2 and got["diff"] <= TOL[opt] and got["copied"] == 0.0, got
    assert got["doubled"] == 0.0, got  # logit_scale.mul_(2) between steps
    if stage == 3:  # through .data: unseen, so refused
        assert len(got["write"]) == world and all(e.startswith("ShardedParameterError") for e in got["write"]), got
        assert got["unchanged"] == 0.0


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_custom_autograd_functions_given_parameters_train_as_in_torch(res, opt, stage):
    got = ok(res[0], f"custom_function_{opt}_stage{stage}")
    assert got["chunks"] >= 2 and got["diff"] <= TOL[opt] and got["moved"] > 1e-3, got
    if stage == 3:
        assert got["departures"] == 0, got


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_functional_call_with_the_calls_own_tensors_trains_as_in_torch(res, opt, stage):
    got = ok(res[0], f"functional_call_{opt}_stage{stage}")
    assert got["chunks"] >= 2 and got["module"] <= TOL[opt] and got["engine"] <= TOL[opt], got


@pytest.mark.parametrize("stage", range(4))
def test_the_module_api_and_full_parameters_on_the_wrapped_model(res, stage):
    got = ok(res[0], f"module_api_stage{stage}")
    assert got["frozen_kept"] and got["others_moved"] and got["state_dict_equal"] and got["pretrained_equal"]
    # The two engines pack the frozen parameter differently (a trainable chunk, a frozen one), so
    # their gradient buffers differ and gloo's ring sums bf16 gradients in another order at world 3.
    assert got["written_back"] and got["diff"] <= 1e-5 and got["frozen_equal"]


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16bit_training_with_batchnorm_fp32_buffers_and_fp32_activations(res, precision, stage):
    r, world = res
    got = ok(r, f"precision_{precision}_stage{stage}")
    assert got["finite"] and got["steps"] == 3 and got["buffer_dtype"] == {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[precision]
    if world == 1:
        assert got["diff"] <= 2e-2


@pytest.mark.parametrize("stage", [2, 3])
def test_fp32_buffers_and_fp32_gradient_reduction_under_bf16(res, stage):
    r, world = res
    got = ok(r, f"precision_fp32_buffers_fp32_reduce_stage{stage}")
    assert got["finite"] and got["buffer_dtype"] == "torch.float32"
    assert got["grad_bytes"] > r[f"precision_bf16_stage{stage}"]["grad_bytes"]  # fp32 gradient buffers
    if world == 1:
        assert got["diff"] <= 2e-2


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_zero_grad_between_micro_batches_drops_them(res, opt, stage):
    assert ok(res[0], f"zero_grad_mid_window_{opt}_stage{stage}")["diff"] <= TOL[opt]


@pytest.mark.parametrize("stage", [0, 3])
def test_a_model_the_chunks_cannot_hold_is_refused_on_every_rank_untouched(res, stage):
    r, world = res
    got = ok(r, f"untrainable_stage{stage}")
    names = {"float64": "float64 parameters 'lin.weight' (torch.float64), 'lin.bias'",
             "complex": "complex parameters 'phase' (torch.complex64)",
             "integer": "integer or bool parameters 'q' (torch.int8)",
             "sparse": "sparse-gradient modules 'emb' (Embedding(sparse=True))",
             "lazy": "uninitialized parameters 'head.weight' (torch.float32), 'head.bias'"}
    for kind, named in names.items():
        assert len(got[kind]["raised"]) == world, got[kind]
        for raised in got[kind]["raised"]:
            assert raised.startswith("UnsupportedModelError: zeroshard cannot train this model") and named in raised, \
                (kind, raised)
        assert got[kind]["unchanged"], kind


@pytest.mark.parametrize("name", ["fp32_stage0", "bf16_stage0", "fp32_stage1", "bf16_stage2", "fp32_stage1_offload",
                                  "bf16_stage2_offload", "fp32_stage2_disk", "fp32_stage2_delayed", "fp32_stage3",
                                  "bf16_stage3", "bf16_stage3_offload_params", "bf16_stage3_disk",
                                  "fp32_stage3_delayed"])
def test_writes_into_parameters_last_as_in_torch(res, name):
    """A row set by hand, a bias set by nn.init, every parameter clamped, every parameter scaled by
    torch._foreach_mul_ and a row of each shifted through views taken together between steps (the
    last read by full_state_dict at once), and a weight clamped inside the forward, with SGD and
    momentum, against plain PyTorch (fp32) on the global batch: fp32 within 1e-5; bf16 within 1e-2
    (its forward and gradients are bf16's: 8 bits of mantissa on values up to 0.5). A write lost to
    the master or the shard leaves the row at its initial values, the clamped ones up to 0.4 away
    and the scaled ones 2x. Stage 3 departs from its chunk schedule nowhere (nn.init under grad
    mode was taken for a use of the step), and its clamp loop leaves no chunk gathered (each
    `p.clamp_()` returns p, which was taken for a view to keep gathered until the next forward). With the delayed update, a write while it is in flight
    raises EngineCallError on every rank (the update would land over it), and the same writes
    inside full_parameters() last."""
    r, world = res
    got = ok(r, f"written_between_steps_{name}")
    if name.endswith("delayed"):
        assert len(got["raised"]) == world and all(
            e.startswith("EngineCallError: zeroshard: ") and "written in place while the delayed update" in e
            for e in got["raised"]), got
    assert got["diff"] <= (1e-5 if name.startswith("fp32") else 1e-2), got
    assert got["departures"] == 0, got
    if name == "fp32_stage3":  # a 1-chunk rCache: the clamp over every parameter kept none of them gathered
        assert got["chunks"] == 3 and got["cache_peak"] < got["chunks"], got


@pytest.mark.parametrize("name", ["bf16_stage1", "fp32_stage2_offload", "fp32_stage3"])
def test_a_write_before_the_first_forward_lasts_through_the_repack(res, name):
    """A weight set by hand right after initialize, on a model whose first forward re-packs its
    chunks, then one SGD step: against plain PyTorch, fp32 1e-5, bf16 1e-2 (the re-pack read the
    masters without the write where they are apart: the weight stayed at its initial values)."""
    got = ok(res[0], f"written_before_the_first_forward_{name}")
    assert got["diff"] <= (1e-5 if name.startswith("fp32") else 1e-2), got


@pytest.mark.parametrize("name", ["stage2_delayed", "stage3", "stage3_delayed"])
def test_a_parametrization_for_each_call_writes_nothing(res, name):
    """A module that parametrizes its weight for each call and removes it after (peft's
    ParamWrapper) trains exactly what the plain module trains (it raised EngineCallError with the
    delayed update: torch's set_ of the weight to itself moves its version counter)."""
    got = ok(res[0], f"parametrized_per_call_{name}")
    assert got["diff"] == 0.0, got


@pytest.mark.parametrize("config", ["stage0", "stage1", "stage2", "stage3", "stage3_cache1"])
@pytest.mark.parametrize("kind", ["adversarial", "retained", "penalised", "r1", "some_inputs"])
def test_gradients_besides_the_loss_backward_train_as_in_torch(res, kind, config):
    """torch.autograd.grad of the input (FGSM), a backward that retains its graph for a second, a
    gradient penalty (create_graph=True), in the loss or in a backward of its own (R1: it raised
    AttributeError on the undefined gradient it gives a bias), backward(inputs=...) of some
    parameters (stage 3 raised ValueError): fp32 SGD tolerance; stage 3 also with a 1-chunk
    rCache, where the two chunks are gathered again for every use."""
    r, _ = res
    got = ok(r, f"gradient_calls_{kind}_{config}")
    assert got["chunks"] == 2 and got["diff"] <= TOL["sgd"]


@pytest.mark.parametrize("stage", range(4))
def test_autograd_grad_of_the_parameters(res, stage):
    """Each rank's own gradients, no .grad written, and training goes on exactly after it; at stage
    3 too, where the parameters, read outside every forward, are gathered for the call (it raised
    ShardedParameterError)."""
    r, world = res
    got = ok(r, f"parameter_gradients_stage{stage}")
    assert got["grads_left_alone"] and got["diff"] <= TOL["sgd"]
    assert got["raised"] == ["no error"] * world and got["grads_diff"] <= 1e-6


@pytest.mark.parametrize("config", ["stage0", "stage1", "stage2", "stage3", "stage3_cache1"])
def test_the_users_own_autocast_trains_as_ddp_would(res, config):
    """torch.autocast(bf16) around an fp32 engine's forward: the ranks' batches' gradients summed
    (DDP's result) within fp32 SGD tolerance, the global batch's within the 16-bit tolerance."""
    r, _ = res
    got = ok(r, f"user_autocast_{config}")
    assert got["dtype"] == "torch.float32"
    assert got["diff_per_rank_batches"] <= TOL["sgd"] and got["diff_global_batch"] <= 1e-2


@pytest.mark.parametrize("stage", range(4))
def test_a_weight_written_inside_the_forward_is_refused_where_it_would_be_lost(res, stage):
    """nn.Embedding(max_norm=...): UnsupportedModelError on every rank, model untouched, above a world
    size of 1; at a world size of 1, every stage trains exactly as torch (stage 3 too, since writes
    in a forward are kept)."""
    r, world = res
    got = ok(r, f"forward_writes_stage{stage}")
    if world > 1:
        assert len(got["raised"]) == world and got["unchanged"]
        assert all(e.startswith("UnsupportedModelError: ") and "'emb' (Embedding(max_norm=1.0))" in e
                   for e in got["raised"]), got["raised"]
    else:
        assert got["raised"] == ["no error"] and got["diff"] <= TOL["sgd"]


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("form", ["frozen", "trained"])
def test_a_param_group_added_after_initialize_trains_in_it(res, form, stage):
    """optimizer.add_param_group after 2 steps, of a block unfrozen then (or trained in no group
    until then), with its own learning rate: AdamW tolerance against torch; a parameter already in
    a group, added again: ValueError on every rank. A checkpoint saved after the group was added
    resumes exactly where the group is added again before loading (as torch needs), and raises
    CheckpointError on every rank where it is not."""
    r, world = res
    got = ok(r, f"added_param_group_{form}_stage{stage}")
    assert got["diff"] <= TOL["adamw"] and got["lrs"] == [1e-3, 3e-3]
    assert len(got["twice"]) == world and all(
        e.startswith("ConfigError: zeroshard: optimizer.add_param_group was given parameter ") for e in got["twice"])
    assert got["resumed_diff"] == 0.0  # the group's state and lr came back with the checkpoint
    assert len(got["not_added"]) == world and all(
        e.startswith("CheckpointError: zeroshard: the checkpoint's optimizer has 2 parameter groups, this one 1")
        for e in got["not_added"])


@pytest.mark.parametrize("stage", range(4))
def test_optimizer_state_dicts_load_as_in_torch(res, stage):
    """optimizer.state_dict()/load_state_dict() from a custom loop, on a model whose layers are
    used in another order than registered: a plain torch run's state resumes at every stage (AdamW
    tolerance); a rank's own dict resumes bit for bit; where every rank steps whole parameters
    (stage 0, a world of 1) the dict is torch's format, which every rank and plain torch load;
    otherwise a warning says, once, that the dict holds the rank's shard, and rank 0's dict on every
    rank raises CheckpointError on every rank.
    engine.full_optimizer_state_dict() is the plain run's optimizer.state_dict() at every stage
    (groups, keys, values within the AdamW tolerance), which plain torch loads, with an optimizer
    instance and with a callable (handed each rank's pieces); with rank0_only (and
    full_state_dict's) only rank 0 keeps it."""
    r, world = res
    got = ok(r, f"optimizer_state_dicts_stage{stage}")
    assert got["plain"] <= TOL["adamw"] and got["own"] == 0.0
    assert got["full_groups"] and got["full_keys"] and got["full_vs_torch"] <= TOL["adamw"]
    assert got["full_from_callable"] is not False and got["full_from_callable"] <= TOL["adamw"]
    assert got["rank0_only"]  # rank 0's dicts as without it, the other ranks' {}
    whole = stage == 0 or world == 1
    assert got["torch_format"] == whole
    assert got["shard_warnings"] == (0 if whole else 1)  # a shard's dict says so, once
    if whole:
        assert got["rank0"] == ["no error"] * world and got["into_torch"] <= TOL["adamw"]
    else:
        assert len(got["rank0"]) == world and all(
            e.startswith("CheckpointError: ") and "holds no state for elements" in e for e in got["rank0"]), got["rank0"]


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_a_plain_loop_steps_through_the_users_own_optimizer(res, opt, stage):
    """loss.backward(); clip_grad_norm_(...); optimizer.step(); scheduler.step();
    optimizer.zero_grad() on the user's optimizer trains what plain torch trains (the scheduler
    built before initialize with SGD, after it with AdamW), zero_grad between backwards drops the
    first; torch's clip_grad_norm_ returns torch's norms and clips (given the model's parameters
    with SGD, the optimizer's with AdamW); a closure raises, as do a step after .grad set by hand
    with no backward, whose .grad are cleared, and another optimizer's step over the model's
    parameters, both changing nothing; so does torch's GradScaler, naming the config's fp16 loss
    scaling."""
    r, world = res
    got = ok(r, f"plain_loop_{opt}_stage{stage}")
    assert got["diff"] <= TOL[opt] and got["steps"] == 4
    torch_norms, norms = got["norms"][:4], got["norms"][4:]
    assert max(abs(a - b) / a for a, b in zip(torch_norms, norms)) < 1e-5, (torch_norms, norms)
    assert max(torch_norms) > CLIP_TO, torch_norms  # it clips
    assert len(got["closure"]) == world and all(e.startswith("EngineCallError: zeroshard: optimizer.step(closure)")
                                                for e in got["closure"])
    assert len(got["hand_set"]) == world and all(
        e.startswith("EngineCallError: zeroshard: transformer.wte.weight (") and "has a .grad set by hand" in e
        for e in got["hand_set"]), got["hand_set"]
    assert got["hand_set_cleared"]
    assert len(got["foreign"]) == world and all(
        e.startswith("EngineCallError: zeroshard: SGD.step() over transformer.wte.weight, which zeroshard trains")
        for e in got["foreign"]), got["foreign"]
    assert got["unchanged"] == 0.0
    assert len(got["grad_scaler"]) == world and all(
        e.startswith("GradientsInChunksError: zeroshard: torch.amp.GradScaler unscales") for e in got["grad_scaler"])


def test_the_model_called_as_itself_runs_the_engines_forward(res):
    """`model(x)` in a plain loop (as the README shows it), and its layers called directly, at stage
    3: trained as torch, the chunk
    layout final and the schedule recorded after the first step, and no chunk released in a forward
    held until backward (the first forward, which may re-pack the chunks, saves them as they are,
    on either path). Before, `model(x)` held every released chunk each step and kept recording."""
    r, _ = res
    got = ok(r, "called_as_itself")
    for how in ("engine", "model"):
        assert got[how]["diff"] <= TOL["sgd"], got
        assert got[how]["chunks"] == LAYERS and not got[how]["recording"], got
    assert got["model"]["alive"] == got["engine"]["alive"], got
    assert got["engine"]["alive"][0] > 0 and got["engine"]["alive"][1:] == [0, 0], got
    # its layers called directly, each its own forward (by reference from the second, the first
    # re-packing as it ends); before, every step held the chunks released in each forward
    assert got["layers"]["diff"] <= TOL["sgd"] and got["layers"]["alive"] == [0, 0, 0], got
    assert got["layers"]["chunks"] == LAYERS and not got["layers"]["recording"], got
