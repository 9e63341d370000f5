"""`zeroshard plan`: run in-process through `zeroshard.cli.main`, which returns the exit status."""
from __future__ import annotations

import json

import pytest
import torch.nn as nn

from distributed import table_rows
from zeroshard.cli.model import PRESETS
from zeroshard.cli import bandwidth, main, rate, size
from zeroshard.planning.hardware import GIB, Hardware

ROWS = ("ZeRO-2", "ZeRO-3", "ZeRO-2 offload", "ZeRO-3 offload", "plan")


def tiny():
    """A factory for `zeroshard plan test_cli:tiny` (conftest puts tests/ on sys.path)."""
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64))


def tiny_embedding():
    return nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 8))


def not_a_module():
    return 42


def tiny_float64():
    return tiny().double()


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


def test_opt_175b_on_8_gpus_fits_and_prints_every_row(capsys):
    rc, out, _ = run(capsys, "plan", "opt-175b", "--gpus", "8", "--gpu-memory", "80GB", "--seq-len", "2048",
                     "--checkpointing")
    assert rc == 0, out
    assert "174.604 B elements" in out and "96 checkpoint regions" in out
    assert out.count("chosen: plan: stage") == 1
    assert "chunk search: " in out and "padding waste" in out
    rows = table_rows(out)
    assert set(rows) == set(ROWS)
    # columns: device GiB, fits, step, compute, exposed transfers, device step, CPU step, TFLOPS
    assert rows["plan"][1] == "yes" and float(rows["plan"][0]) <= 80e9 / GIB
    assert rows["ZeRO-2"][1] == "no"  # 175B parameters' states do not fit 8 GPUs unsharded
    for name, cells in rows.items():
        step, parts = float(cells[2]), [float(c) for c in cells[3:7]]
        assert step == pytest.approx(sum(parts), abs=0.5), name
        assert float(cells[7]) > 0


def test_factory_model(capsys):
    rc, out, _ = run(capsys, "plan", "test_cli:tiny", "--input-shape", "4,64", "--gpu-memory", "1GB",
                     "--reserve", "0")
    assert rc == 0, out
    assert "factory test_cli:tiny" in out and "input (4, 64) float32" in out
    assert "5 parameters" not in out and "6 parameters" in out
    assert set(table_rows(out)) == set(ROWS)


def test_factory_model_default_reserve_says_the_reserve_is_what_does_not_fit(capsys):
    # A described GPU keeps Hardware.described's 2 GiB driver reserve: 1 GB cannot hold it.
    rc, out, _ = run(capsys, "plan", "test_cli:tiny", "--input-shape", "4,64", "--gpu-memory", "1GB")
    assert rc == 2
    assert "nothing fits" in out and "driver reserve" in out


def test_factory_embedding_gets_integer_input(capsys):
    rc, out, _ = run(capsys, "plan", "test_cli:tiny_embedding", "--input-shape", "4,10", "--gpu-memory", "4GB")
    assert rc == 0, out
    assert "input (4, 10) int64" in out


def test_gpt2_in_1mb_does_not_fit(capsys):
    rc, out, _ = run(capsys, "plan", "gpt2", "--seq-len", "128", "--gpu-memory", "1MB")
    assert rc == 2
    assert "closest (does not fit)" in out
    assert "nothing fits in 976.56 KiB per device" in out
    assert "Sharded model states take" in out
    assert all(cells[1] == "no" for cells in table_rows(out).values())


def test_json(capsys):
    rc, out, _ = run(capsys, "plan", "gpt2", "--seq-len", "128", "--gpus", "4", "--gpu-memory", "40GiB",
                     "--tflops", "300", "--link", "100GB/s", "--h2d", "25GB/s", "--cpu-adam", "3e9", "--json")
    assert rc == 0
    facts = json.loads(out)
    assert facts["fits"] is True and facts["why_nothing_fits"] is None
    assert facts["world"] == 4
    hw = facts["hardware"]
    assert hw["device_memory"] == 40 * GIB and hw["device_flops"] == 300e12 and hw["link"] == 100e9
    assert hw["h2d"] == 25e9 and hw["d2h"] == 20e9 and hw["host_adam"] == 3e9
    assert [b["name"] for b in facts["baselines"]] == list(ROWS[:4])
    plan = facts["plan"]
    assert plan["name"] == "plan" and plan["fits"] and plan["config"]["stage"] in (2, 3)
    t = plan["time_ms"]
    assert t["total"] == pytest.approx(t["compute"] + t["exposed_transfers"] + t["device_step"] + t["cpu_step"])
    assert facts["profile"]["numel"] == 124_439_808
    assert facts["search_seconds"] >= 0 and 0 <= facts["padding_waste"] < 1


def test_json_when_nothing_fits(capsys):
    rc, out, _ = run(capsys, "plan", "gpt2", "--seq-len", "128", "--gpu-memory", "1MB", "--json")
    assert rc == 2
    facts = json.loads(out)
    assert facts["fits"] is False and "nothing fits" in facts["why_nothing_fits"]


def test_config_json_path_and_directory(capsys, tmp_path):
    from transformers import GPT2Config
    GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0,
               eos_token_id=0).to_json_file(str(tmp_path / "config.json"))
    for model in (str(tmp_path), str(tmp_path / "config.json")):
        rc, out, _ = run(capsys, "plan", model, "--seq-len", "64", "--micro-batch", "2", "--gpu-memory", "8GB")
        assert rc == 0, out
        assert "micro-batch 2 x 64 tokens" in out
    rc, _, err = run(capsys, "plan", str(tmp_path), "--seq-len", "65", "--gpu-memory", "8GB")
    assert rc == 2 and "exceeds the model's 64 positions" in err


def test_probes_this_machine_without_flags(capsys, monkeypatch):
    fake = Hardware(name="cpu", device_memory=64 * GIB, host_memory=64 * GIB, h2d=10e9, d2h=10e9, host_adam=1e9,
                    device_adam=1e9, device_flops=1e12, link=10e9)
    calls = []
    monkeypatch.setattr("zeroshard.planning.hardware.probe", lambda **kw: calls.append(kw) or fake)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    rc, out, _ = run(capsys, "plan", "gpt2", "--seq-len", "128")
    assert rc == 0 and calls
    assert "1 x cpu" in out and "no CUDA device: the CPU is the device" in out
    rc, out, _ = run(capsys, "plan", "gpt2", "--seq-len", "128", "--h2d", "5GB/s", "--json")
    facts = json.loads(out)
    assert facts["hardware"]["h2d"] == 5e9 and facts["hardware"]["device_memory"] == 64 * GIB


@pytest.mark.parametrize("argv, message", [
    (["--gpu-memory", "40XB"], "is not a size"),
    (["--gpu-memory", "forty"], "is not a size"),
    (["--gpu-memory=0GB"], "must be positive"),
    (["--gpu-memory", "80GB", "--h2d", "fast"], "is not a bandwidth"),
    (["--gpu-memory", "80GB", "--cpu-adam", "2GB"], "is not a rate"),
    (["--gpu-memory", "80GB", "--tflops", "0"], "must be a positive"),
    (["--gpus", "0"], "must be positive"),
    (["--seq-len", "-3"], "must be positive"),
    (["--accumulation", "1.5"], "is not an integer"),
    (["--precision", "fp8"], "invalid choice"),
    (["--input-shape", "4,64"], "--input-shape/--input-dtype are for factory models"),
])
def test_bad_input_exits_2_with_a_message(capsys, argv, message):
    rc, out, err = run(capsys, "plan", "gpt2", *argv)
    assert rc == 2
    assert "zeroshard plan: error:" in err and message in err
    assert out == ""


@pytest.mark.parametrize("model, message", [
    ("no-such-model", "unknown model 'no-such-model'"),
    ("no_such_module_xyz:make", "cannot import module 'no_such_module_xyz'"),
    ("test_cli:missing", "has no attribute 'missing'"),
    ("test_cli:not_a_module", "not a torch.nn.Module"),
    ("test_cli:tiny", "give the model's input with --input-shape"),
])
def test_bad_models_exit_2(capsys, model, message):
    rc, out, err = run(capsys, "plan", model, "--gpu-memory", "8GB")
    assert rc == 2 and message in err


def test_a_model_initialize_would_refuse_is_not_planned(capsys):
    rc, out, err = run(capsys, "plan", "test_cli:tiny_float64", "--input-shape", "4,64", "--gpu-memory", "8GB")
    assert rc == 2 and not out
    assert "test_cli:tiny_float64: cannot train this model as it is" in err and "float64 parameters '0.weight'" in err


def test_factory_input_that_does_not_suit_the_model(capsys):
    rc, _, err = run(capsys, "plan", "test_cli:tiny", "--input-shape", "4,65", "--gpu-memory", "8GB")
    assert rc == 2 and "profiling test_cli:tiny on the meta device failed" in err


def test_no_subcommand_prints_help(capsys):
    rc, out, _ = run(capsys)
    assert rc == 0 and "usage: zeroshard" in out and "plan" in out
    assert main(["plan", "--help"]) == 0
    assert "opt-175b" in capsys.readouterr().out


def test_quantities():
    assert size("40GB") == 40_000_000_000
    assert size("40GiB") == 40 * 2**30
    assert size("80e9") == 80_000_000_000
    assert size("512MiB") == 512 * 2**20 and size("1MB") == 10**6 and size("1.5 GB") == 1_500_000_000
    assert bandwidth("20GB/s") == 20e9 and bandwidth("16GiB/s") == 16 * 2**30 and bandwidth("25e9") == 25e9
    assert rate("2e9") == 2e9 and rate("50G") == 50e9
    for bad in ("", "GB", "40XB", "-1GB", "0", "40iB"):
        with pytest.raises(Exception):
            size(bad)
    assert set(PRESETS) >= {"opt-175b", "gpt2-10b", "gpt2"}


def test_plan_with_a_disk_tier_past_host_memory(capsys):
    """A described disk tier and a host too small for every offloaded state: the chosen plan puts
    some chunks on disk and the table says how much the host and the disk hold; with host memory
    to spare, nothing goes to disk."""
    common = ("plan", "gpt2-xl", "--seq-len", "128", "--gpu-memory", "4GiB", "--reserve", "0", "--disk-read",
              "2GB/s", "--disk-write", "1GB/s", "--stage", "3")
    rc, out, _ = run(capsys, *common, "--host-memory", "64GiB")
    assert rc == 0, out
    roomy = table_rows(out)["plan"]  # cells after the name: ..., TFLOPS, host GiB, disk GiB, disk I/O ms
    assert float(roomy[8]) > 20 and float(roomy[9]) == 0.0 and "disk tier" not in out.split("chosen:")[1].split("\n")[0]
    rc, out, _ = run(capsys, *common, "--host-memory", "20GiB")
    assert rc == 0, out
    chosen = out.split("chosen:")[1].split("\n")[0]
    assert "of them in the disk tier" in chosen, chosen
    row = table_rows(out)["plan"]
    assert float(row[8]) <= 0.95 * 20 and float(row[9]) > 0 and float(row[10]) > 0
    assert "disk tier: read 2 GB/s, write 1 GB/s" in out
