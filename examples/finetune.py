"""Fine-tune a pretrained model that no process has to hold whole: build it on the meta device, stream
its weights into the shards, train, save a folder that from_pretrained opens.

    python -c "import transformers as t; t.GPT2LMHeadModel(t.GPT2Config(n_layer=2, n_embd=64, n_head=4)).save_pretrained('pretrained')"
    torchrun --standalone --nproc_per_node 2 examples/finetune.py pretrained finetuned
"""
import sys

import torch
import torch.distributed as dist
import transformers

import zeroshard

src, out = sys.argv[1], sys.argv[2]
config = transformers.AutoConfig.from_pretrained(src)
with torch.device("meta"):  # shapes only: no memory, no initialisation
    model = transformers.AutoModelForCausalLM.from_config(config)
engine = zeroshard.initialize(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                              {"stage": 3, "precision": "bf16"}, weights=src)  # each rank reads only its shards
x = torch.randint(0, config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(dist.get_rank()))
for step in range(5):  # the same batch each step: the loss falls
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    if dist.get_rank() == 0:
        print(f"loss {loss.item():.3f}")
engine.save_pretrained(out)  # streamed; model.safetensors (or shards and an index) and config.json
if dist.get_rank() == 0:
    print("saved", out, "->", type(transformers.AutoModelForCausalLM.from_pretrained(out)).__name__)
