"""Hot-expert replication: the greedy plan, its invariants, and the load-balance simulator."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from loongforge.core.errors import UserError
from loongforge.core.parallel.expert_placement import ExpertPlacement, home_placement, imbalance, plan_replication

SIM_PATH = Path(__file__).resolve().parents[2] / "tools" / "moe_balance_sim.py"


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location("loongforge_moe_balance_sim", SIM_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_invariants(placement: ExpertPlacement, load):
    """Tokens are neither lost nor duplicated, copies sit on distinct ranks, no rank overflows."""
    assert placement.rank_loads(load).sum() == pytest.approx(float(np.sum(load)))
    for expert in range(placement.num_experts):
        ranks = placement.copies(expert)
        assert len(set(ranks)) == len(ranks)
        assert all(expert in placement.slots[r] for r in ranks)
    assert all(len(held) <= placement.experts_per_rank + placement.spare_slots for held in placement.slots)


def test_home_placement_holds_contiguous_blocks():
    placement = home_placement(12, 4, spare_slots=1)
    assert placement.slots == ((0, 1, 2), (3, 4, 5), (6, 7, 8), (9, 10, 11))
    assert placement.copies(7) == [2]
    load = np.arange(12, dtype=float)
    assert placement.rank_loads(load).tolist() == [load[0:3].sum(), load[3:6].sum(), load[6:9].sum(), load[9:12].sum()]


def test_one_hot_expert_is_copied_until_balanced():
    load = np.ones(16)
    load[0] = 1000.0  # rank 0 alone would compute 1001 of 1015 tokens
    placement = plan_replication(load, ep_size=8, spare_slots=1)
    # one copy per rank: each computes 1000 / 8 of it, plus its own two cold experts
    assert sorted(placement.copies(0)) == list(range(8))
    assert placement.copies(0)[0] == 0  # home first
    assert imbalance(home_placement(16, 8).rank_loads(load)) > 7
    assert imbalance(placement.rank_loads(load)) < 1.01
    check_invariants(placement, load)


def test_first_replica_prefers_the_source_node_only_when_it_stays_below_the_source():
    # 4 ranks of 2 experts, nodes {0, 1} and {2, 3}; rank 0 holds hot expert 0 (100) and expert 1 (20).
    # Splitting expert 0 leaves rank 0 at 50 + 20 = 70 and adds 50 to the rank that takes the copy.
    near_is_light = [100, 20, 6, 4, 4, 4, 3, 2]  # rank 1 at 10 -> 60 < 70: stay on the node
    placement = plan_replication(near_is_light, ep_size=4, spare_slots=1, ranks_per_node=2)
    assert placement.copies(0)[1] == 1

    near_is_heavy = [100, 20, 20, 10, 4, 4, 3, 2]  # rank 1 at 30 -> 80 > 70: go to the least loaded rank, 3
    placement = plan_replication(near_is_heavy, ep_size=4, spare_slots=1, ranks_per_node=2)
    assert placement.copies(0)[1] == 3

    # on one node, the least loaded rank wins outright
    assert plan_replication(near_is_light, ep_size=4, spare_slots=1).copies(0)[1] == 3


def test_two_equally_hot_ranks_are_both_relieved():
    # ranks 0 and 1 tie at the max: relieving one alone leaves the max unchanged, yet is progress
    load = [90, 10, 90, 10, 5, 5, 5, 5]
    placement = plan_replication(load, ep_size=4, spare_slots=1)
    assert len(placement.copies(0)) == 2 and len(placement.copies(2)) == 2
    assert placement.rank_loads(load).max() < 100


def test_greedy_never_raises_the_max_load():
    for seed in range(50):
        rng = np.random.default_rng(seed)
        ep_size = int(rng.choice([2, 4, 8]))
        num_experts = ep_size * int(rng.integers(1, 5))
        load = rng.pareto(1.0, num_experts) * rng.integers(0, 2, num_experts)  # heavy tails, some experts idle
        ranks_per_node = int(rng.choice([d for d in (1, 2, 4) if ep_size % d == 0]))
        placement = plan_replication(load, ep_size, int(rng.integers(0, 4)), ranks_per_node)
        home_max = home_placement(num_experts, ep_size).rank_loads(load).max()
        assert placement.rank_loads(load).max() <= home_max * (1 + 1e-12), seed
        check_invariants(placement, load)


def test_no_load_no_spare_and_uniform_load_give_the_home_placement():
    assert plan_replication(np.zeros(8), 4, 2) == home_placement(8, 4, 2)
    assert plan_replication(np.arange(8.0), 4, 0) == home_placement(8, 4, 0)
    assert plan_replication(np.ones(8), 4, 2) == home_placement(8, 4, 2)  # any copy would overload its new rank
    assert imbalance(np.zeros(4)) == 1.0


def test_plan_is_deterministic_and_round_trips():
    load = np.random.default_rng(3).zipf(1.5, 32).astype(float)
    first, second = plan_replication(load, 8, 2, 4), plan_replication(load, 8, 2, 4)
    assert first == second
    assert first.replica_order, "a zipf load should get replicas"
    restored = ExpertPlacement.from_dict(json.loads(json.dumps(first.to_dict())))
    assert restored == first
    assert all(restored.copies(e) == first.copies(e) for e in range(32))
    np.testing.assert_allclose(restored.rank_loads(load), first.rank_loads(load))


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(load=[1.0] * 6, ep_size=4, spare_slots=1), "load"),
        (dict(load=[1.0, -1.0, 1.0, 1.0], ep_size=2, spare_slots=1), "load"),
        (dict(load=[1.0] * 4, ep_size=0, spare_slots=1), "ep_size"),
        (dict(load=[1.0] * 4, ep_size=2, spare_slots=-1), "spare_slots"),
        (dict(load=[1.0] * 8, ep_size=4, spare_slots=1, ranks_per_node=3), "ranks_per_node"),
    ],
)
def test_bad_inputs_name_the_argument(kwargs, named):
    with pytest.raises(UserError, match=named):
        plan_replication(**kwargs)


def test_from_dict_rejects_a_replica_beyond_the_spare_slots():
    bad = home_placement(4, 2, spare_slots=0).to_dict()
    bad["slots"][1].append(0)
    with pytest.raises(UserError, match=r"slots\[1\]"):
        ExpertPlacement.from_dict(bad)


def test_simulator_balances_zipf_routing(sim):
    # E=64, top-8, 8 ranks, 2 spare slots each; popularity ~ 1/rank drifts (a swap every ~20 steps)
    steps = sim.synthetic_steps("zipf:1.0", experts=64, top_k=8, tokens=4096, steps=120, drift=0.05, seed=0)
    result = sim.simulate(steps, ep=8, spare=2, ranks_per_node=None, window=10)
    assert result["steps_evaluated"] == 110
    assert result["plain_mean"] >= 1.5
    assert result["replicated_mean"] <= 1.1


def test_simulator_leaves_uniform_routing_alone(sim):
    steps = sim.synthetic_steps("zipf:0", experts=64, top_k=8, tokens=4096, steps=60, drift=0.05, seed=1)
    result = sim.simulate(steps, ep=8, spare=2, ranks_per_node=2, window=10)
    assert result["plain_mean"] < 1.06
    assert result["replicated_mean"] < 1.06


def test_simulator_plans_only_from_earlier_steps(sim):
    # expert 0 is hot only in the last step: the plan, made from the steps before, cannot know it
    quiet = [np.ones(8) for _ in range(3)]
    burst = np.ones(8)
    burst[0] = 100.0
    result = sim.simulate(quiet + [burst], ep=4, spare=1, ranks_per_node=None, window=3)
    assert result["steps_evaluated"] == 1
    assert result["replicated_mean"] == result["plain_mean"] == pytest.approx(101 / (107 / 4))


def test_trace_gives_one_row_per_layer_and_their_mean(sim, tmp_path, capsys):
    rng = np.random.default_rng(0)
    trace = tmp_path / "routing_trace.jsonl"
    records = [{"step": s, "layer": layer, "tokens_per_expert": rng.integers(0, 50, 16).tolist()} for s in range(6) for layer in (0, 1)]
    trace.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    out = tmp_path / "balance.json"
    assert sim.main(["--trace", str(trace), "--ep", "4", "--spare", "1", "--window", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["scenario"] for r in rows] == ["routing_trace.jsonl layer 0", "routing_trace.jsonl layer 1", "mean over 2 layers"]
    assert rows[2]["plain_mean"] == pytest.approx((rows[0]["plain_mean"] + rows[1]["plain_mean"]) / 2)
    assert "| mean over 2 layers | 4 | 1 |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "line 2: not valid JSON"),
        ('{"step": 1, "layer": 0, "tokens_per_expert": [1, -2]}', "line 2: 'tokens_per_expert'"),
        ('{"step": "1", "layer": 0, "tokens_per_expert": [1, 2]}', "line 2: 'step'"),
    ],
)
def test_malformed_trace_line_is_named(sim, tmp_path, capsys, line, message):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"step": 0, "layer": 0, "tokens_per_expert": [1, 2]}\n' + line + "\n")
    assert sim.main(["--trace", str(trace), "--ep", "2"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("spec", ["zipf", "zipf:x", "zipf:-1", "hot:0:0.5", "hot:4:1.5", "uniform:1"])
def test_bad_synthetic_spec_is_one_error_line(sim, capsys, spec):
    assert sim.main(["--synthetic", spec]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: bad --synthetic") and err.count("\n") == 1


def test_cli_prints_the_table_and_exits_2_on_a_missing_trace(tmp_path):
    ok = subprocess.run([sys.executable, str(SIM_PATH), "--synthetic", "zipf:1.2", "--steps", "40"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "| zipf:1.2 | 8 | 2 |" in ok.stdout and "replicated max/mean (mean)" in ok.stdout

    missing = subprocess.run([sys.executable, str(SIM_PATH), "--trace", str(tmp_path / "nope.jsonl")], capture_output=True, text=True)
    assert missing.returncode == 2
    assert missing.stderr.splitlines() == [f"error: trace file not found: {tmp_path / 'nope.jsonl'}"]
