"""zeroshard estimate: the ZeRO paper's Table 1 figure for figure, Table 2's theoretical columns, and
the estimator's bytes against what the runtime holds (test_parity's and test_offload's memory
scenarios, worlds 1-3: the runtime pads chunks, so it may hold up to 4% more)."""
import pytest

import zeroshard.cli
from distributed import ok, table_rows
from scenarios import PARITY
from zeroshard.planning.estimate import estimate, largest_model, paper_gb, per_param, table1, table2

RESULTS = PARITY  # read by the `res` fixture (conftest.py)

# Copied from the paper (../shared/papers/zero.txt, Table 1): DP, then 7.5B, 128B, 1T x P_os, P_os+g, P_os+g+p.
PAPER_TABLE1 = """
1	120	120	120	2048	2048	2048	16000	16000	16000
4	52.5	41.3	30	896	704	512	7000	5500	4000
16	35.6	21.6	7.5	608	368	128	4750	2875	1000
64	31.4	16.6	1.88	536	284	32	4187	2218	250
256	30.4	15.4	0.47	518	263	8	4046	2054	62.5
1024	30.1	15.1	0.12	513	257	2	4011	2013	15.6
"""
# Table 2, theoretical columns: MP, GPUs, baseline, P_os, P_os+g, P_os+g+p.
PAPER_TABLE2 = """
1	64	2B	7.6B	14.4B	128B
2	128	4B	15.2B	28.8B	256B
4	256	8B	30.4B	57.6B	0.5T
8	512	16B	60.8B	115.2B	1T
16	1024	32B	121.6B	230.4B	2T
"""


def rows(text):
    return [line.split("\t") for line in text.strip().splitlines()]


def test_table1_is_the_papers():
    assert table1() == rows(PAPER_TABLE1)


def test_table2_theoretical_columns_are_the_papers():
    assert table2() == rows(PAPER_TABLE2)


def test_paper_rounding():
    assert [paper_gb(x) for x in (41.25, 1.875, 0.46875, 513.5, 4187.5, 7.5, 120.0, 15.625)] == \
        ["41.3", "1.88", "0.47", "513", "4187", "7.5", "120", "15.6"]


@pytest.mark.parametrize("n", [1, 3, 64])
def test_the_papers_formulas(n):
    # mixed-precision Adam, section 5: 16, 4 + 12/N, 2 + 14/N, 16/N bytes per parameter
    assert [per_param(s, n)[0] for s in range(4)] == pytest.approx([16, 4 + 12 / n, 2 + 14 / n, 16 / n])
    # fp32 Adam: 4-byte parameters and gradients, 8 bytes of moments, no master copy
    assert [per_param(s, n, precision="fp32")[0] for s in range(4)] == \
        pytest.approx([16, 8 + 8 / n, 4 + 12 / n, 16 / n])
    # offload keeps the total and moves the optimizer's share to the host
    for stage, off in ((1, "optimizer"), (2, "optimizer"), (3, "optimizer"), (3, "params"), (3, "optimizer+params")):
        d, h = per_param(stage, n, offload=off)
        assert d + h == pytest.approx(per_param(stage, n)[0] + (2 / n if stage == 1 else 0))
    assert largest_model(32e9, 3, 64) == pytest.approx(128e9)
    # the parameter tier moves the shard from the host to disk: the same total, 2 / N fewer host bytes
    (d, h), (d2, h2) = per_param(3, n, offload="disk+params"), per_param(3, n, offload="disk+params-on-disk")
    assert d == pytest.approx(0) and d2 == pytest.approx(0) and h - h2 == pytest.approx(2 / n)
    assert estimate(1, 3, n, offload="disk+params-on-disk").disk - estimate(1, 3, n, offload="disk").disk == \
        pytest.approx(2 / n)


def test_bad_arguments():
    with pytest.raises(ValueError, match="stage >= 1"):
        per_param(0, 2, offload="optimizer")
    with pytest.raises(ValueError, match="stage 3"):
        per_param(2, 2, offload="params")


def _within_padding(est, got, what):
    assert est <= got <= 1.04 * est + 4096, (what, est, got)


def test_estimate_is_what_the_runtime_holds(res):  # noqa: F811
    r, n = res
    got = ok(r, "memory_bf16_adamw")
    for stage in range(4):
        s = got[str(stage)]
        _within_padding(estimate(s["num_params"], stage, n).device, s["model_state_bytes"], stage)
    got = ok(r, "offload_memory_bf16_adamw")
    for name, stage, off in (("s1_opt", 1, "optimizer"), ("s2_opt", 2, "optimizer"), ("s3_opt", 3, "optimizer"),
                             ("s3_params", 3, "params"), ("s3_all", 3, "optimizer+params")):
        s = got[name]
        e = estimate(s["num_params"], stage, n, offload=off)
        _within_padding(e.device, s["model_state_bytes_by_device"]["device"], name)
        _within_padding(e.host, s["model_state_bytes_by_device"]["host"], name)


def test_cli_paper(capsys):
    assert zeroshard.cli.main(["estimate", "--paper"]) == 0
    tables = capsys.readouterr().out.split("\n\n")
    assert table_rows(tables[0])["64"] == ["31.4", "16.6", "1.88", "536", "284", "32", "4187", "2218", "250"]
    assert table_rows(tables[1])["16"] == ["1024", "32B", "121.6B", "230.4B", "2T"]


def test_cli_count_and_fit(capsys):
    assert zeroshard.cli.main(["estimate", "7.5B", "--gpus", "1,64", "--gpu-memory", "32GB"]) == 0
    memory, largest, load = capsys.readouterr().out.split("\n\n")
    assert table_rows(memory)["2"] == ["120.00 / 0.00 no", "16.64 / 0.00 ok"]
    assert table_rows(memory)["3 + offload"] == ["15.00 / 105.00 ok", "0.23 / 1.64 ok"]
    assert table_rows(largest)["3"] == ["2.0B", "128.0B"]
    assert table_rows(largest)["3 + offload + params"] == ["any (host-bound)"] * 2
    rows = table_rows(load)
    assert "8 ranks per node" in load
    assert rows["built normally: each rank builds the whole model (fp32)"][0] == "240.00"  # 8 x 4 x 7.5B
    assert rows["on the meta device: initialize(meta model, weights=...)"][0] == "give a model to size its largest tensor"


def test_cli_model_and_errors(capsys):
    assert zeroshard.cli.main(["estimate", "gpt2", "--gpus", "2", "--ranks-per-node", "2"]) == 0
    out = capsys.readouterr().out
    assert "124,439,808 parameters" in out
    # built normally: 2 x 4 x 124.4M; on meta: 2 x 4 x the embedding's 50257 x 768
    rows = table_rows(out.split("\n\n")[-1])
    assert rows["built normally: each rank builds the whole model (fp32)"][0] == "1.00"
    assert rows["on the meta device: initialize(meta model, weights=...)"][0] == "0.31"
    assert zeroshard.cli.main(["estimate"]) == 2
    assert zeroshard.cli.main(["estimate", "1B", "--gpus", "0"]) == 2


# -- tensor parallelism and ZeRO-R's P_a (issue 18, the estimator's part) ----------------------------
@pytest.mark.parametrize("mp", [2, 4, 16])
def test_tensor_parallelism_divides_every_model_state_by_its_degree(mp):
    for stage, off in [(0, "none"), (2, "none"), (3, "none"), (2, "optimizer"), (3, "optimizer+params")]:
        d1, h1 = per_param(stage, 64, offload=off)
        d, h = per_param(stage, 64, offload=off, mp=mp)
        assert (d, h) == pytest.approx((d1 / mp, h1 / mp))
    # Table 2: the largest model at MP x 64 GPUs is MP times the MP-1 size
    for stage in range(4):
        assert largest_model(32e9, stage, 64, mp=mp) == pytest.approx(mp * largest_model(32e9, stage, 64))
    with pytest.raises(ValueError, match="tensor-parallel degree"):
        per_param(2, 4, mp=0)


def test_partitioned_activation_checkpoints_are_one_mp_th_and_cost_a_twelfth_of_mp_traffic():
    from zeroshard.planning.estimate import activation_checkpoint_bytes, communication_per_step
    shape = dict(layers=24, batch=8, seq=1024, hidden=1024)
    full = 24 * 8 * 1024 * 1024 * 2  # one bf16 checkpoint per block input
    assert activation_checkpoint_bytes(**shape, mp=16) == (full, 0.0)  # MP replicates them
    assert activation_checkpoint_bytes(**shape, mp=16, partitioned=True) == (full / 16, 0.0)
    assert activation_checkpoint_bytes(**shape, mp=16, partitioned=True, on_host=True) == (0.0, full / 16)
    with pytest.raises(ValueError, match="on_host needs partitioned"):
        activation_checkpoint_bytes(**shape, mp=16, on_host=True)
    c = communication_per_step(1.5e9, 2, 16, **shape, partitioned=True)
    # the paper, section 8: 12 x seq x hidden per block for MP, P_a adds seq x hidden: under 10%
    assert c["mp"] == 12 * 8 * 1024 * 1024 * 24 and c["p_a"] == c["mp"] / 12 < 0.1 * c["mp"]
    assert c["dp"] == 2 * 1.5e9 / 16
    assert communication_per_step(1.5e9, 3, 16, **shape)["dp"] == 3 * 1.5e9 / 16
    assert communication_per_step(1.5e9, 2, 1, **shape, partitioned=True)["p_a"] == 0.0  # no MP: nothing to gather


def test_cli_tensor_parallel_and_activation_checkpoints(capsys):
    assert zeroshard.cli.main(["estimate", "gpt2", "--gpus", "1", "--tp", "2", "--seq-len", "1024",
                               "--micro-batch", "8"]) == 0
    out = capsys.readouterr().out
    tables = out.split("\n\n")
    assert "tensor parallel 2" in tables[0]
    one = per_param(0, 1, mp=2)[0] * 124439808 / 1e9
    assert table_rows(tables[0])["0"] == [f"{one:.2f} / 0.00"]
    ckpt = table_rows(tables[1])  # 12 blocks x 8 x 1024 x 768 x 2 bytes = 0.151 GB
    assert ckpt["replicated (no P_a)"] == ["0.151 / 0.000"]
    assert ckpt["P_a: partitioned over the MP ranks"] == ["0.075 / 0.000"]
    assert ckpt["P_a+cpu: partitioned, on the host"] == ["0.000 / 0.075"]
    assert table_rows(tables[2])["3"][-1] == "8.3%"
    assert zeroshard.cli.main(["estimate", "1B", "--seq-len", "1024"]) == 2  # no config: --layers/--hidden needed
    assert zeroshard.cli.main(["estimate", "1B", "--tp", "2", "--seq-len", "1024", "--layers", "24",
                               "--hidden", "2048"]) == 0
