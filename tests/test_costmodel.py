"""The shared cost-model layer, the profiler (synthetic fit and one tiny real run) and the plan/profile CLIs."""

import contextlib
import io
import json
import subprocess

import numpy as np
import pytest

from moe_plugins.core.costmodel import (CostProfile, ExchangeCurve, LinearModel, Measurement, PipeCosts, ProfileKey,
                                   cache_path, default_cache_dir, fit_linear, load_cached, model_key,
                                   model_problems, runner_chunk_terms)
from moe_plugins.tools.cli import main
from moe_plugins.core.layout import ParallelLayout
from moe_plugins.tools.profiler import ProfileSpec, plot_profile
from tests.workers.pipemoe import tiny_profile

KEY = ProfileKey(world=4, ranks_per_node=2, mp=1, ep=4, esp=1, backend="gloo", device="cpu")


def test_fit_recovers_known_alpha_beta_from_noisy_data():
    rng = np.random.default_rng(0)
    x = np.geomspace(1e4, 1e7, 12)
    alpha, beta = 3e-4, 2.5e-9
    t = (alpha + beta * x) * rng.normal(1.0, 0.02, x.size)
    fit = fit_linear(x, t, "byte")
    assert fit.alpha == pytest.approx(alpha, rel=0.15) and fit.beta == pytest.approx(beta, rel=0.03)
    assert fit.r2 > 0.99 and fit.samples == 12 and not fit.alpha_clamped
    exact = fit_linear([1, 2, 3], [1.5, 2.5, 3.5], "mac")
    assert (exact.alpha, exact.beta, exact.r2) == pytest.approx((0.5, 1.0, 1.0))


def test_negative_intercept_is_refitted_through_zero_and_flagged():
    x, t = np.array([1e3, 2e3, 4e3]), np.array([0.5e-3, 1.5e-3, 3.5e-3])
    fit = fit_linear(x, t, "byte")
    assert fit.alpha_clamped and not fit.beta_clamped and fit.alpha == 0.0
    assert fit.beta == pytest.approx(float(x @ t / (x @ x)), rel=1e-9)   # least squares through the origin


def test_negative_slope_is_pinned_at_zero_and_flagged():
    """Flat, noisy small-message timings (CI's failure: a2a beta -1.3e-9) must still give a usable model."""
    t = [2.0e-3, 1.9e-3, 1.95e-3, 1.85e-3]
    fit = fit_linear([4096, 8192, 16384, 32768], t, "byte")
    assert fit.beta_clamped and not fit.alpha_clamped and fit.beta == 0.0
    assert fit.alpha == pytest.approx(float(np.mean(t)), rel=1e-9)
    assert not model_problems("all_to_all@ep", fit)


def test_fit_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"need at least 2 distinct sizes \(got \[5.0\]\)"):
        fit_linear([5, 5], [1, 2], "byte")
    with pytest.raises(ValueError, match="must be 1-D of equal length"):
        fit_linear([1, 2, 3], [1, 2], "byte")


def test_profile_json_roundtrip_cache_and_lookup(tmp_path):
    prof = CostProfile(key=KEY, dtype="float32", source="test",
                       models={"gemm": LinearModel(alpha=1e-4, beta=1e-11, unit="mac", r2=0.99, samples=4),
                               "all_to_all@ep": LinearModel(alpha=2e-3, beta=3e-9, unit="byte", r2=0.98, samples=5)},
                       measurements={"gemm": Measurement(x=(1.0, 2.0), seconds=(0.1, 0.2))})
    path = prof.save(cache_path(tmp_path, KEY))
    assert path.name == "profile-w4-n2-mp1-ep4-esp1-gloo-cpu.json"
    assert load_cached(tmp_path, KEY) == prof and CostProfile.from_json(prof.to_json()) == prof
    assert load_cached(tmp_path, ProfileKey(**{**KEY.__dict__, "ep": 2})) is None
    costs = PipeCosts.from_profile(prof)
    assert (costs.alpha_a, costs.beta_a, costs.alpha_e, costs.beta_e) == (2e-3, 3e-9, 2e-4, 2e-11)
    with pytest.raises(ValueError, match=r"has no model for 'all_gather@mp'; it has: all_to_all@ep, gemm"):
        prof.model("all_gather", "mp")
    with pytest.raises(ValueError, match="op 'gemm' takes no group"):
        model_key("gemm", "ep")


def test_a_profile_with_wrongly_typed_numbers_is_refused_at_load(tmp_path):
    """A hand-edited profile whose terms are strings, booleans or negative is refused when read, naming each
    field, not when a planner later does arithmetic with it."""
    good = CostProfile(key=KEY, dtype="float32", source="test",
                       models={"all_to_all@ep": LinearModel(alpha=2e-3, beta=3e-9, unit="byte", r2=0.98, samples=5)},
                       measurements={"all_to_all@ep": Measurement(x=(1.0, 2.0), seconds=(0.1, 0.2))})
    raw = json.loads(good.to_json())
    raw["models"]["all_to_all@ep"].update(alpha="2e-3", beta=-1.0)
    raw["measurements"]["all_to_all@ep"]["seconds"] = [0.1, True]
    path = cache_path(tmp_path, KEY)
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError) as err:
        load_cached(tmp_path, KEY)
    text = str(err.value)
    assert str(path) in text and "models[all_to_all@ep].alpha ('2e-3') must be a finite number >= 0" in text
    assert "models[all_to_all@ep].beta (-1.0)" in text and "measurements[all_to_all@ep]" in text


def test_exchange_curve_is_the_isotonic_fit_of_the_medians():
    # a noisy dip (2 MiB faster than 1 MiB) is pooled; sizes arrive unsorted, as a re-fit might pass them
    m = Measurement(x=(4096.0, 2097152.0, 1048576.0, 4194304.0), seconds=(1e-3, 40e-3, 50e-3, 170e-3))
    curve = ExchangeCurve.fit(m, beta_tail=5e-8)
    assert curve.x == (4096.0, 1048576.0, 2097152.0, 4194304.0)
    assert curve.seconds == pytest.approx((1e-3, 45e-3, 45e-3, 170e-3))
    assert curve.time(0) == pytest.approx(1e-3)                                  # floor: the smallest size
    assert curve.time(3145728.0) == pytest.approx((45e-3 + 170e-3) / 2)          # linear between sizes
    assert curve.time(8388608.0) == pytest.approx(170e-3 + 5e-8 * 4194304)      # the line's slope past the end
    assert not curve.problems()
    # a size measured twice enters as its mean (weighted by its count), not as its first reading
    twice = ExchangeCurve.fit(Measurement(x=(1.0, 1.0, 2.0), seconds=(1.0, 3.0, 4.0)), beta_tail=0.0)
    assert twice.x == (1.0, 2.0) and twice.seconds == pytest.approx((2.0, 4.0))


def test_exchange_curve_problems_name_the_field():
    bad = ExchangeCurve(x=(2.0, 1.0), seconds=(1.0, 2.0), beta_tail=float("nan"))
    assert bad.problems() == ["exchange_curve sizes ([2.0, 1.0]) must be increasing and >= 0",
                              "exchange_curve beta_tail (nan) must be a finite number >= 0"]
    falling = PipeCosts(alpha_a=0, beta_a=0, alpha_e=0, beta_e=0,
                        exchange_curve=ExchangeCurve(x=(1.0, 2.0), seconds=(2.0, 1.0), beta_tail=0.0))
    with pytest.raises(ValueError, match=r"exchange_curve times \(\[2.0, 1.0\]\) must be non-decreasing"):
        falling.check()


def test_pipe_costs_price_exchanges_from_the_profiles_curve():
    a2a = Measurement(x=(1e4, 1e5, 1e6), seconds=(1e-3, 2e-3, 30e-3))
    prof = CostProfile(key=KEY, dtype="float32",
                       models={"gemm": LinearModel(alpha=1e-4, beta=1e-11, unit="mac"),
                               "all_to_all@ep": fit_linear(a2a.x, a2a.seconds, "byte")},
                       measurements={"all_to_all@ep": a2a})
    curved, line = PipeCosts.from_profile(prof), PipeCosts.from_profile(prof, pricing="linear")
    assert line.exchange_curve is None and line.exchange_time(1e5) == pytest.approx(line.alpha_a + line.beta_a * 1e5)
    assert curved.exchange_curve.x == a2a.x and curved.exchange_time(1e5) == pytest.approx(2e-3)
    assert curved.exchange_curve.beta_tail == pytest.approx(curved.beta_a)
    with pytest.raises(ValueError, match=r"pricing \('cubic'\) must be one of curve, linear"):
        PipeCosts.from_profile(prof, pricing="cubic")
    # a profile without the measurements (e.g. written by hand) plans with the line
    bare = CostProfile(key=KEY, dtype="float32", models=prof.models)
    assert PipeCosts.from_profile(bare).exchange_curve is None


def test_runner_points_split_into_a_per_chunk_line_and_the_step_of_pipelining():
    r_N = np.array([1.0, 2.0, 3.0, 4.0, 6.0, 8.0])
    t_N = np.where(r_N == 1, 5e-3, 12e-3 + 4e-3 * r_N)      # sequential 5 ms; pipelined 12 ms + 4 ms per chunk
    line, step = runner_chunk_terms(Measurement(x=tuple(r_N), seconds=tuple(t_N)))
    assert line.beta == pytest.approx(4e-3) and line.alpha == pytest.approx(12e-3) and line.samples == 5
    assert step == pytest.approx(12e-3 + 4e-3 - 5e-3) and line.r2 == pytest.approx(1.0)
    # a sequential time above the pipelined line is no step; without a degree-1 point there is none either
    assert runner_chunk_terms(Measurement(x=(1.0, 2.0, 4.0), seconds=(30e-3, 20e-3, 28e-3)))[1] == 0.0
    assert runner_chunk_terms(Measurement(x=(2.0, 4.0), seconds=(20e-3, 28e-3)))[1] == 0.0
    gemm = LinearModel(alpha=1e-4, beta=1e-11, unit="mac")
    a2a = LinearModel(alpha=1e-4, beta=1e-9, unit="byte")
    points = Measurement(x=tuple(r_N), seconds=tuple(t_N))
    prof = CostProfile(key=KEY, dtype="float32", models={"gemm": gemm, "all_to_all@ep": a2a, "chunk": line},
                       measurements={"chunk": points})
    costs = PipeCosts.from_profile(prof)
    # the runner's start-up per chunk comes on top of the GEMMs' own (2 alpha_gemm per e)
    assert costs.pipeline_step == pytest.approx(11e-3) and costs.alpha_e == pytest.approx(2e-4 + 4e-3 / 3)
    # a hand-written profile with the chunk model but no points: the slope alone, no step
    bare = PipeCosts.from_profile(CostProfile(key=KEY, dtype="float32", models=prof.models))
    assert bare.pipeline_step == 0.0 and bare.alpha_e == pytest.approx(2e-4 + 4e-3 / 3)
    with pytest.raises(ValueError, match=r"pipeline_step \(-1\.0\) must be a finite number >= 0"):
        PipeCosts(alpha_a=0, beta_a=0, alpha_e=0, beta_e=0, pipeline_step=-1.0).check()


def test_back_to_back_exchanges_price_every_pipelined_chunk_but_the_first():
    from moe_plugins.pipemoe.model import chunk_costs, moe_time, pipeline_time
    from moe_plugins.tools.profiler import STREAM_MAX, stream_count
    assert stream_count(4 << 20) == 1 and stream_count(1 << 20) == 4 and stream_count(3 << 20) == 2
    assert stream_count(1) == STREAM_MAX and stream_count(64 << 20) == 1
    lone = Measurement(x=(1e4, 1e5, 1e6), seconds=(0.2e-3, 0.5e-3, 20e-3))     # a banked burst: small is cheap
    stream = Measurement(x=(1e4, 1e5, 1e6), seconds=(0.5e-3, 2.5e-3, 21e-3))
    models = {"gemm": LinearModel(alpha=1e-4, beta=1e-11, unit="mac"),
              "all_to_all@ep": fit_linear(lone.x, lone.seconds, "byte"),
              "all_to_all_stream@ep": fit_linear(stream.x, stream.seconds, "byte")}
    prof = CostProfile(key=KEY, dtype="float32", models=models,
                       measurements={"all_to_all@ep": lone, "all_to_all_stream@ep": stream})
    costs = PipeCosts.from_profile(prof)
    assert costs.stream_time(1e5) == pytest.approx(2.5e-3) and costs.exchange_time(1e5) == pytest.approx(0.5e-3)
    assert PipeCosts.from_profile(prof, pricing="linear").stream_curve is None
    n_d, n_e = 4e5, 1e8
    e = costs.alpha_e + costs.beta_e * n_e / 4
    first, d = costs.exchange_time(n_d / 4), costs.stream_time(n_d / 4)
    assert moe_time(costs, n_d, n_e, 4) == pytest.approx(pipeline_time([first] + [d] * 3, [e] * 4, [d] * 4))
    assert chunk_costs(costs, n_d, n_e, 4)[0] == d and chunk_costs(costs, n_d, n_e, 1)[0] == costs.exchange_time(n_d)
    whole = costs.exchange_time(n_d)
    assert moe_time(costs, n_d, n_e, 1) == pytest.approx(2 * whole + costs.alpha_e + costs.beta_e * n_e)
    # without the stream curve every chunk is priced as a lone exchange, which makes chunks look cheaper
    lone_only = PipeCosts.from_profile(CostProfile(key=KEY, dtype="float32", models=models,
                                                   measurements={"all_to_all@ep": lone}))
    assert lone_only.stream_curve is None and moe_time(lone_only, n_d, n_e, 4) < moe_time(costs, n_d, n_e, 4)


def test_default_cache_dir_is_resolved_from_what_the_cli_passes():
    assert str(default_cache_dir({"MOE_PLUGINS_CACHE": "/x/y"})) == "/x/y"
    assert str(default_cache_dir({"XDG_CACHE_HOME": "/c"})) == "/c/moe_plugins"


def test_profile_spec_reports_every_problem():
    layout = ParallelLayout(world=2, ranks_per_node=2, ep=2)
    with pytest.raises(ValueError, match=r"dtype \('int8'\).*repeats \(0\) must be >= 1.*sizes_bytes \(\[4\]\)"):
        ProfileSpec(layout=layout, dtype="int8", repeats=0, sizes_bytes=(4,)).check()


def test_tiny_real_profile_on_two_ranks(world, tmp_path):
    layout = ParallelLayout(world=2, ranks_per_node=2, ep=2)
    spec = ProfileSpec(layout=layout, sizes_bytes=(1 << 16, 1 << 18, 1 << 20), gemm_rows=(16, 64, 256),
                       gemm_shape=(2, 64, 128), ops=("gemm", "all_to_all", "all_to_all_stream", "all_reduce",
                                                      "chunk"),
                       groups=("ep", "ep_esp"), warmup=1, repeats=3)
    prof, other = world(2).run(tiny_profile, spec)
    assert other is None and prof.key.slug() == "w2-n2-mp1-ep2-esp1-gloo-cpu"
    # ep_esp holds the same ranks as ep here: measured once, stored under both keys
    assert set(prof.models) == {"gemm", "all_to_all@ep", "all_to_all@ep_esp", "all_to_all_stream@ep",
                                "all_to_all_stream@ep_esp", "all_reduce@ep", "all_reduce@ep_esp", "chunk"}
    # back to back: the same sizes, one exchange's share of a run of stream_count(x) of them
    assert prof.measurements["all_to_all_stream@ep"].x == prof.measurements["all_to_all@ep"].x
    assert PipeCosts.from_profile(prof).stream_curve is not None
    # the runner's cost per chunk: x = degree; one more chunk is more collectives and hand-offs, never free
    assert prof.measurements["chunk"].x == (1.0, 2.0, 3.0, 4.0, 6.0, 8.0) and prof.models["chunk"].beta > 0
    costs = PipeCosts.from_profile(prof)
    assert costs.alpha_e == pytest.approx(2 * prof.models["gemm"].alpha + prof.models["chunk"].beta / 3)
    assert costs.pipeline_step >= 0
    assert prof.measurements["all_to_all@ep"] == prof.measurements["all_to_all@ep_esp"]
    for key, model in prof.models.items():
        m = prof.measurements[key]
        assert len(m.x) == len(m.seconds) == (6 if key == "chunk" else 3)
        assert model.samples == (5 if key == "chunk" else 3)      # the chunk line is fitted to r >= 2
        assert all(t > 0 for t in m.seconds)
        assert model.r2 is not None and model.r2 <= 1.0
    assert prof.measurements["all_to_all@ep"].x == (65536.0, 262144.0, 1048576.0)
    assert prof.measurements["gemm"].x == tuple(float(2 * r * 64 * 128) for r in (16, 64, 256))
    plot_profile(prof, tmp_path / "fit.png")
    assert (tmp_path / "fit.png").stat().st_size > 10_000


def test_profile_measures_only_the_keys_asked_for(world):
    """``keys`` keeps the cross product of ops and groups to the collectives a planner reads (the bench's
    link part: Parm's and DeepSpeed's flow's); a group holding the same ranks as one measured is aliased."""
    layout = ParallelLayout(world=4, ranks_per_node=2, mp=2, ep=2, esp=2)
    with pytest.raises(ValueError, match=r"keys \(\['all_gather@nowhere'\]\) are unknown"):
        ProfileSpec(layout=layout, keys=("all_gather@nowhere",)).check()
    spec = ProfileSpec(layout=layout, sizes_bytes=(1 << 14, 1 << 16), ops=("all_gather", "all_reduce"),
                       groups=("ep", "mp", "esp"), warmup=1, repeats=2,
                       keys=("all_gather@mp", "all_gather@esp", "all_reduce@esp"))
    prof = world(4).run(tiny_profile, spec)[0]
    assert set(prof.models) == {"all_gather@mp", "all_gather@esp", "all_reduce@esp"}
    assert prof.measurements["all_gather@esp"] == prof.measurements["all_gather@mp"]     # esp == mp: aliased


def test_profile_times_the_layers_saa(world):
    """The SAA term is measured on the layer's own slice-by-slice SAA (p2p all-to-all, per-block all-gather
    on MP) over sizes rounded to whole rows of its w (G x 1 x 1 x c x 64) tensor."""
    layout = ParallelLayout(world=4, ranks_per_node=2, mp=2, ep=2, esp=1)
    spec = ProfileSpec(layout=layout, sizes_bytes=(1 << 14, 1 << 18, 1 << 20), ops=("saa",),
                       groups=("ep_esp", "mp"), warmup=1, repeats=3)
    prof = world(4).run(tiny_profile, spec)[0]
    saa = prof.measurements["saa@ep_esp+mp"]
    assert set(prof.models) == {"saa@ep_esp+mp"} and saa.x == (16384.0, 262144.0, 1048576.0)
    assert all(t > 0 for t in saa.seconds) and prof.models["saa@ep_esp+mp"].samples == 3


# ---- the CLIs ------------------------------------------------------------------------------------------------

def run_cli(*args):
    """The console script in this process (what `moe-plugins ...` runs), output captured."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


LAYER = ["--B", "4", "--L", "1024", "--M", "2048", "--H", "4096", "--E", "16", "--k", "2", "--P", "8"]


def test_plan_pipemoe_json_with_manual_costs():
    proc = run_cli("plan", "pipemoe", *LAYER, "--alpha-a", "1.5e-3", "--beta-a", "2.5e-9", "--alpha-e", "4e-4",
                   "--beta-e", "3e-11", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["costs_source"] == "flags" and out["capacity"] == 512
    assert out["n_d"] == 16 * 512 * 2048 * 4 and out["n_e"] == 16 * 512 * 2048 * 4096
    best = min(out["curve"], key=lambda rt: rt[1])
    tol = out["inputs"]["tie_tolerance"]
    assert tol == 0.01 and best[0] > 6          # this curve is flat near its optimum, so the rule matters
    first_tied = next(rt for rt in out["curve"] if rt[1] <= (1 + tol) * best[1])
    assert out["degree"] == first_tied[0] < best[0] and out["predicted_time_s"] == pytest.approx(first_tied[1])
    exact = json.loads(run_cli("plan", "pipemoe", *LAYER, "--alpha-a", "1.5e-3", "--beta-a", "2.5e-9", "--alpha-e",
                               "4e-4", "--beta-e", "3e-11", "--json", "--tie-tolerance", "0").stdout)
    assert exact["degree"] == best[0] and exact["predicted_time_s"] == pytest.approx(best[1])
    assert out["degree"] in [c["r"] for c in out["candidates"]] and out["units"]["beta_a"] == "s/byte"


def test_plan_pipemoe_text_uses_paper_default_without_profile(tmp_path):
    proc = run_cli("plan", "pipemoe", *LAYER, "--cache-dir", str(tmp_path), "--objective", "forward")
    assert proc.returncode == 0, proc.stderr
    assert "PipeMoE plan: pipeline degree r = " in proc.stdout
    assert "default: PipeMoE paper's 16-GPU testbed" in proc.stdout and "<- chosen" in proc.stdout


def test_plan_pipemoe_reads_a_profile_file(tmp_path):
    prof = CostProfile(key=KEY, dtype="float32", models={
        "gemm": LinearModel(alpha=2e-4, beta=1.5e-11, unit="mac"),
        "all_to_all@ep": LinearModel(alpha=1.5e-3, beta=2.5e-9, unit="byte")})
    path = prof.save(tmp_path / "p.json")
    proc = run_cli("plan", "pipemoe", *LAYER, "--profile", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["costs_source"] == f"profile {path}" and out["costs"]["alpha_e"] == pytest.approx(4e-4)


def test_plan_pipemoe_prices_exchanges_from_a_profiles_curve(tmp_path):
    # LAYER sends n_d = 64 MiB per dispatch; past 8 MiB this link's exchange costs 3x per byte
    sizes = tuple(float(1 << p) for p in range(16, 28))
    a2a = Measurement(x=sizes, seconds=tuple(1e-3 + 1e-9 * x + (2e-9 * (x - (8 << 20)) if x > 8 << 20 else 0)
                                             for x in sizes))
    prof = CostProfile(key=KEY, dtype="float32", measurements={"all_to_all@ep": a2a}, models={
        "gemm": LinearModel(alpha=2e-4, beta=1.5e-11, unit="mac"),
        "all_to_all@ep": fit_linear(a2a.x, a2a.seconds, "byte")})
    path = prof.save(tmp_path / "p.json")
    curved = json.loads(run_cli("plan", "pipemoe", *LAYER, "--profile", str(path), "--json").stdout)
    line = json.loads(run_cli("plan", "pipemoe", *LAYER, "--profile", str(path), "--json",
                              "--exchange-pricing", "linear").stdout)
    assert line["exchange_curve"] is None and curved["exchange_curve"]["x"] == list(sizes)
    for out in (curved, line):      # the fewest chunks within the tie tolerance of the printed T(r) minimum
        best = min(t for _, t in out["curve"])
        assert out["degree"] == next(r for r, t in out["curve"] if t <= (1 + out["inputs"]["tie_tolerance"]) * best)
    # r = 1, forward + backward = 4 exchanges + 3 expert forwards, the exchange read off the measured curve
    d = 1e-3 + 1e-9 * curved["n_d"] + 2e-9 * (curved["n_d"] - (8 << 20))
    e = 4e-4 + 3e-11 * curved["n_e"]
    assert curved["curve"][0][1] == pytest.approx(4 * d + 3 * e, rel=1e-9)
    assert line["curve"][0][1] != pytest.approx(4 * d + 3 * e, rel=1e-3)     # the line prices it otherwise
    text = run_cli("plan", "pipemoe", *LAYER, "--profile", str(path)).stdout
    assert "exchanges priced from the measured all-to-all curve" in text and "every r timed" in text


@pytest.mark.parametrize("args, message", [
    (["--alpha-a", "1e-3"], "the manual costs need all four flags; missing: --beta-a, --alpha-e, --beta-e"),
    (["--alpha-a", "1e-3", "--beta-a", "1", "--alpha-e", "1", "--beta-e", "-1"], "beta_e (-1.0) must be"),
    (["--profile", "x.json", "--alpha-a", "1"], "give either --alpha-a/--beta-a/--alpha-e/--beta-e or --profile"),
    (["--alpha-a", "1e-3", "--beta-a", "1e-9", "--alpha-e", "1e-4", "--beta-e", "1e-11", "--tie-tolerance", "1.5"],
     "tie_tolerance (1.5) must be a number in [0, 1)"),
])
def test_plan_pipemoe_bad_costs_are_one_line_errors(args, message):
    proc = run_cli("plan", "pipemoe", *LAYER, *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("moe-plugins plan: error:")


def test_profile_cli_bad_flags():
    proc = run_cli("profile", "--world", "4", "--esp", "3", "--points", "1")
    assert proc.returncode == 2
    assert "world (4) must be divisible by ep*esp" in proc.stderr and "--points (1) must be >= 2" in proc.stderr
