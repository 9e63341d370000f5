"""Lightning on zeroshard (issue 17): ZeroShardStrategy at stages 0-3, against the same training as
a plain zeroshard loop and as single-process PyTorch on the global batch.

Every run: a tiny GPT-2 in a LightningModule, 40 sequences of 16 tokens in order (an unshuffled
DistributedSampler gives rank r the indices r, r+world, ...; Lightning's own would shuffle), so each
of the 10 optimizer steps (2 epochs of 5) trains on 8 sequences at any world size: 2 micro-batches
(accumulate_grad_batches) of 8 / (2 x world) sequences per rank. The step-5 checkpoint ends an
epoch: Lightning resumes a plain dataloader at an epoch's start (mid-epoch it would start the
epoch's data over, with or without zeroshard). AdamW with weight-decay groups (0.1 on weights, none on
biases and norms), a linear schedule with 2 warmup steps stepped every optimizer step,
gradient_clip_val 1.
"""
from __future__ import annotations

import json
import os

import torch

from models import max_diff, tiny_gpt2
from zeroshard.runtime.compiled import compiled_form

STEPS, STEPS_PER_EPOCH, ACCUMULATION, SEQUENCES_PER_STEP, SEQ = 10, 5, 2, 8, 16


def data():
    return torch.randint(0, 128, (STEPS_PER_EPOCH * SEQUENCES_PER_STEP, SEQ), generator=torch.Generator().manual_seed(11))


def first_of_step(k: int) -> int:
    """The index of step k's first sequence (the data repeats every epoch)."""
    return (k % STEPS_PER_EPOCH) * SEQUENCES_PER_STEP


def grouped_adamw(model):
    decay = [p for n, p in model.named_parameters() if not (n.endswith("bias") or ".ln_" in n or "ln_f" in n)]
    rest = [p for n, p in model.named_parameters() if n.endswith("bias") or ".ln_" in n or "ln_f" in n]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-3)


def schedule(opt):
    from transformers import get_linear_schedule_with_warmup
    return get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=STEPS)


def module_class():
    import lightning.pytorch as pl

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_gpt2()
            # what offload/stage 'auto' profiles forward with (Lightning's own attribute)
            self.example_input_array = {"input_ids": data()[:2], "labels": data()[:2]}

        def forward(self, input_ids, labels=None):
            return self.model(input_ids=input_ids, labels=labels).loss

        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.model(input_ids=batch, labels=batch).loss, sync_dist=True)

        def predict_step(self, batch, batch_idx):
            return self.model(input_ids=batch).logits

        def configure_optimizers(self):
            opt = grouped_adamw(self.model)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule(opt), "interval": "step"}}
    return LM


def reference() -> dict:
    model = tiny_gpt2()
    x = data()
    opt = grouped_adamw(model)
    sched = schedule(opt)
    norms = []
    for k in range(STEPS):
        batch = x[first_of_step(k):first_of_step(k) + SEQUENCES_PER_STEP]
        model(input_ids=batch, labels=batch).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        sched.step()
        opt.zero_grad()
    with torch.no_grad():
        val = float(model(input_ids=x[:8], labels=x[:8]).loss)
        logits = model(input_ids=x[:8]).logits
    return {"state": model.state_dict(), "norms": norms, "val_loss": val, "logits": logits}


def plain_loop(rank: int, world: int, stage: int) -> dict:
    import zeroshard
    model = tiny_gpt2()
    x = data()
    opt = grouped_adamw(model)
    engine = zeroshard.initialize(model, opt, {"stage": stage, "clip_grad_norm": 1.0,
                                               "gradient_accumulation_steps": ACCUMULATION})
    sched = schedule(engine.optimizer)
    per = SEQUENCES_PER_STEP // (world * ACCUMULATION)
    for k in range(STEPS):
        for i in range(ACCUMULATION):
            idx = [first_of_step(k) + (i * per + j) * world + rank for j in range(per)]
            engine.backward(engine(input_ids=x[idx], labels=x[idx]).loss)
        engine.step()
        sched.step()
    return engine.full_state_dict(), engine.stats()["comm_elements"]


def fit(rank: int, world: int, stage: int, out: str, ckpt_path: str | None = None,
        gradient_clip_algorithm: str = "norm", compiled: bool = False, validate_every: int | None = None,
        **config):
    """`validate_every`: validate on the first 8 sequences every this many optimizer steps, in
    Lightning's own loop, after its sanity check (a validation before the first step)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from zeroshard.integrations.lightning import ZeroShardStrategy
    per = SEQUENCES_PER_STEP // (world * ACCUMULATION)
    sampler = torch.utils.data.DistributedSampler(data(), num_replicas=world, rank=rank, shuffle=False)
    loader = torch.utils.data.DataLoader(data(), batch_size=per, sampler=sampler)
    checkpoints = ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), every_n_train_steps=5, save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=ZeroShardStrategy(stage=stage, **config),
                         max_steps=STEPS, accumulate_grad_batches=ACCUMULATION, gradient_clip_val=1.0,
                         gradient_clip_algorithm=gradient_clip_algorithm,
                         logger=CSVLogger(out, name="csv"), log_every_n_steps=1, callbacks=[checkpoints],
                         enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0 if validate_every is None else 2,
                         use_distributed_sampler=False,
                         val_check_interval=None if validate_every is None else validate_every * ACCUMULATION)
    module = module_class()()
    val = None if validate_every is None else validation_loader(rank, world)
    # A user's torch.compile of the module (aot_eager: eager's operations, compile_scenarios.py)
    trainer.fit(torch.compile(module, backend="aot_eager") if compiled else module, loader, val, ckpt_path=ckpt_path)
    return trainer, module


def validation_loader(rank: int, world: int):
    return torch.utils.data.DataLoader(data()[:8], batch_size=4, sampler=torch.utils.data.DistributedSampler(
        data()[:8], num_replicas=world, rank=rank, shuffle=False))


def metrics_csv(trainer) -> list[dict]:
    import csv
    path = os.path.join(trainer.logger.log_dir, "metrics.csv")
    with open(path) as f:
        return list(csv.DictReader(f))


HOOKS = ("on_before_backward", "backward", "on_after_backward", "on_before_optimizer_step",
         "configure_gradient_clipping")
HOOK_CLIP = 0.01  # what the module's configure_gradient_clipping clips to: below every step's norm


def hooked_class():
    import lightning.pytorch as pl

    from contract_call_scenarios import ReleasedStorages

    class Hooked(pl.LightningModule):
        """Overrides Lightning's backward and optimizer-step hooks, clipping in its own
        configure_gradient_clipping. `manual`: Lightning's manual optimization, its training_step
        taking two halves of its batch through forward and manual_backward (`plain_backward`:
        loss.backward() instead), clip_gradients, the step, zero_grad and the LR schedule's step;
        `alive` counts, after each forward, the chunks released in it that are still held."""

        def __init__(self, manual=False, plain_backward=False):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                           torch.nn.Tanh(), torch.nn.Linear(16, 4))
            self.calls = dict.fromkeys(HOOKS, 0)
            self.automatic_optimization = not manual
            self.plain_backward = plain_backward
            self.alive = []

        def training_step(self, batch, i):
            x, y = batch
            if self.automatic_optimization:
                return ((self.net(x) - y) ** 2).mean()
            opt = self.optimizers()
            for half in (slice(0, 2), slice(2, 4)):
                with ReleasedStorages() as released:
                    loss = ((self.net(x[half]) - y[half]) ** 2).mean() / 2
                    self.alive.append(released.alive())
                loss.backward() if self.plain_backward else self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=HOOK_CLIP, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
            self.lr_schedulers().step()

        def on_before_backward(self, loss):
            self.calls["on_before_backward"] += 1

        def backward(self, loss, *args, **kwargs):
            self.calls["backward"] += 1
            loss.backward(*args, **kwargs)

        def on_after_backward(self):
            self.calls["on_after_backward"] += 1

        def on_before_optimizer_step(self, optimizer):
            self.calls["on_before_optimizer_step"] += 1

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            self.calls["configure_gradient_clipping"] += 1
            self.clip_gradients(optimizer, gradient_clip_val=HOOK_CLIP, gradient_clip_algorithm="norm")

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.8 if not self.automatic_optimization else 1)]

    class HookedWithoutBackward(Hooked):
        backward = pl.LightningModule.backward  # Lightning's own: the engine's backward
    return Hooked, HookedWithoutBackward


def hooked_data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(48, 8, generator=g), torch.randn(48, 4, generator=g)


def hooked_fit(rank: int, world: int, stage: int, manual: bool = False, plain_backward: bool = False,
               backward_override: bool = True, **config) -> dict:
    """The module's hook overrides run at every step, its clipping included: it trains what plain
    PyTorch trains on the global batch with clip_grad_norm_ to HOOK_CLIP (before, ZeroShardStrategy
    called none of them: the model trained unclipped). `manual`: Lightning's manual optimization
    (refused before), against the same plain PyTorch with the LR decayed each step."""
    import lightning.pytorch as pl

    from zeroshard.integrations.lightning import ZeroShardStrategy
    x, y = hooked_data()
    sampler = torch.utils.data.DistributedSampler(torch.utils.data.TensorDataset(x, y), num_replicas=world,
                                                  rank=rank, shuffle=False)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, sampler=sampler)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=ZeroShardStrategy(stage=stage, **config),
                         max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False)
    module = hooked_class()[0 if backward_override else 1](manual, plain_backward)
    try:
        trainer.fit(module, loader)
    except Exception as e:  # noqa: BLE001 -- the refusal is the result
        return {"error": f"{type(e).__name__}: {e}"}
    ref = hooked_class()[0]()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.8 if manual else 1)
    order = [i for b in range(len(x) // (4 * world)) for r in range(world) for i in range(r, len(x), world)[4 * b:4 * b + 4]]
    for k in range(len(order) // (4 * world)):  # each step: every rank's 4 samples
        idx = order[k * 4 * world:(k + 1) * 4 * world]
        ((ref.net(x[idx]) - y[idx]) ** 2).mean().backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), HOOK_CLIP)
        opt.step()
        opt.zero_grad()
        sched.step()
    engine = trainer.strategy.engine
    got = engine.full_state_dict()
    return {"calls": module.calls, "steps": trainer.global_step, "vs_torch": max_diff(got, ref.state_dict()),
            "alive": module.alive, "chunks": len(engine.chunks), "lr": engine.optimizer.param_groups[0]["lr"],
            "ref_lr": opt.param_groups[0]["lr"]}


def run(rank: int, world: int, out_path: str) -> None:
    """World 2: Lightning and the plain loop at stages 0-3 (and stage 3 with the optimizer
    offloaded), validate and predict, save_pretrained from the strategy's engine; world 1: the
    reference, and Lightning resumed from the world-2 stage-3 run's step-5 checkpoint."""
    import transformers
    transformers.logging.set_verbosity_error()
    root = os.path.dirname(out_path)
    results = {}
    key = lambda k: k[len("model."):]  # noqa: E731  (the LightningModule's keys: model.<GPT-2 key>)
    if world == 2:
        for name, stage, config in [("stage0", 0, {}), ("stage1", 1, {}), ("stage2", 2, {}), ("stage3", 3, {}),
                                    ("stage3_offload", 3, {"offload_optimizer": True}),
                                    ("auto", "auto", {"offload": "auto"})]:
            out = os.path.join(root, name)
            trainer, module = fit(rank, world, stage, out, **config)
            engine = trainer.strategy.engine
            full = {key(k): v for k, v in engine.full_state_dict().items()}
            plain, plain_comm = plain_loop(rank, world, 0 if stage == "auto" else stage)
            res = {"vs_plain": max_diff(full, plain), "global_step": trainer.global_step,
                   "comm_per_step": engine.stats()["comm_elements"], "plain_comm_per_step": plain_comm}
            if rank == 0:
                torch.save(full, os.path.join(root, f"{name}.pt"))
                rows = metrics_csv(trainer)
                res["logged"] = [{k: v for k, v in r.items() if v != ""} for r in rows]
            res["checkpoints"] = sorted(os.listdir(os.path.join(out, "ckpt")))
            if name == "stage3":
                val = validation_loader(rank, world)
                res["val_loss"] = trainer.validate(module, val, verbose=False)[0]["val_loss"]
                logits = torch.cat(trainer.predict(module, val))
                gathered = [torch.empty_like(logits) for _ in range(world)]
                torch.distributed.all_gather(gathered, logits)
                if rank == 0:  # rank r predicted sequences r, r + world, ...
                    ordered = torch.empty(8, *logits.shape[1:])
                    for r, g in enumerate(gathered):
                        ordered[r::world] = g
                    torch.save(ordered, os.path.join(root, "logits.pt"))
                engine.save_pretrained(os.path.join(out, "pretrained"), submodule="model")  # the GPT-2 inside
                if rank == 0:
                    loaded = transformers.GPT2LMHeadModel.from_pretrained(os.path.join(out, "pretrained")).state_dict()
                    res["pretrained_keys"] = sorted(loaded) == sorted(full)
                    res["pretrained_max_diff"] = max_diff(loaded, full)
            results[name] = res
        for stage in (0, 3):
            results[f"hooked_stage{stage}"] = hooked_fit(rank, world, stage)
        # stage 0 with the module's backward override, stage 3 (a layer a chunk, a 1-chunk rCache) without
        results["manual_stage0"] = hooked_fit(rank, world, 0, manual=True)
        results["manual_stage3"] = hooked_fit(rank, world, 3, manual=True, backward_override=False, chunk_size=300,
                                              cache_chunks=1)
        results["manual_plain_backward"] = hooked_fit(rank, world, 2, manual=True, plain_backward=True)
        # Validation inside fit, before the first step and after every step, through a 1-chunk rCache
        trainer, _ = fit(rank, world, 3, os.path.join(root, "stage3_validating"), validate_every=1,
                         cache_chunks=1, chunk_size=20000)
        engine = trainer.strategy.engine
        results["stage3_validating"] = {
            "vs_plain": max_diff({key(k): v for k, v in engine.full_state_dict().items()}, plain_loop(rank, world, 3)[0]),
            "validations": sum(1 for r in metrics_csv(trainer) if r.get("val_loss")) if rank == 0 else None,
            "chunks": len(engine.chunks),
            "departures": engine.stats()["schedule_departures"]}
        trainer, _ = fit(rank, world, 3, os.path.join(root, "stage3_compiled"), compiled=True)
        full = {key(k): v for k, v in trainer.strategy.engine.full_state_dict().items()}
        results["stage3_compiled"] = {"vs_plain": max_diff(full, plain_loop(rank, world, 3)[0]),
                                      "compiled": [type(m).__name__ for m in trainer.strategy.engine.compiled or ()]}
        # Config compile on a module not passed through torch.compile: one chunk, so the root is its
        # one unit at initialize, and then Lightning redirects its forward for each step
        trainer, _ = fit(rank, world, 3, os.path.join(root, "stage3_config_compiled"), compile={"backend": "aot_eager"})
        engine = trainer.strategy.engine
        full = {key(k): v for k, v in engine.full_state_dict().items()}
        results["stage3_config_compiled"] = {
            "vs_plain": max_diff(full, plain_loop(rank, world, 3)[0]), "chunks": len(engine.chunks),
            "compiled": [type(m).__name__ for m in engine.compiled or ()],
            "kept": all(compiled_form(m.forward) is not None for m in engine.compiled or ())}
    else:
        ref = reference()
        torch.save(ref.pop("state"), os.path.join(root, "reference.pt"))
        torch.save(ref.pop("logits"), os.path.join(root, "reference_logits.pt"))
        results["reference"] = ref
        ckpt = os.path.join(os.environ["LIGHTNING_STAGE3_OUT"], "ckpt", "epoch=0-step=5.ckpt")
        trainer, _ = fit(rank, world, 3, os.path.join(root, "resumed"), ckpt_path=ckpt)
        full = {key(k): v for k, v in trainer.strategy.engine.full_state_dict().items()}
        torch.save(full, os.path.join(root, "resumed.pt"))
        results["resumed"] = {"global_step": trainer.global_step, "logged": metrics_csv(trainer)}
        try:  # clipping by value needs whole gradients: refused before anything trains
            fit(rank, world, 2, os.path.join(root, "by_value"), gradient_clip_algorithm="value")
            results["clip_by_value"] = "trained"
        except ValueError as e:
            results["clip_by_value"] = str(e)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, default=str)
