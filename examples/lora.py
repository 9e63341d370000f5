import peft, torch, transformers, zeroshard

base = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64,
                                     intermediate_size=128, num_attention_heads=4, vocab_size=128))
model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
engine = zeroshard.initialize(model, opt, {"stage": 3})
for x in torch.randint(0, 128, (10, 2, 16)):
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
engine.save_pretrained("lora-adapter")                # PeftModel.from_pretrained(base, "lora-adapter")
