"""Scenarios of tests/test_architectures.py: architectures transformers builds from tiny configs,
trained through the engine at every stage and compared with single-process PyTorch on the global
batch (the mean of the ranks' losses: every rank's batch has as many tokens, so that is the global
batch's mean loss).

Each architecture brings something GPT-2 does not: an encoder-decoder with shared embeddings
(T5), a convolutional front end (Whisper), routed experts (Mixtral, DeepSeek-V3 with its latent
attention and shared experts), sliding-window attention and scaled tied embeddings (Gemma 3), a
state-space scan (Mamba), attention and Mamba layers of two classes in one layer list with routed
experts (Jamba), parallel residuals (GPT-NeoX), a masked-LM head tied to the embedding (BERT), a
classification head (RoBERTa), patches (ViT), BatchNorm (ResNet), raw audio through convolutional
feature layers of several classes, a grouped convolution under torch's weight_norm parametrization
and a CTC loss whose head checks its labels' values (wav2vec2: offload="auto" profiles it with the
labels' values, planning/input_values.py). An architecture the
installed transformers lacks is recorded as unavailable (test_architectures skips it, naming it).
"""
from __future__ import annotations

import copy
import functools

import torch

import zeroshard
from distributed import WorldResults, record
from models import make_sgd, max_diff

VOCAB = 96
STEPS = 2
# The engine configurations each architecture trains under: every stage, and stage 3 with chunks
# small enough that layers are split across chunks, through a 2-chunk rCache (gathers, evictions
# and prefetches inside a forward; uneven shards at world 3).
# And the planner's choice (Elixir: the profile on the meta device, then the search), whose profile
# failed for fused experts in fp32 (torch._grouped_mm's meta kernel takes bf16 only).
# And config compile (aot_eager: eager's aten operations, so within fp32 SGD's tolerance) with layers
# split across chunks: at stage 2 each layer block compiled, waiting for its own chunks; at stage 3
# each block a leaf unit gathered around its compiled forward. Compiling is most of this registry's
# time (T5: 29 of 35 s at world 2), so each compiled configuration runs at one world: stage 2 at
# world 2, stage 3 at world 3 (uneven shards gathered around the compiled blocks); the eager ones
# run at both (tests/compile_scenarios.py compiles at worlds 1-3).
EAGERLIKE = {"backend": "aot_eager"}
CONFIGS = {"stage0": {"stage": 0}, "stage1": {"stage": 1}, "stage2": {"stage": 2}, "stage3": {"stage": 3},
           "auto": {"stage": "auto", "offload": "auto"},
           "stage3_small_chunks": {"stage": 3, "chunk_size": 2048, "cache_chunks": 2},
           "stage2_compiled": {"stage": 2, "chunk_size": 2048, "compile": EAGERLIKE},
           "stage3_compiled": {"stage": 3, "chunk_size": 2048, "cache_chunks": 2, "compile": EAGERLIKE}}
COMPILED_AT = {"stage2_compiled": 2, "stage3_compiled": 3}
GENERATING = ("stage3_small_chunks", "stage3_compiled")  # the engines whose greedy generation is compared


def configs_at(world: int) -> list[str]:
    """The labels of CONFIGS an architecture trains under at `world`."""
    return [label for label in CONFIGS if COMPILED_AT.get(label, world) == world]


def _no_dropout(cfg):
    for key, value in list(vars(cfg).items()):
        if any(word in key for word in ("dropout", "drop_path", "layerdrop")) and isinstance(value, float):
            setattr(cfg, key, 0.0)
    return cfg


def _model(class_name: str, config_name: str, **fields):
    """A builder of transformers' `class_name` from `config_name`(**fields), or None when the
    installed transformers lacks either."""
    import transformers
    cls, config = getattr(transformers, class_name, None), getattr(transformers, config_name, None)
    if cls is None or config is None:
        return None
    return lambda: cls(_no_dropout(config(**fields)))


def architectures() -> dict:
    """name -> (builder or None, kind of batch, generates)."""
    v, h, ffn = VOCAB, 32, 64
    decoder = dict(vocab_size=v, hidden_size=h, intermediate_size=ffn, num_hidden_layers=2, num_attention_heads=4)
    return {
        "bert": (_model("BertForMaskedLM", "BertConfig", **decoder, max_position_embeddings=64), "tokens", False),
        "roberta": (_model("RobertaForSequenceClassification", "RobertaConfig", **decoder, num_labels=3,
                           max_position_embeddings=64, pad_token_id=1), "classes", False),
        "t5": (_model("T5ForConditionalGeneration", "T5Config", vocab_size=v, d_model=h, d_kv=8, d_ff=ffn, num_layers=2,
                      num_decoder_layers=2, num_heads=4, decoder_start_token_id=0, pad_token_id=0),
               "seq2seq", True),
        "whisper": (_model("WhisperForConditionalGeneration", "WhisperConfig", vocab_size=v, num_mel_bins=8, d_model=h,
                           encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                           encoder_ffn_dim=ffn, decoder_ffn_dim=ffn, max_source_positions=16, max_target_positions=32,
                           decoder_start_token_id=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                           suppress_tokens=None, begin_suppress_tokens=None), "audio", True),
        "mixtral": (_model("MixtralForCausalLM", "MixtralConfig", **decoder, num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2, router_aux_loss_coef=0.0), "tokens", True),
        "deepseek_v3": (_model("DeepseekV3ForCausalLM", "DeepseekV3Config", **{**decoder, "intermediate_size": ffn},
                               moe_intermediate_size=16, num_key_value_heads=4, n_routed_experts=4,
                               num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=8,
                               q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_group=1,
                               topk_group=1), "tokens", True),
        "gemma3": (_model("Gemma3ForCausalLM", "Gemma3TextConfig", **decoder, num_key_value_heads=1, head_dim=8,
                          sliding_window=8), "tokens", True),
        "mamba": (_model("MambaForCausalLM", "MambaConfig", vocab_size=v, hidden_size=h, state_size=4,
                         num_hidden_layers=2, expand=2, conv_kernel=4), "tokens", True),
        "jamba": (_model("JambaForCausalLM", "JambaConfig", **decoder, num_key_value_heads=2, num_experts=4,
                         num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                         expert_layer_offset=1, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2,
                         use_mamba_kernels=False), "tokens", True),
        "wav2vec2": (_model("Wav2Vec2ForCTC", "Wav2Vec2Config", vocab_size=v, hidden_size=h, num_hidden_layers=2,
                            num_attention_heads=4, intermediate_size=ffn, conv_dim=(8, 8), conv_stride=(4, 2),
                            conv_kernel=(8, 4), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2,
                            mask_time_prob=0.0, pad_token_id=0, ctc_loss_reduction="mean"),
                     "waveform", False),
        "gpt_neox": (_model("GPTNeoXForCausalLM", "GPTNeoXConfig", **decoder), "tokens", True),
        "vit": (_model("ViTForImageClassification", "ViTConfig", image_size=16, patch_size=4, num_channels=3,
                       hidden_size=h, num_hidden_layers=2, num_attention_heads=4, intermediate_size=ffn,
                       num_labels=5), "images", False),
        "resnet": (_model("ResNetForImageClassification", "ResNetConfig", num_channels=3, embedding_size=8,
                          hidden_sizes=[8, 16], depths=[1, 1], num_labels=5), "images", False),
    }


def batch(kind: str, g: torch.Generator, n: int = 2) -> dict:
    """One rank's micro-batch of `kind`, keyword arguments of the model's forward."""
    if kind == "tokens":
        x = torch.randint(3, VOCAB, (n, 12), generator=g)
        return {"input_ids": x, "labels": x}
    if kind == "classes":
        return {"input_ids": torch.randint(3, VOCAB, (n, 12), generator=g), "labels": torch.randint(0, 3, (n,), generator=g)}
    if kind == "seq2seq":
        return {"input_ids": torch.randint(3, VOCAB, (n, 10), generator=g),
                "labels": torch.randint(3, VOCAB, (n, 7), generator=g)}
    if kind == "waveform":  # 256 samples: 31 frames after the feature layers, for 4 CTC labels each
        return {"input_values": torch.randn(n, 256, generator=g), "labels": torch.randint(3, VOCAB, (n, 4), generator=g)}
    if kind == "audio":
        return {"input_features": torch.randn(n, 8, 32, generator=g), "labels": torch.randint(3, VOCAB, (n, 7), generator=g)}
    return {"pixel_values": torch.randn(n, 3, 16, 16, generator=g), "labels": torch.randint(0, 5, (n,), generator=g)}


def compared(model: torch.nn.Module, state: dict) -> dict:
    """What is compared with the reference: parameters and buffers, but for BatchNorm's running
    statistics, which are each rank's own (its batches'), as under FSDP2 (DDP broadcasts rank 0's
    before every forward)."""
    running = {f"{n}.{b}" for n, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
               for b in ("running_mean", "running_var", "num_batches_tracked")}
    return {k: v for k, v in state.items() if k not in running}


def trained_in_plain_pytorch(ref: torch.nn.Module, data, world: int) -> None:
    """STEPS steps of SGD on the mean of the ranks' losses (the global batch), on `ref` in place."""
    opt = make_sgd([p for p in ref.parameters() if p.requires_grad])
    for step in data:
        (sum(ref(**b).loss for b in step) / world).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def trained_by_engine(model: torch.nn.Module, cfg: dict, data, rank: int):
    """The engine over `model` (config `cfg`; a planned one profiles this rank's first micro-batch),
    after STEPS steps on this rank's micro-batches."""
    planned = {"example_inputs": data[0][rank]} if cfg.get("offload") == "auto" else {}
    engine = zeroshard.initialize(model, make_sgd, cfg, **planned)
    for step in data:
        engine.backward(engine(**step[rank]).loss)
        engine.step()
    return engine


def with_lora(model: torch.nn.Module, checkpointing: bool = False) -> torch.nn.Module:
    """peft's LoRA over every linear layer (peft finds them: "all-linear")."""
    import peft
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                       lora_dropout=0.0))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def own_graph_breaks(build, initial: dict, micro_batch: dict, options: dict) -> int:
    """The graph breaks of the plain model's whole forward and backward under torch.compile(**options)."""
    model = build()
    model.load_state_dict(initial)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.compile(model.forward, **options)(**micro_batch).loss.backward()
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def trained_alike(rank: int, world: int, name: str) -> dict:
    """Per engine configuration, the largest difference from plain PyTorch after STEPS steps of SGD
    with momentum, and for a compiled one the graph breaks and graphs dynamo counted (each compiled
    configuration starts from a reset dynamo); for a generative model, also whether greedy
    generation by each GENERATING engine gives the plain model's tokens."""
    build, kind, generates = architectures()[name]
    if build is None:
        return {"unavailable": True}
    import transformers
    transformers.logging.set_verbosity_error()
    g = torch.Generator().manual_seed(1)
    data = [[batch(kind, g) for _ in range(world)] for _ in range(STEPS)]
    torch.manual_seed(0)
    ref = build()
    initial = copy.deepcopy(ref.state_dict())
    trained_in_plain_pytorch(ref, data, world)
    want = compared(ref, ref.state_dict())
    out = {"unavailable": False, "diff": {}, "breaks": {}, "graphs": {}, "same_tokens": {}}
    engines = {}
    for label in configs_at(world):
        cfg = CONFIGS[label]
        model = build()
        model.load_state_dict(initial)
        if cfg.get("compile"):
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
        engines[label] = engine = trained_by_engine(model, cfg, data, rank)
        out["diff"][label] = max_diff(compared(ref, engine.full_state_dict()), want)
        if cfg.get("compile"):
            counters = torch._dynamo.utils.counters
            out["breaks"][label] = sum(counters["graph_break"].values())
            out["graphs"][label] = counters["stats"]["unique_graphs"]
            if out["breaks"][label] and COMPILED_AT[label] < 3:  # compiled whole: the model's own breaks count
                out.setdefault("own_breaks", {})[label] = own_graph_breaks(build, initial, data[0][rank], cfg["compile"])
    if generates:
        prompt = {k: v for k, v in data[0][rank].items() if k != "labels"}
        ref.eval()
        with torch.no_grad():
            plain = ref.generate(**prompt, max_new_tokens=5, do_sample=False)
        for label in (g for g in GENERATING if g in engines):
            engines[label].eval()
            with torch.no_grad():
                got = engines[label].module.generate(**prompt, max_new_tokens=5, do_sample=False)
            out["same_tokens"][label] = bool(torch.equal(plain, got))
    return out


def _lora_runs(arch: str, runs, rank: int, world: int):
    """peft's LoRA on `arch`, trained STEPS steps in plain PyTorch on the global batch and, from the
    same initial values, by an engine per (label, config, activation checkpointing) of `runs`:
    (the reference's state, the (label, engine) pairs as each is trained), or None where
    transformers lacks the architecture or peft is not installed."""
    base, _, _ = architectures()[arch]
    if base is None or not _has_peft():
        return None

    def build(checkpointing=False):
        torch.manual_seed(0)
        return with_lora(base(), checkpointing)
    g = torch.Generator().manual_seed(1)
    data = [[batch("tokens", g) for _ in range(world)] for _ in range(STEPS)]
    ref = build()
    initial = copy.deepcopy(ref.state_dict())
    trained_in_plain_pytorch(ref, data, world)

    def engines():
        for label, cfg, checkpointing in runs:
            model = build(checkpointing)
            model.load_state_dict(initial)
            yield label, trained_by_engine(model, cfg, data, rank)
    return ref.state_dict(), engines()


def lora_on_fused_experts(rank: int, world: int) -> dict:
    """peft's LoRA with target_modules="all-linear" on a tiny Mixtral: peft wraps the router and
    the fused experts' parameters (ParamWrapper), whose forward swaps the wrapped parameter through
    torch's parametrize and multiplies the adapters' weights outside their own forwards. At stage 3
    that raised ShardedParameterError (a placeholder's set_ to itself; with activation
    checkpointing, adapters read in the recomputation), and offload="auto" could not profile it
    (torch.autocast named for the meta device). Per configuration, the largest difference from
    the same peft model trained in plain PyTorch."""
    runs = _lora_runs("mixtral", (("stage3_small_chunks", CONFIGS["stage3_small_chunks"], False),
                                  ("stage3_checkpointing", {"stage": 3}, True),
                                  ("auto", CONFIGS["auto"], False)), rank, world)
    if runs is None:
        return {"unavailable": True}
    want, engines = runs
    return {"unavailable": False,
            "diff": {label: max_diff(engine.full_state_dict(), want) for label, engine in engines}}


def lora_frozen_base(rank: int, world: int) -> dict:
    """peft's LoRA on a dense decoder (GPT-NeoX) at stage 3 with small chunks through a 3-chunk rCache,
    against the same peft model in plain PyTorch; the rCache's overflows and peak. A unit none of
    whose parameters trains (the base) was held from its backward's start to the backward's end:
    the whole base gathered at once by then (an 8-layer model: 12 of 12 chunks, 216 overflows of a
    3-chunk cache). With activation checkpointing, the same engine raised CheckpointError (a frozen
    weight autograd saved as itself was released, shape [0], before its backward)."""
    cfg = {"stage": 3, "chunk_size": 1024, "cache_chunks": 3}
    runs = _lora_runs("gpt_neox", (("plain", cfg, False), ("checkpointing", cfg, True)), rank, world)
    if runs is None:
        return {"unavailable": True}
    want, engines = runs
    out = {"unavailable": False, "diff": {}, "overflows": {}, "peak_chunks": {}}
    for label, engine in engines:
        out["diff"][label] = max_diff(engine.full_state_dict(), want)
        out["overflows"][label] = engine.stats()["cache_overflows"]
        out["peak_chunks"][label] = engine.stats()["cache_peak_chunks"]
        out["chunks"] = len(engine.chunks)
    return out


def _has_peft() -> bool:
    try:
        import peft  # noqa: F401
    except ImportError:
        return False
    return True


SCENARIOS = {name: functools.partial(trained_alike, name=name) for name in architectures()}
SCENARIOS["mixtral_lora"] = lora_on_fused_experts
SCENARIOS["lora_frozen_base"] = lora_frozen_base


def run(rank, world, out_path):
    record(rank, out_path, [(name, functools.partial(fn, rank, world)) for name, fn in SCENARIOS.items()])


ARCHITECTURES = WorldResults(run, "architectures", worlds=(2, 3))
