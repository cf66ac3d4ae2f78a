"""The bench's ragged pieces: the ``baseline@exchange=ragged`` row and the ``skew`` case key (pure, one process)."""

import torch

from moe_plugins.tools.bench import matrix, rows
from moe_plugins.tools.bench.case import skew_gate
from moe_plugins.tools.bench.matrix import RowSpec


def test_exchange_row_option_parses_and_is_checked():
    spec = matrix.parse_row("baseline@exchange=ragged")
    assert spec == RowSpec(name="baseline", options=(("exchange", "ragged"),))
    assert spec.label == "baseline@exchange=ragged"
    assert rows.row_problems(spec) == []
    assert rows.row_problems(matrix.parse_row("baseline@exchange=padded")) == []
    assert rows.row_problems(matrix.parse_row("baseline@exchange=ragged,r=2")) == []
    assert rows.row_problems(matrix.parse_row("baseline@exchange=ragged,r=auto")) == []     # priced by row_load
    for row in ("parm-s2@exchange=ragged,r=auto", "parm-s2-saa@exchange=ragged", "parm-s2@exchange=ragged,r=2"):
        assert rows.row_problems(matrix.parse_row(row)) == [], row
    (problem,) = rows.row_problems(matrix.parse_row("baseline@exchange=sparse"))
    assert "exchange ('sparse') must be one of 'padded', 'ragged'" in problem
    assert "option 'exchange' is unknown" in rows.row_problems(matrix.parse_row("deepspeed@exchange=ragged"))[0]


def test_skew_case_key():
    (case,) = matrix.parse_cases("S=64,M=8,H=16,E=4,k=2,drop=false,skew=0.5")
    assert case.skew == 0.5 and not case.drop_tokens and case.label.endswith("dropless skew0.5")
    assert matrix.parse_cases("S=64,M=8,H=16,E=4")[0].skew == 0.0
    (problem,) = matrix.case_problems(matrix.parse_cases("S=64,M=8,H=16,E=4,skew=1.5")[0], 4, 2)
    assert "skew (1.5) must be between 0 and 1" in problem


def test_skew_gate_makes_expert_0_the_first_choice_of_the_hot_share_only():
    gen = torch.Generator().manual_seed(1)
    x_SM, wg_EM = torch.randn(40, 16, generator=gen), torch.randn(6, 16, generator=gen) / 4
    for share in (0.0, 0.25, 0.6, 1.0):
        x2_SM, wg2_EM = skew_gate(x_SM, wg_EM, share, torch.Generator().manual_seed(5))
        top_SK = (x2_SM @ wg2_EM.T).topk(2, dim=1).indices
        hot = round(share * 40)
        assert bool((top_SK[:hot, 0] == 0).all()) and not bool((top_SK[hot:] == 0).any())


def test_drift_case_key_and_gate_move_the_hot_expert_every_n_rounds():
    from moe_plugins.tools.bench.case import CaseData, drift_gate
    (case,) = matrix.parse_cases("S=40,M=16,H=16,E=6,k=2,drop=false,skew=0.6,drift=3")
    assert case.drift == 3 and case.label.endswith("dropless skew0.6 drift3")
    bad = [matrix.parse_cases(text)[0] for text in ("S=8,M=8,H=8,E=4,drift=2", "S=8,M=8,H=8,E=4,skew=0.5,drift=-1",
                                                    "S=8,M=4,H=8,E=8,skew=0.5,drift=2")]
    assert ["drift (2) moves the hot expert: it needs skew > 0" in " ".join(matrix.case_problems(bad[0], 4, 2)),
            "drift (-1) must be >= 0" in " ".join(matrix.case_problems(bad[1], 4, 2)),
            "it needs E (8) <= M (4)" in " ".join(matrix.case_problems(bad[2], 4, 2))] == [True] * 3
    gen = torch.Generator().manual_seed(1)
    x_SM, wg_EM = torch.randn(40, 16, generator=gen), torch.randn(6, 16, generator=gen) / 4
    sets, wg2_EM = drift_gate(x_SM, wg_EM, 0.6, torch.Generator().manual_seed(5))
    for e, x_e in enumerate(sets):
        top_SK = (x_e @ wg2_EM.T).topk(2, dim=1).indices
        assert bool((top_SK[:24, 0] == e).all()) and not bool((top_SK[24:] == e).any()), e
    data = CaseData(case=case, groups=None, wg_EM=wg2_EM, full=None, x_SM=sets[0], g_SM=x_SM, dtype=torch.float32,
                    x_hot=tuple(sets))
    assert [next(i for i, s in enumerate(sets) if s is data.tokens(r)) for r in range(0, 21, 3)] == [0, 1, 2, 3, 4, 5, 0]
    assert data.tokens(2) is sets[0] and data.tokens(4) is sets[1]


def test_ragged_row_in_the_bench_on_a_dropless_skewed_case(world):
    """The rank side of ``moe-plugins bench`` on 4 gloo ranks (loopback): stock DeepSpeed, the padded baseline,
    the ragged baseline and DeepSpeed's layer swapped with the ragged exchange compute the same function on a dropless case where expert 0 is 3/4 of the first
    choices; the ragged row's inter-node bytes (ledger: true rows) are below the padded rows' (which equal stock
    DeepSpeed's counted bytes)."""
    from moe_plugins.tools.bench.matrix import BenchPlan, CaseConfig
    from moe_plugins.tools.bench.runner import RankJob
    from tests.workers.bench import run_bench_plan
    case = CaseConfig(tokens=64, hidden=16, ffn=32, experts=8, k=2, drop_tokens=False, ep=4, skew=0.75)
    plan = BenchPlan(nodes=2, ranks_per_node=2, cases=(case,), rates=("unshaped",), iters=2, warmup=1,
                     rows=(RowSpec(name="deepspeed"), RowSpec(name="baseline"),
                           RowSpec(name="baseline", options=(("exchange", "ragged"),)),
                           matrix.parse_row("deepspeed@plugin=baseline,exchange=ragged")))
    (group,) = world(4).run(run_bench_plan, RankJob(plan=plan, cluster=None), timeout_s=600)[0]
    assert group["skipped"] == {}
    stock, padded, ragged = (group["rows"][k] for k in ("deepspeed", "baseline", "baseline@exchange=ragged"))
    adapter = group["rows"]["deepspeed@plugin=baseline,exchange=ragged"]     # the user's path
    for row in (padded, ragged, adapter):
        assert row["max_abs_diff_vs_first"] <= 1e-5 * max(1.0, row["first_row_max_abs"])
    # the same rows; the core router's dropless capacity agreement (an 8-byte all-reduce) is on the core row's
    # ledger, DeepSpeed's gate agrees its own outside the adapter's
    assert all(0 <= r - a <= 8 for a, r in zip(adapter["model_bytes_per_rank"], ragged["model_bytes_per_rank"]))
    assert padded["model_bytes_per_rank"] == stock["model_bytes_per_rank"]
    assert sum(ragged["model_bytes_per_rank"]) * 2 < sum(padded["model_bytes_per_rank"]), \
        (ragged["model_bytes_per_rank"], padded["model_bytes_per_rank"])


def test_deepspeed_adapter_row_takes_the_exchange():
    from moe_plugins.tools.bench.deepspeed_adapter_row import adapter_row_problems, plugin_section
    spec = matrix.parse_row("deepspeed@plugin=baseline,exchange=ragged")
    assert rows.row_problems(spec) == []
    assert plugin_section(spec) == {"schedule": "baseline", "pipeline_degree": 1, "exchange": "ragged"}
    assert "exchange" not in plugin_section(matrix.parse_row("deepspeed@plugin=baseline"))
    assert adapter_row_problems(matrix.parse_row("deepspeed@plugin=parm-s2,exchange=ragged,r=2")) == []
    (problem,) = adapter_row_problems(matrix.parse_row("deepspeed@plugin=baseline,exchange=raged"))
    assert "moe_plugins.exchange ('raged') must be 'padded' or 'ragged'" in problem
    (problem,) = adapter_row_problems(matrix.parse_row("deepspeed@exchange=ragged"))
    assert "option 'exchange' is unknown for the stock layer" in problem


def test_hecate_rows_with_and_without_rematerialization(world):
    """``hecate@remat=1`` beside ``hecate`` (both on the ragged exchange) on 4 gloo ranks: the same function as the
    ragged baseline; the rematerialised row sends more (the copies gathered again in backward); its notes say so and
    give the copies' peak from the schedule's memory ledger (one layer: the same peak, the copies live from its
    forward to its backward either way); a remat value other than 0 or 1 is refused."""
    from moe_plugins.tools.bench.matrix import BenchPlan, CaseConfig
    from moe_plugins.tools.bench.runner import RankJob
    from tests.workers.bench import run_bench_plan
    (problem,) = rows.row_problems(matrix.parse_row("hecate@remat=2"))
    assert "row ('hecate@remat=2'): remat ('2') must be 0 or 1" in problem
    assert rows.row_problems(matrix.parse_row("hecate@prefetch=yes"))[0].endswith("prefetch ('yes') must be 0 or 1")
    assert rows.row_problems(matrix.parse_row("hecate@exchange=ragged,prefetch=1")) == []
    assert "option 'remat' is unknown" in rows.row_problems(matrix.parse_row("baseline@remat=1"))[0]
    assert rows.row_problems(matrix.parse_row("hecate@remat=1,regather=soon"))[0].endswith(
        "regather ('soon') must be early or at_need")
    from moe_plugins.tools.bench.runner import _pipelines      # an early re-gather runs on the case's lane
    assert _pipelines(matrix.parse_row("hecate@remat=1"))
    assert not _pipelines(matrix.parse_row("hecate@remat=1,regather=at_need"))
    case = CaseConfig(tokens=64, hidden=16, ffn=32, experts=8, k=2, drop_tokens=False, ep=4, skew=0.75)
    plan = BenchPlan(nodes=2, ranks_per_node=2, cases=(case,), rates=("unshaped",), iters=2, warmup=1,
                     rows=(matrix.parse_row("baseline@exchange=ragged"), matrix.parse_row("hecate@exchange=ragged"),
                           matrix.parse_row("hecate@exchange=ragged,remat=1")))
    (group,) = world(4).run(run_bench_plan, RankJob(plan=plan, cluster=None), timeout_s=600)[0]
    assert group["skipped"] == {}
    kept, remat = group["rows"]["hecate@exchange=ragged"], group["rows"]["hecate@exchange=ragged,remat=1"]
    for row in (kept, remat):
        assert row["max_abs_diff_vs_first"] <= 1e-5 * max(1.0, row["first_row_max_abs"])
    assert all(r >= k for k, r in zip(kept["model_bytes_per_rank"], remat["model_bytes_per_rank"]))
    assert sum(remat["model_bytes_per_rank"]) > sum(kept["model_bytes_per_rank"])
    assert "re-gathered in backward" in remat["notes"][0] and "re-gathered" not in kept["notes"][0]
    peaks = [float(row["notes"][-1].split()[2]) for row in (kept, remat)]
    assert kept["notes"][-1].startswith("copies' peak") and 0 < peaks[1] <= peaks[0], peaks


def test_bytes_are_metered_in_the_last_warmup_round(world):
    """A prefetching Hecate row plans its copies from the load of earlier calls: in round 0 it has none and copies
    nothing (the ragged baseline's bytes, plus its plan's load all-reduce); the bytes reported come from the last
    warm-up round, where its copies keep the hot expert's rows home (the busiest rank's bytes below half)."""
    from moe_plugins.tools.bench.matrix import BenchPlan, CaseConfig
    from moe_plugins.tools.bench.runner import RankJob
    from tests.workers.bench import run_bench_plan
    case = CaseConfig(tokens=256, hidden=16, ffn=32, experts=8, k=2, drop_tokens=False, ep=4, skew=0.9)
    labels = ("baseline@exchange=ragged", "hecate@exchange=ragged,prefetch=1")
    out = {}
    for warmup in (1, 2):
        plan = BenchPlan(nodes=2, ranks_per_node=2, cases=(case,), rates=("unshaped",), iters=1, warmup=warmup,
                         rows=tuple(matrix.parse_row(label) for label in labels))
        (group,) = world(4).run(run_bench_plan, RankJob(plan=plan, cluster=None), timeout_s=600)[0]
        out[warmup] = [group["rows"][label]["model_bytes_per_rank"] for label in labels]
    ragged, prefetch = out[1]
    assert all(0 <= p - r <= 256 for r, p in zip(ragged, prefetch)), out    # round 0: no copy (the plan's few bytes)
    ragged, prefetch = out[2]
    assert ragged == out[1][0] and max(prefetch) < 0.5 * max(ragged), out   # steady state: copies where tokens are
