"""The Hugging Face Trainer on zeroshard (issue 17), against the same training written as a plain
zeroshard loop and as single-process PyTorch on the global batch.

Every run: a tiny GPT-2, 80 sequences of 16 tokens read in order, 2 per device and micro-batch, 2
micro-batches per step, so each of the 10 steps trains on 8 sequences at any world size (rank r's
micro-batch i is the sampler's batch i*world + r, as accelerate shards it); the Trainer's AdamW with
its weight-decay groups (weight_decay 0.1), a linear schedule with 2 warmup steps, max_grad_norm 1.
The loss is the Trainer's: summed over the window's label tokens and divided by their count, every
label counted (transformers' own Trainer counts 16 per sequence where the shifted loss scores 15:
its gradient is 15/16 of the token mean's, and so is its logged grad norm). The reference and the
plain loop pass the same count (`num_items_in_batch`) so that all three train the same thing.
"""
from __future__ import annotations

import json
import os

import torch

from models import max_diff, tiny_gpt2

STEPS, ACCUMULATION, SEQUENCES_PER_STEP, SEQ = 10, 2, 8, 16


def dataset():
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 128, (STEPS * SEQUENCES_PER_STEP, SEQ), generator=g)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return len(x)

        def __getitem__(self, i):
            return {"input_ids": x[i], "labels": x[i]}
    return Tokens(), x


def arguments(out: str, world: int, **kw):
    import transformers
    per_device = SEQUENCES_PER_STEP // (world * ACCUMULATION)
    kw = {"max_steps": STEPS, "save_steps": 5, "logging_steps": 1, **kw}
    return transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=per_device, per_device_eval_batch_size=4,
        gradient_accumulation_steps=ACCUMULATION, learning_rate=1e-3, weight_decay=0.1, warmup_steps=2,
        lr_scheduler_type="linear", max_grad_norm=1.0, report_to="none", use_cpu=True, seed=0,
        disable_tqdm=True, **kw)


def trainer_class():
    from zeroshard.integrations.transformers import ZeroShardTrainer

    class InOrder(ZeroShardTrainer):  # the data in order, so the reference can take the same batches
        def _get_train_sampler(self, dataset=None):
            return torch.utils.data.SequentialSampler(self.train_dataset)
    return InOrder


def optimizer_and_schedule(model, args):
    """The optimizer and scheduler the Trainer builds for `model` (a Trainer made only to build them)."""
    import transformers
    t = transformers.Trainer(model=model, args=args)
    opt = t.create_optimizer()
    return opt, (lambda o: transformers.get_scheduler(args.lr_scheduler_type, o, num_warmup_steps=args.warmup_steps,
                                                      num_training_steps=STEPS))


def reference(out: str) -> dict:
    """Single-process PyTorch on the global batch (rank 0 of a world of one, in its own process)."""
    model = tiny_gpt2()
    _, x = dataset()
    opt, schedule = optimizer_and_schedule(model, arguments(out, 1))
    sched = schedule(opt)
    lrs, norms = [], []
    for k in range(STEPS):
        batch = x[k * SEQUENCES_PER_STEP:(k + 1) * SEQUENCES_PER_STEP]
        model(input_ids=batch, labels=batch, num_items_in_batch=batch.numel()).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        opt.zero_grad()
    import transformers  # the Trainer's own evaluation of the reference model (its loss, its batching)
    ds, _ = dataset()
    plain = transformers.Trainer(model=model, args=arguments(out + "-eval", 1))
    eval_loss = plain.evaluate(eval_dataset=torch.utils.data.Subset(ds, range(8)))["eval_loss"]
    with torch.no_grad():
        model.eval()
        logits = model(input_ids=x[:8]).logits
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "lrs": lrs, "norms": norms,
            "eval_loss": eval_loss, "logits": logits}


def plain_loop(rank: int, world: int, stage: int, out: str) -> dict:
    """The same training as a hand-written zeroshard loop."""
    import zeroshard
    model = tiny_gpt2()
    _, x = dataset()
    opt, schedule = optimizer_and_schedule(model, arguments(out, world))
    engine = zeroshard.initialize(model, opt, {"stage": stage, "clip_grad_norm": 1.0,
                                               "gradient_accumulation_steps": ACCUMULATION})
    sched = schedule(engine.optimizer)
    per = SEQUENCES_PER_STEP // (world * ACCUMULATION)
    for k in range(STEPS):
        for i in range(ACCUMULATION):
            first = k * SEQUENCES_PER_STEP + (i * world + rank) * per
            batch = x[first:first + per]
            # the engine divides by world x accumulation: per micro-batch, its own label count
            engine.backward(engine(input_ids=batch, labels=batch, num_items_in_batch=batch.numel()).loss)
        engine.step()
        sched.step()
    return engine.full_state_dict(), engine.stats()["comm_elements"]


def trainer_run(rank: int, world: int, stage: int, out: str, resume: str | None = None, config: dict | None = None,
                **kw) -> dict:
    """Train with ZeroShardTrainer (zeroshard config: `stage` and `config`); returns its final full
    state dict and what it logged."""
    ds, x = dataset()
    trainer = trainer_class()(model=tiny_gpt2(), args=arguments(out, world, **kw), train_dataset=ds,
                              zeroshard_config={"stage": stage, **(config or {})})
    trainer.train(resume_from_checkpoint=resume)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    comm = trainer.engine.stats()["comm_elements"]  # the last optimizer step's
    return {"trainer": trainer, "state": trainer.engine.full_state_dict(), "logs": logs, "comm": comm}


def run(rank: int, world: int, out_path: str) -> None:
    """World 2: Trainer and plain loop at stages 0-3 (their traffic per optimizer step); at stages 2
    and 3 also save_model, evaluate and predict; world 1: the reference, and the Trainer resumed
    from the world-2 stage-3 run's step-5 checkpoint."""
    import transformers
    transformers.logging.set_verbosity_error()
    root = os.path.dirname(out_path)
    results = {}
    if world == 2:
        for stage in (0, 1, 2, 3):
            out = os.path.join(root, f"stage{stage}")
            got = trainer_run(rank, world, stage, out, **({} if stage >= 2 else {"save_steps": STEPS}))
            plain, plain_comm = plain_loop(rank, world, stage, out + "-plain")
            trainer = got["trainer"]
            res = {"state_vs_plain": max_diff(got["state"], plain), "logs": got["logs"],
                   "comm_per_step": got["comm"], "plain_comm_per_step": plain_comm}
            if stage < 2:  # the traffic, and the model against the plain loop's, is what these add
                results[f"stage{stage}"] = res
                continue
            if stage == 3:  # TrainingArguments' torch_compile: config compile, the root compiled whole
                # in more than one chunk: in graph segments (runtime/compiled.py's Note: one unit)
                compiled = trainer_run(rank, world, stage, out + "-compiled", config={"chunk_size": 60000},
                                       torch_compile=True, torch_compile_backend="aot_eager", save_strategy="no")
                results["stage3_compiled"] = {
                    "state_vs_plain": max_diff(compiled["state"], plain),
                    "compiled": [type(m).__name__ for m in compiled["trainer"].engine.compiled or ()],
                    "chunks": len(compiled["trainer"].engine.chunks)}
            torch.save(got["state"], os.path.join(root, f"trainer_stage{stage}.pt")) if rank == 0 else None
            trainer.save_model(os.path.join(out, "final"))
            if rank == 0:
                loaded = transformers.GPT2LMHeadModel.from_pretrained(os.path.join(out, "final")).state_dict()
                full = got["state"]
                res["save_model_keys_equal"] = sorted(set(loaded) & set(full)) == sorted(full)
                res["save_model_max_diff"] = max(float((loaded[k] - full[k]).abs().max()) for k in full)
            ds, x = dataset()
            metrics = trainer.evaluate(eval_dataset=torch.utils.data.Subset(ds, range(8)))
            res["eval_loss"] = metrics["eval_loss"]
            pred = trainer.predict(torch.utils.data.Subset(ds, range(8)))
            logits = pred.predictions[0] if isinstance(pred.predictions, tuple) else pred.predictions
            if rank == 0:
                torch.save(torch.as_tensor(logits), os.path.join(root, f"logits_stage{stage}.pt"))
            res["checkpoints"] = sorted(os.listdir(out))
            res["checkpoint5"] = sorted(os.listdir(os.path.join(out, "checkpoint-5")))
            results[f"stage{stage}"] = res
        # offload='auto' plans from a micro-batch the Trainer takes from its training set (it had none
        # to give: initialize raised ValueError asking for example_inputs)
        planned = trainer_run(rank, world, "auto", os.path.join(root, "auto"), config={"offload": "auto"},
                              save_strategy="no")
        results["auto"] = {"state_vs_plain": max_diff(planned["state"], plain)}
    else:
        ref = reference(os.path.join(root, "ref"))
        torch.save(ref.pop("state"), os.path.join(root, "reference.pt"))
        torch.save(ref.pop("logits"), os.path.join(root, "reference_logits.pt"))
        results["reference"] = ref
        resumed = trainer_run(rank, world, 3, os.path.join(root, "resumed"),
                              resume=os.path.join(os.environ["TRAINER_STAGE3_OUT"], "checkpoint-5"))
        torch.save(resumed["state"], os.path.join(root, "resumed.pt"))
        results["resumed"] = {"logs": resumed["logs"]}
        # A model built on the meta device, its weights streamed in from the world-2 run's save_model
        final = os.path.join(os.environ["TRAINER_STAGE3_OUT"], "final")
        with torch.device("meta"):
            meta = transformers.GPT2LMHeadModel(tiny_gpt2().config)
        ds, _ = dataset()
        trainer = trainer_class()(model=meta, args=arguments(os.path.join(root, "meta"), world), train_dataset=ds,
                                  zeroshard_config={"stage": 3}, zeroshard_weights=final)
        got = trainer.zeroshard_engine().full_state_dict()
        want = transformers.GPT2LMHeadModel.from_pretrained(final).state_dict()
        results["meta_weights_max_diff"] = max(float((got[k] - want[k]).abs().max()) for k in want)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, default=str)
