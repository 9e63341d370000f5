"""The planner across nodes (planning/links.py) and `zeroshard plan MODEL --nodes ...`: the
per-link volumes are the runtime's (tests/test_hybrid.py compares them with measured counts), the
memory is Table 1 with W, G and hpZ's secondary shards, and the pick follows memory and time."""
import json

import pytest

from zeroshard.cli import main
from zeroshard.planning.links import LAYOUTS, Job, Links, compare, predict, volumes

PSI = 1000.0


def test_volumes_per_link_are_the_written_formulas():
    # every chunk cached, one micro-batch: what the runtime counts (test_hybrid)
    assert volumes("full sharding", PSI, 16, 8, 1, regather=False) == {"W": 2 * PSI, "G": 0.0, "replicas": 0.0}
    assert volumes("HSDP (node)", PSI, 16, 8, 1, regather=False) == {"W": 0.0, "G": 2 * PSI, "replicas": 2 * PSI / 8}
    assert volumes("hpZ (node)", PSI, 16, 8, 1, regather=False) == {"W": 2 * PSI, "G": 0.0, "replicas": 0.0}
    # a two-chunk rCache, k micro-batches: full sharding 3k Psi over W; hpZ keeps (2k - 1) Psi in the node
    k = 4
    assert volumes("full sharding", PSI, 16, 8, k, regather=True)["W"] == 3 * k * PSI
    hpz = volumes("hpZ (node)", PSI, 16, 8, k, regather=True)
    assert (hpz["W"], hpz["G"]) == ((1 + k) * PSI, (2 * k - 1) * PSI)
    assert sum(hpz.values()) == 3 * k * PSI  # the same total as full sharding, moved off the slow link
    # one node: every layout is full sharding
    assert all(volumes(layout, PSI, 8, 8, k, True) == volumes("full sharding", PSI, 8, 8, k, True) for layout in LAYOUTS)
    with pytest.raises(ValueError, match="unknown layout"):
        volumes("ring", PSI, 16, 8, 1, True)


def test_memory_is_table_1_with_w_g_and_the_secondary_shards():
    job, links = Job(params=70e9), Links(gpus_per_node=8)
    full, hsdp, hpz = (predict(layout, 8, job, links, regather=True) for layout in LAYOUTS)
    assert full.state_bytes == pytest.approx(16 * 70e9 / 64)
    assert hsdp.state_bytes == pytest.approx(16 * 70e9 / 8)
    assert hpz.state_bytes == pytest.approx(16 * 70e9 / 64 + 2 * 70e9 / 8)
    assert not hsdp.fits and full.fits and hpz.fits  # 140 GB of states per GPU at G = 8
    assert hpz.across_elements < full.across_elements and hsdp.across_elements < hpz.across_elements
    assert full.blocking_s == 0 and hsdp.blocking_s > 0  # HSDP's all-reduce at the step is not overlapped


def test_the_pick_is_the_fastest_layout_that_fits():
    links = Links(gpus_per_node=8)
    small = compare([1, 8, 64], Job(params=7e9, layers=32, hidden=4096), links)
    one_node, *more = small
    assert len({round(p.step_s, 9) for p in one_node[0]}) == 1 and one_node[1].layout == "full sharding"
    assert all(pick.layout == "HSDP (node)" for _, pick in more)  # 7B: the node holds it, least traffic across
    big = compare([1, 8, 1024], Job(params=70e9, layers=80, hidden=8192), links)
    assert big[0][1] is None  # 140 GB of states per GPU on one node: nothing fits
    for preds, pick in big[1:]:
        assert pick.layout == "hpZ (node)" and pick.regather
        assert pick.step_s < next(p for p in preds if p.layout == "full sharding").step_s
    # a fast network makes hpZ's extra memory pointless: full sharding, then, at least as fast
    fast = compare([8], Job(params=70e9), Links(gpus_per_node=8, inter=300e9))[0]
    assert fast[1].layout == "full sharding"


def test_plan_nodes_table_and_json(capsys):
    assert main(["plan", "70B", "--nodes", "1,8,64,1024", "--layers", "80", "--hidden", "8192", "--checkpointing"]) == 2
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("| ") and "layout" not in ln]
    assert len(rows) == 12 and sum(ln.rstrip(" |").endswith("<-") for ln in rows) == 3
    assert "at 1 node nothing fits 80 GB per GPU" in out and "planning/links.py" in out
    assert main(["plan", "7B", "--nodes", "8", "--json", "--inter-node-bandwidth", "50GB/s"]) == 0
    facts = json.loads(capsys.readouterr().out)
    # at 50 GB/s full sharding's traffic hides behind compute; HSDP's all-reduce at the step does not
    assert facts["links"]["inter"] == 50e9 and facts["scales"][0]["pick"] == "full sharding"
    assert [x["layout"] for x in facts["scales"][0]["layouts"]] == list(LAYOUTS)
    assert main(["plan", "7B", "--nodes", "2", "--layers", "32"]) == 2  # --hidden missing
    assert "--layers and --hidden go together" in capsys.readouterr().err
