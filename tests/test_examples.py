"""The README's Trainer and Lightning examples (issue 17) are examples/trainer.py and
examples/lightning_fit.py verbatim, and they run on CPU with 2 ranks: training finishes, the
checkpoints and the exported model are where the README says, the engine's figures are logged."""
import csv
import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def _readme_has(name: str) -> bool:
    with open(os.path.join(EXAMPLES, name)) as f:
        code = f.read().strip()
    with open(os.path.join(EXAMPLES, "..", "README.md")) as f:
        return code in f.read()


def test_the_readme_trainer_example_runs(tmp_path):
    pytest.importorskip("accelerate")
    assert _readme_has("trainer.py")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          os.path.join(EXAMPLES, "trainer.py")], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert {"checkpoint-10", "checkpoint-20", "final"} <= set(os.listdir(tmp_path / "out-trainer"))
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out-trainer" / "final")
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert "zeroshard/tokens_per_s" in run.stdout + run.stderr


def test_the_readme_lora_example_runs(tmp_path):
    """LoRA through peft at stage 3 on 2 ranks; the adapters saved in peft's format open with
    PeftModel.from_pretrained and hold the trained values (lora_B starts at zero in peft)."""
    peft = pytest.importorskip("peft")
    assert _readme_has("lora.py")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          os.path.join(EXAMPLES, "lora.py")], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(tmp_path / "lora-adapter"))
    import transformers
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64,
                                         intermediate_size=128, num_attention_heads=4, vocab_size=128))
    model = peft.PeftModel.from_pretrained(base, tmp_path / "lora-adapter")
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert len(lora_b) == 4 and all(p.abs().sum() > 0 for p in lora_b)  # trained away from zero


def test_the_readme_lightning_example_runs(tmp_path):
    pytest.importorskip("lightning")
    assert _readme_has("lightning_fit.py")
    run = subprocess.run([sys.executable, os.path.join(EXAMPLES, "lightning_fit.py")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    logs = tmp_path / "out-lightning" / "lightning_logs" / "version_0"
    assert os.listdir(logs / "checkpoints") == ["epoch=2-step=20.ckpt"]
    with open(logs / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    steps = [r for r in rows if r.get("zeroshard/step_time_s")]
    assert len(steps) == 4 and all(float(r["zeroshard/model_state_bytes"]) > 0 for r in steps)
    assert any(r.get("loss") for r in rows)
