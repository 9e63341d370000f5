"""Run by tests/test_trainer.py under torchrun: a short ZeroShardTrainer run (accelerate makes the
process group), then the interpreter exits. Registered first, the handler below runs after every
other (atexit runs the last registered first), so it sees what the interpreter's teardown will
meet: it writes the gloo threads still alive and whether a process group is left."""
import atexit
import json
import os
import sys


def report():
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    import torch.distributed as dist
    with open(os.path.join(sys.argv[1], f"exit{os.environ['RANK']}.json"), "w") as f:
        json.dump({"gloo_threads": sorted(n for n in names if "gloo" in n),
                   "group_left": dist.is_available() and dist.is_initialized()}, f)


atexit.register(report)

import torch  # noqa: E402
import transformers  # noqa: E402

from zeroshard.integrations.transformers import ZeroShardTrainer  # noqa: E402

transformers.logging.set_verbosity_error()
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 64, (8, 16))]
args = transformers.TrainingArguments(os.path.join(sys.argv[1], "out"), per_device_train_batch_size=2, max_steps=2,
                                      save_strategy="no", use_cpu=True, report_to="none", disable_tqdm=True)
trainer = ZeroShardTrainer(model=model, args=args, train_dataset=data, zeroshard_config={"stage": 3})
trainer.train()
