import lightning, torch, transformers
from zeroshard.integrations.lightning import ZeroShardStrategy

class LM(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256))
    def training_step(self, x, i):
        loss = self.model(input_ids=x, labels=x).loss
        self.log("loss", loss, prog_bar=True)
        return loss
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy=ZeroShardStrategy(stage=3), max_steps=20,
                            log_every_n_steps=5, logger=lightning.pytorch.loggers.CSVLogger("out-lightning"))
trainer.fit(LM(), torch.utils.data.DataLoader(torch.randint(0, 256, (64, 32)), batch_size=4))
