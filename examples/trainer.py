import torch, transformers
from zeroshard.integrations.transformers import ZeroShardTrainer

model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256))
data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 256, (64, 32))]
args = transformers.TrainingArguments("out-trainer", per_device_train_batch_size=4, max_steps=20, learning_rate=1e-3,
                                      warmup_steps=2, logging_steps=5, save_steps=10, use_cpu=True, report_to="none")
trainer = ZeroShardTrainer(model=model, args=args, train_dataset=data, zeroshard_config={"stage": 3})
trainer.train()                          # resume: trainer.train(resume_from_checkpoint=True), at any world size
trainer.save_model("out-trainer/final")  # AutoModelForCausalLM.from_pretrained("out-trainer/final") opens it
