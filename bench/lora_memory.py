"""Stage 3's rCache under LoRA: how many chunks a peft LoRA model (frozen base, trainable adapters)
holds gathered at once, against full fine-tuning of the same model, with and without activation
checkpointing, through a small rCache.

    torchrun --standalone --nproc_per_node 2 bench/lora_memory.py [--layers 8] [--cache-chunks 3]

Rank 0 prints, per run: the chunks of the model, the most held gathered at once (and their bytes),
and how often the cache had to grow past cache_chunks (overflows: every cached chunk pinned), or
the exception a run raised. A
figure, not a goal: the runs are tiny Qwen2 decoders from a transformers config, 2 steps of SGD.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import zeroshard


def model(layers: int, lora: bool, checkpointing: bool) -> torch.nn.Module:
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    m = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True))
    if lora:
        import peft
        m = peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules="all-linear"))
    if checkpointing:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--cache-chunks", type=int, default=3)
    ap.add_argument("--chunk-size", type=int, default=16384, help="elements")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    x = torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    rows = []
    for lora in (False, True):
        for checkpointing in (False, True):
            engine = zeroshard.initialize(model(args.layers, lora, checkpointing),
                                          lambda ps: torch.optim.SGD(ps, lr=0.05),
                                          {"stage": 3, "chunk_size": args.chunk_size, "cache_chunks": args.cache_chunks})
            row = ("LoRA" if lora else "full", "yes" if checkpointing else "no", len(engine.chunks))
            try:
                for _ in range(2):
                    engine.backward(engine(input_ids=x, labels=x).loss)
                    engine.step()
            except Exception as e:  # noqa: BLE001 -- a run that fails is a row that says how (same on every rank)
                rows.append(row + (f"raised {type(e).__name__}", "", ""))
                continue
            s = engine.stats()
            rows.append(row + (s["cache_peak_chunks"], s["cache_peak_bytes"], s["cache_overflows"]))
    if dist.get_rank() == 0:
        print(f"Qwen2 {args.layers} layers x 64, stage 3, chunk_size {args.chunk_size} elements, "
              f"cache_chunks {args.cache_chunks}, {dist.get_world_size()} ranks, 2 steps:")
        print("| training | checkpointing | chunks | most gathered at once | their bytes | overflows |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print("| " + " | ".join(str(v) for v in r) + " |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
