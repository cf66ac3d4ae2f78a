"""Pure parts of ``moe-plugins bench``: plan parsing and checks, statistics, lower bound, report, mode choice,
names, and that the patches (Megatron CPU shims, collective counter) restore the originals."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from moe_plugins.tools.bench import cluster, harness, launch, matrix, report, rows
from moe_plugins.tools.bench.matrix import BenchPlan, CaseConfig, RowSpec


def test_parse_rate_uses_tc_si_units():
    assert matrix.parse_rate("200mbit") == 200_000_000
    assert matrix.parse_rate("1gbit") == 1_000_000_000
    assert matrix.parse_rate("1.5gbit") == 1_500_000_000
    assert matrix.parse_rate("unshaped") is None
    for bad in ("fast", "0mbit", "200MB", "200 mbit/s"):
        with pytest.raises(ValueError, match=r"rate \('.*'\) must be a positive number"):
            matrix.parse_rate(bad)


def test_parse_row_options_and_errors():
    assert matrix.parse_row("baseline") == RowSpec(name="baseline")
    spec = matrix.parse_row("baseline@r=4,x=y")
    assert spec.options == (("r", "4"), ("x", "y")) and spec.label == "baseline@r=4,x=y" and spec.option("r") == "4"
    with pytest.raises(ValueError, match="must be key=value"):
        matrix.parse_row("baseline@r")
    with pytest.raises(ValueError, match="the name must be"):
        matrix.parse_row("base line")


def test_parse_cases_expands_value_lists_and_reports_every_problem():
    cases = matrix.parse_cases("S=256/512,M=64,H=128,E=8,k=1/2,f=1.25,ep=4")
    assert len(cases) == 4
    assert {(c.tokens, c.k) for c in cases} == {(256, 1), (256, 2), (512, 1), (512, 2)}
    assert all(c.capacity_factor == 1.25 and c.ep == 4 and c.drop_tokens for c in cases)
    with pytest.raises(ValueError) as info:
        matrix.parse_cases("S=x,M=64,Q=3")
    message = str(info.value)
    assert "S ('x') must be an int" in message and "'Q=3'" in message and "missing H, E" in message


def _plan(**overrides) -> BenchPlan:
    base = dict(nodes=2, ranks_per_node=2, cases=(CaseConfig(tokens=64, hidden=32, ffn=64, experts=4, ep=4),),
                rows=(RowSpec(name="baseline"), RowSpec(name="deepspeed")), rates=("200mbit",))
    base.update(overrides)
    return BenchPlan(**base)


def test_plan_problems_lists_everything_at_once():
    assert matrix.plan_problems(_plan()) == []
    bad = _plan(iters=0, profile_repeats=0, rates=("fast",),
                rows=(RowSpec(name="nope"), RowSpec(name="deepspeed", options=(("r", "2"),)),
                      RowSpec(name="baseline"), RowSpec(name="baseline")),
                cases=(CaseConfig(tokens=64, hidden=32, ffn=64, experts=6, ep=4),))
    from moe_plugins.tools.bench.rows import row_problems
    message = "; ".join(matrix.plan_problems(bad, row_problems))
    for needle in ("iters (0)", "profile_repeats (0) must be a positive integer",
                   "rate ('fast')", "row ('nope') is unknown", "option 'r' is unknown",
                   "rows (baseline) are listed twice", "num_experts (6) must be divisible by ep (4)"):
        assert needle in message, needle


def test_every_registered_schedule_is_a_row():
    from moe_plugins.plugins import default_registry
    for name in default_registry().schedule_names():
        assert rows.row_problems(RowSpec(name=name)) == []
        assert rows.row_problems(RowSpec(name=name, options=(("r", "2"),))) == []
    assert rows.row_kind("deepspeed").kind == "stock" and rows.row_kind("baseline").kind == "plugin"


def test_statistics_and_link_lower_bound():
    st = report.time_stats([0.010, 0.020, 0.030, 0.040, 0.050])
    assert st["median_ms"] == pytest.approx(30.0) and st["p10_ms"] == pytest.approx(14.0)
    assert st["p90_ms"] == pytest.approx(46.0) and st["n"] == 5
    assert report.per_node([1, 2, 3, 4], 2, "sum") == [3, 7]
    assert report.per_node([10, 10, 20, 20], 2, "first") == [10, 20]
    assert report.per_node([1, None, 3, 4], 2, "sum") is None
    # busiest node sends 2 MB at 8 Mbit/s: 2 s
    assert report.link_lower_bound_ms([1_000_000, 2_000_000], 8_000_000) == pytest.approx(2000.0)
    assert report.link_lower_bound_ms([1, 2], None) is None


def test_paired_ratio_cancels_shared_drift():
    # both rows slow down together round by round; the row is 10% slower in every round
    ref = [0.100, 0.200, 0.120, 0.300, 0.110, 0.250]
    row = [1.1 * t for t in ref]
    paired = report.paired_ratio(row, ref)
    assert paired["median"] == pytest.approx(1.1)
    assert paired["ci90"][0] == pytest.approx(1.1) and paired["ci90"][1] == pytest.approx(1.1)
    noisy = report.paired_ratio([0.11, 0.19, 0.13, 0.31, 0.10, 0.27], ref)
    assert noisy["ci90"][0] <= noisy["median"] <= noisy["ci90"][1] and noisy["ci90"][0] < noisy["ci90"][1]
    assert report.paired_ratio(row[:3], ref) is None and report.paired_ratio([0.1], [0.1]) is None


def _record():
    def row(kind, times, bytes_per_rank, source):
        return {"kind": kind, "times_s": times, "traffic_source": source, "model_bytes_per_rank": bytes_per_rank,
                "nic_tx_bytes_per_rank": [5_000_000, 5_000_000, 6_000_000, 6_000_000], "max_abs_diff_vs_first": 0.0,
                "first_row_max_abs": 1.0, "notes": []}
    return {"case": {}, "case_label": "S64", "rate": "8mbit", "skipped": {"baseline@r=0": "ValueError: bad"},
            "rows": {"baseline": row("plugin", [0.2, 0.3, 0.4], [1_000_000] * 4, "ledger"),
                     "deepspeed": row("stock", [0.4, 0.6, 0.8], [1_000_000] * 4, "counter")}}


def test_summarize_ratios_and_markdown(tmp_path):
    plan = _plan(rates=("8mbit",))
    group = report.summarize_group(_record(), plan)
    base, ds = group["rows"]["baseline"], group["rows"]["deepspeed"]
    assert base["vs_deepspeed"] == pytest.approx(0.5) and ds["vs_deepspeed"] == pytest.approx(1.0)
    assert base["vs_megatron"] is None
    assert base["model_MB_per_node"] == pytest.approx(2.0) and base["nic_MB_per_node"] == pytest.approx(6.0)
    assert base["link_lb_ms"] == pytest.approx(2000.0) and base["vs_link_lb"] == pytest.approx(0.15)
    rep = {"meta": {"title": "t", "header_lines": ["transport: test"]}, "groups": [group]}
    md = report.markdown(rep)
    assert "| S64 | 8mbit | baseline | 300.0 (220.0–380.0) | 0.50 |" in md
    assert "skipped: ValueError: bad" in md and "transport: test" in md
    paths = report.write_outputs(rep, tmp_path, "x")
    assert [p.name for p in paths] == ["x.json", "x.md", "x.png"]
    assert json.loads(paths[0].read_text())["groups"][0]["rows"]["baseline"]["median_ms"] == pytest.approx(300.0)
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mode_choice_falls_back_loudly_or_refuses():
    assert harness.choose_mode("auto", None) == harness.Decision(True, None)
    assert harness.choose_mode("auto", "not root") == harness.Decision(False, "not root")
    assert harness.choose_mode("loopback", None).use_netns is False
    with pytest.raises(ValueError, match="mode 'netns' needs network namespaces.*not root"):
        harness.choose_mode("netns", "not root")
    with pytest.raises(ValueError, match="mode"):
        harness.choose_mode("fast", None)


def test_cluster_names_are_unique_and_carry_the_owner():
    c = cluster.plan_cluster(cluster.ClusterSpec(nodes=3), "moeb123x0a1f")
    assert c.namespaces == ("moeb123x0a1fsw", "moeb123x0a1fn0", "moeb123x0a1fn1", "moeb123x0a1fn2")
    assert c.addresses == ("10.99.0.1", "10.99.0.2", "10.99.0.3")
    assert c.congestion_control == "reno"
    assert cluster.owner_pid("moeb123x0a1fn2") == 123 and cluster.owner_pid("other") is None
    assert cluster.new_run_id() != cluster.new_run_id()
    with pytest.raises(ValueError, match="nodes"):
        cluster.plan_cluster(cluster.ClusterSpec(nodes=1), "moeb1x0000")


def test_bench_refuses_a_malformed_tcp_cc_before_running(capsys):
    from moe_plugins.tools.cli import main
    rc = main(["bench", "--case", "S=64,M=16,H=32,E=4,k=2,ep=4", "--rows", "baseline", "--rates", "1gbit",
               "--tcp-cc", "reno; rm", "--out", "/nonexistent/never-written"])
    assert rc == 2
    assert "--tcp-cc ('reno; rm') must be a kernel congestion-control name" in capsys.readouterr().err


@pytest.mark.parametrize("burst", ["512", "64 kb", "0kb", "1gbit", "128kb; rm"])
def test_bench_refuses_a_malformed_tbf_burst_before_running(capsys, burst):
    from moe_plugins.tools.cli import main
    rc = main(["bench", "--case", "S=64,M=16,H=32,E=4,k=2,ep=4", "--rows", "baseline", "--rates", "1gbit",
               "--tbf-burst", burst, "--out", "/nonexistent/never-written"])
    assert rc == 2
    assert f"--tbf-burst ({burst!r}) must be a size in tc units" in capsys.readouterr().err


def test_rank_environment_and_command():
    env = launch.rank_env(3, 4, 2, "10.99.0.1", 29500, "nic0")
    assert env["RANK"] == "3" and env["LOCAL_RANK"] == "1" and env["GLOO_SOCKET_IFNAME"] == "nic0"
    c = cluster.plan_cluster(cluster.ClusterSpec(nodes=2), "moeb1x0000")
    assert launch.rank_command(3, 2, c, "job.pkl")[:4] == ["ip", "netns", "exec", "moeb1x0000n1"]
    assert launch.rank_command(3, 2, None, "job.pkl")[1:3] == ["-m", "moe_plugins.tools.bench.rank_main"]


def test_megatron_shims_restore_every_original():
    import torch
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    from moe_plugins.patches.megatron_cpu import _patches, megatron_on_cpu
    targets = [(obj, name) for obj, name, _ in _patches()]
    before = [(obj, name, obj.__dict__.get(name, "MISSING")) for obj, name in targets]
    with megatron_on_cpu():
        assert torch.cuda.current_device() == "cpu"
        assert moe_utils.te_general_gemm is None
        assert token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is not None
    after = [(obj, name, obj.__dict__.get(name, "MISSING")) for obj, name in targets]
    assert all(b[2] is a[2] for b, a in zip(before, after))      # same objects, absent names absent again
    assert ("te_general_gemm" in vars(moe_utils)) == (dict((n, v) for _, n, v in before)["te_general_gemm"] != "MISSING")
    assert mappings._gather_along_first_dim.__module__ == "megatron.core.tensor_parallel.mappings"


def test_collective_counter_restores_torch_distributed():
    from moe_plugins.tools.bench.traffic import CollectiveCounter
    from moe_plugins.core.layout import ParallelLayout
    names = ("all_to_all_single", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather",
             "reduce_scatter")
    before = {n: getattr(dist, n) for n in names}
    counter = CollectiveCounter(layout=ParallelLayout(world=4, ranks_per_node=2), rank=0)
    counter.start()
    assert all(getattr(dist, n) is not before[n] for n in names)
    with pytest.raises(RuntimeError, match="already active"):
        counter.start()
    assert counter.stop() == 0
    assert all(getattr(dist, n) is before[n] for n in names)


def test_auto_rows_are_judged_against_the_choices_they_pick_from():
    labels = ["deepspeed", "baseline", "baseline@r=2", "baseline@r=8", "baseline@r=auto", "parm-s1", "parm-s2",
              "parm-s2-saa", "parm-auto", "parm-s2@r=4"]
    assert report.auto_peers("baseline@r=auto", labels) == ["baseline", "baseline@r=2", "baseline@r=8"]
    assert report.auto_peers("baseline@r=tune", labels + ["baseline@r=tune"]) == report.auto_peers(
        "baseline@r=auto", labels)
    assert report.auto_peers("parm-auto", labels) == ["parm-s1", "parm-s2", "parm-s2-saa"]
    assert report.auto_peers("parm-s1", labels) == [] and report.auto_peers("deepspeed", labels) == []
    assert rows.needs_profile(RowSpec(name="parm-auto"))
    assert rows.needs_profile(RowSpec(name="baseline", options=(("r", "auto"),)))
    assert rows.needs_profile(RowSpec(name="baseline", options=(("r", "tune"),)))
    assert not rows.needs_profile(RowSpec(name="baseline", options=(("r", "4"),)))
    assert not rows.needs_profile(RowSpec(name="deepspeed"))


def test_auto_summary_counts_groups_within_five_percent():
    def group(times):
        raw = {label: {"kind": "plugin", "times_s": [t], "traffic_source": "ledger", "model_bytes_per_rank": [0] * 4,
                       "nic_tx_bytes_per_rank": [None] * 4, "max_abs_diff_vs_first": 0.0, "first_row_max_abs": 1.0,
                       "notes": []} for label, t in times.items()}
        return {"case": {}, "case_label": "c", "rate": "1gbit", "rows": raw, "skipped": {}}
    plan = BenchPlan(nodes=2, ranks_per_node=2, cases=(), rows=(), rates=("1gbit",))
    records = [group({"baseline": 1.0, "baseline@r=2": 0.8, "baseline@r=auto": 0.83}),     # 1.0375: within
               group({"baseline": 1.0, "baseline@r=2": 0.8, "baseline@r=auto": 0.85})]     # 1.0625: not
    summary = report.summarize(records, plan, {"title": "t", "header_lines": []})
    auto = summary["auto"]["baseline@r=auto"]
    assert (auto["groups"], auto["within"]) == (2, 1)
    assert auto["worst_ratio"] == pytest.approx(0.85 / 0.8)
    assert summary["groups"][0]["rows"]["baseline@r=auto"]["auto_vs_best"]["best"] == "baseline@r=2"
    assert "within 5% of the best fixed choice in 1 of 2 groups" in report.markdown(summary)


def test_auto_rows_are_also_judged_by_their_fixed_twin():
    """The twin's median judges the choice; the auto row against its twin is the same code timed twice."""
    def group(times, ran_as):
        raw = {label: {"kind": "plugin", "times_s": [t], "traffic_source": "ledger", "model_bytes_per_rank": [0] * 4,
                       "nic_tx_bytes_per_rank": [None] * 4, "max_abs_diff_vs_first": 0.0, "first_row_max_abs": 1.0,
                       "notes": [], "ran_as": ran_as if label == "parm-auto" else None} for label, t in times.items()}
        return {"case": {}, "case_label": "c", "rate": "1gbit", "rows": raw, "skipped": {}}
    plan = BenchPlan(nodes=2, ranks_per_node=2, cases=(), rows=(), rates=("1gbit",))
    records = [group({"parm-s1": 1.0, "parm-s2": 1.2, "parm-s2-saa": 1.1, "parm-auto": 1.1}, "parm-s1"),
               group({"parm-s1": 1.0, "parm-s2": 1.2, "parm-s2-saa": 1.04, "parm-auto": 1.0}, "parm-s2-saa"),
               group({"parm-s1": 1.0, "parm-s2": 1.2, "parm-s2-saa": 1.1, "parm-auto": 1.0}, None)]
    summary = report.summarize(records, plan, {"title": "t", "header_lines": []})
    first = summary["groups"][0]["rows"]["parm-auto"]["auto_vs_best"]
    assert first["twin"] == "parm-s1" and first["choice_ratio"] == pytest.approx(1.0)
    assert first["twin_ratio"] == pytest.approx(1.1)
    assert summary["groups"][2]["rows"]["parm-auto"]["auto_vs_best"]["twin"] is None
    auto = summary["auto"]["parm-auto"]
    assert (auto["groups"], auto["within"], auto["choice_judged"], auto["choice_within"]) == (3, 2, 2, 2)
    text = report.markdown(summary)
    assert "within 5% in 2 of the 2 groups where it ran a fixed row's configuration" in text
    assert "differed by more than 5% in 1 of 2" in text


def test_fixed_twin_names_the_row_an_auto_row_ran_as():
    auto_r = RowSpec(name="baseline", options=(("r", "auto"),))
    assert rows.fixed_twin(auto_r, {"baseline"}, {4}) == "baseline@r=4"
    assert rows.fixed_twin(auto_r, {"baseline"}, {1}) == "baseline"
    assert rows.fixed_twin(auto_r, {"baseline"}, {2, 4}) is None            # two degrees: no single twin
    tune_r = RowSpec(name="baseline", options=(("r", "tune"),))
    assert rows.fixed_twin(tune_r, {"baseline"}, {8}) == "baseline@r=8"
    parm = RowSpec(name="parm-auto")
    assert rows.fixed_twin(parm, {"parm-s2-saa"}, set()) == "parm-s2-saa"
    assert rows.fixed_twin(parm, {"parm-s2"}, set()) == "parm-s2"
    assert rows.fixed_twin(parm, {"parm-s1", "parm-s2-saa"}, set()) is None
    both = RowSpec(name="parm-auto", options=(("r", "auto"),))
    assert rows.fixed_twin(both, {"parm-s1"}, {2}) == "parm-s1@r=2"
    assert rows.fixed_twin(RowSpec(name="parm-s1"), {"parm-s1"}, set()) is None


def test_schedules_say_what_they_ran_as():
    from moe_plugins.parm.cost import ParmChoice
    from moe_plugins.plugins import default_registry
    cls = default_registry().schedule_class("parm-auto")
    auto = cls.__new__(cls)                      # the protocol reads decisions only, no groups needed
    auto.choices, auto.made = {}, set()
    assert auto.ran() == set() and auto.notes() == []
    auto.choices = {64: ParmChoice(x=1.0, T=1.0, y=1.0, t_baseline=None, t_s1=2e-3, t_s2=1e-3, s2_form="saa",
                                   choice="parm-s2", s1_slots=1.5, s1_source="observed")}
    auto.made = {"parm-s2-saa"}
    assert auto.ran() == {"parm-s2-saa"} and auto.notes()[0].startswith("parm-auto: parm-s2-saa for 64 tokens")
    assert "C_l 1.5 observed" in auto.notes()[0]
    auto.made = {"parm-s1", "parm-s2-saa"}            # it switched once it had seen S1's buffer: both ran
    assert auto.ran() == {"parm-s1", "parm-s2-saa"}
    base = default_registry().schedule_class("baseline").__new__(default_registry().schedule_class("baseline"))
    assert base.ran() == {"baseline"} and base.notes() == []


def test_bench_link_profile_covers_every_case_of_the_layout_from_small_messages_up():
    from moe_plugins.tools.bench.profiles import LINK_REPEATS, gemm_spec_for, link_spec_for
    from moe_plugins.core.layout import ParallelLayout
    small = CaseConfig(tokens=256, hidden=256, ffn=512, experts=8, k=2, capacity_factor=1.0, mp=2, ep=2, esp=2)
    big = CaseConfig(tokens=1024, hidden=256, ffn=512, experts=8, k=2, capacity_factor=1.0, mp=2, ep=2, esp=2)
    layout = ParallelLayout(world=4, ranks_per_node=2, mp=2, ep=2, esp=2)
    spec = link_spec_for([small, big], layout, [RowSpec(name="parm-auto")], "float32")
    a2a_bytes = 8 * 256 * 256 * 4 * 2              # the big case's E x C x M x 4 bytes, dumped to N_ESP = 2 shards
    assert min(spec.sizes_bytes) == 4096 and max(spec.sizes_bytes) >= 2 * a2a_bytes
    assert spec == link_spec_for([big, small], layout, [RowSpec(name="parm-auto")], "float32")   # order-free
    assert max(link_spec_for([small], layout, [RowSpec(name="parm-auto")], "float32").sizes_bytes) < 2 * a2a_bytes
    assert {"all_gather", "saa"} <= set(spec.ops) and "mp" in spec.groups and "gemm" not in spec.ops
    # Parm's terms and DeepSpeed's flow's (parm-auto's third candidate), and nothing else
    assert set(spec.keys) == {"all_to_all@ep", "all_to_all@ep_esp", "all_gather@mp", "all_gather@esp",
                              "all_reduce@esp"}
    assert spec.repeats == LINK_REPEATS and spec.check() is spec
    pipe = link_spec_for([big], layout, [RowSpec(name="baseline", options=(("r", "auto"),))], "float32")
    assert set(pipe.ops) == {"all_to_all", "all_to_all_stream", "chunk"} and "chunk" not in spec.ops
    gemm = gemm_spec_for(big, layout, "float32")
    assert gemm.ops == ("gemm",) and gemm.gemm_shape == (4, 256, 256) and max(gemm.gemm_rows) >= 2 * 256 * 4
    assert gemm.check() is gemm
    with pytest.raises(ValueError, match="at least one case"):
        link_spec_for([], layout, [RowSpec(name="parm-auto")], "float32")


def _profile(models, device="cpu", dtype="float32", source="s"):
    from moe_plugins.core.costmodel import CostProfile, LinearModel, Measurement, ProfileKey
    key = ProfileKey(world=2, ranks_per_node=1, mp=1, ep=2, esp=1, backend="gloo", device=device)
    return CostProfile(key=key, dtype=dtype, source=source,
                       models={k: LinearModel(alpha=a, beta=b, unit=u, r2=0.99) for k, (a, b, u) in models.items()},
                       measurements={k: Measurement(x=(1.0, 2.0), seconds=(a + b, a + 2 * b))
                                     for k, (a, b, u) in models.items()})


def test_merge_profiles_joins_the_link_and_gemm_parts_and_refuses_mismatches():
    from moe_plugins.tools.bench.profiles import merge_profiles
    link = _profile({"all_to_all@ep": (1e-4, 1e-9, "byte"), "chunk": (0.0, 5e-3, "chunk")}, source="link")
    gemm = _profile({"gemm": (1e-5, 3e-11, "mac")}, source="gemm")
    merged = merge_profiles(link, gemm)
    assert set(merged.models) == {"all_to_all@ep", "chunk", "gemm"} == set(merged.measurements)
    assert merged.models["gemm"] == gemm.models["gemm"] and merged.source == "link; gemm"
    with pytest.raises(ValueError, match=r"models in more than one part: chunk"):
        merge_profiles(link, _profile({"chunk": (0.0, 1e-3, "chunk")}))
    with pytest.raises(ValueError, match=r"keys differ.*dtypes differ"):
        merge_profiles(link, _profile({"gemm": (0.0, 1e-11, "mac")}, device="gpu", dtype="float64"))


def test_report_lists_a_shared_fit_once_and_counts_distinct_fits():
    from moe_plugins.tools.bench.report import _profile_lines
    link = {"all_to_all@ep": {"alpha": 1e-4, "beta": 3e-8, "r2": 0.99, "unit": "byte"},
            "all_to_all@ep_esp": {"alpha": 1e-4, "beta": 3e-8, "r2": 0.99, "unit": "byte"}}
    groups = [{"case_label": case, "rate": "1gbit",
               "profile": {**link, "gemm": {"alpha": 0.0, "beta": b, "r2": r2, "unit": "mac"}}}
              for case, b, r2 in (("A", 4e-11, 0.97), ("B", 5e-11, 0.91))]
    lines = _profile_lines({"groups": groups})
    assert "| 1gbit | all_to_all@ep = all_to_all@ep_esp | all 2 | 0.0001 | 3e-08 | 0.9900 |" in lines
    assert sum(line.startswith("| 1gbit | gemm |") for line in lines) == 2
    assert lines[-1] == "- R² over the 3 distinct fits: min 0.9100, median 0.9700; 2 of 3 at or above 0.95."


def test_round_order_is_a_seeded_permutation_that_varies_the_neighbours():
    from moe_plugins.tools.bench.runner import round_order
    labels = list("abcdef")
    orders = [round_order(labels, 7, i) for i in range(40)]
    assert all(sorted(o) == labels for o in orders)
    assert orders == [round_order(labels, 7, i) for i in range(40)]      # every rank derives the same order
    assert round_order(labels, 8, 0) != orders[0] or round_order(labels, 8, 1) != orders[1]
    # no row always follows the same row (a fixed rotation did)
    before_a = {o[o.index("a") - 1] for o in orders if o.index("a") > 0}
    assert len(before_a) >= 3, before_a


@pytest.mark.parametrize("stem", ["pipemoe-2x1-additive", "pipemoe-2x2-additive", "pipemoe-2x1-additive-b",
                                  "pipemoe-2x2-additive-b"])
def test_reprice_reproduces_the_committed_auto_choices(stem):
    """benchmarks/reprice.py re-plans a committed run of the current planner from the profiles in its JSON; its
    default (curve) pricing must land on the degree each auto row logged while the bench ran (same profile)."""
    import importlib.util
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("reprice", root / "benchmarks" / "reprice.py")
    reprice = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reprice)
    report = json.loads((root / "benchmarks" / "results" / f"{stem}.json").read_text())
    replanned = reprice.reprice(report)
    assert len(replanned) == 16
    for group, row in zip([g for g in report["groups"] if g.get("profile_measurements")], replanned):
        logged = next(re.search(r"auto degree: r=(\d+)", n) for n in group["rows"]["baseline@r=auto"]["notes"]
                      if "auto degree" in n)
        assert row["picks"]["curve"][0] == int(logged.group(1)), (row["case"], row["rate"])


def test_adapter_rows_are_profiled_like_the_schedule_they_swap_in():
    """``deepspeed@plugin=<schedule>``: the link profile and the per-rate rebuild follow the swapped-in schedule."""
    from moe_plugins.tools.bench.profiles import link_spec_for
    from moe_plugins.core.layout import ParallelLayout
    case = CaseConfig(tokens=256, hidden=64, ffn=128, experts=4, k=2, mp=2, ep=2, esp=2)
    layout = ParallelLayout(world=4, ranks_per_node=2, mp=2, ep=2, esp=2)
    auto, plain = matrix.parse_row("deepspeed@plugin=parm-auto"), matrix.parse_row("deepspeed@plugin=baseline")
    assert matrix.row_schedule(auto) == "parm-auto" and matrix.row_schedule(RowSpec(name="deepspeed")) == "deepspeed"
    assert link_spec_for([case], layout, [auto], "float32") == link_spec_for([case], layout,
                                                                              [RowSpec(name="parm-auto")], "float32")
    assert rows.needs_profile(auto) and not rows.needs_profile(plain)
    assert "chunk" in link_spec_for([case], layout, [matrix.parse_row("deepspeed@plugin=baseline,r=auto")],
                                    "float32").ops
    problems = matrix.plan_problems(BenchPlan(nodes=2, ranks_per_node=2, cases=(case,), rates=("unshaped",),
                                              rows=(plain, matrix.parse_row("deepspeed@plugin=parm-nope"))),
                                    rows.row_problems)
    assert problems == ["row ('deepspeed@plugin=parm-nope'): plugin ('parm-nope') is not a registered schedule; "
                        "allowed: " + ", ".join(rows.default_registry().schedule_names())]
