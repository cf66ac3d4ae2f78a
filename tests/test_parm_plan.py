"""``moe-plugins plan parm``: outputs, where the costs come from, and one-line errors."""

from __future__ import annotations

import json

import pytest

from moe_plugins.tools.cli import main
from moe_plugins.core.costmodel import CostProfile, LinearModel, ProfileKey, cache_path
from moe_plugins.parm.cost import ParmCosts, ParmShape, choose_schedule, sizes

BASE = ["plan", "parm", "--B", "4", "--L", "512", "--M", "1024", "--H", "4096", "--E", "8", "--k", "2",
        "--f", "1.2", "--mp", "2", "--ep", "2", "--esp", "2"]


def run(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def profile(mp=2, ep=2, esp=2, beta_ag=1e-10):
    key = ProfileKey(world=4, ranks_per_node=2, mp=mp, ep=ep, esp=esp, backend="gloo", device="cpu")
    models = {"all_to_all@ep_esp": (1e-4, 5e-10), "all_gather@mp": (2e-5, beta_ag), "saa@ep_esp+mp": (2e-4, 6e-10)}
    return CostProfile(key=key, dtype="float32", models={k: LinearModel(alpha=a, beta=b, unit="byte")
                                                         for k, (a, b) in models.items()})


def test_json_has_the_plan(capsys, tmp_path):
    code, out, _ = run(capsys, *BASE, "--cache-dir", str(tmp_path), "--json")
    assert code == 0
    plan = json.loads(out)
    s = sizes(ParmShape(B=4, L=512, M=1024, H=4096, E=8, k=2, f=1.2, mp=2, ep=2, esp=2))
    assert (plan["x"], plan["T"], plan["y"]) == (s.x, s.T, s.y)
    assert plan["choice"] == ("parm-s1" if plan["t_s1"] <= plan["t_s2"] else "parm-s2")
    assert plan["t_baseline"] > max(plan["t_s1"], plan["t_s2"])
    assert plan["costs_source"].startswith("default: placeholders measured on")
    assert plan["units"]["beta"] == "s/element" and plan["s2_form"] == "saa"


def test_flags_replace_terms(capsys, tmp_path):
    code, out, _ = run(capsys, *BASE, "--cache-dir", str(tmp_path), "--alpha-ag", "1.09e-4", "--beta-ag",
                       "7.14e-10", "--no-saa", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["costs"]["ag_mp"] == {"alpha": 1.09e-4, "beta": 7.14e-10}
    assert plan["costs_source"].startswith("flags (ag_mp) over default") and plan["s2_form"] == "sequential"
    # without SAA, S1 and S2 differ only in what MP gathers: x = B L M against E T M = k f x
    assert plan["choice"] == "parm-s1"


def test_profile_file_and_cache(capsys, tmp_path):
    path = profile().save(tmp_path / "mine.json")
    code, out, _ = run(capsys, *BASE, "--profile", str(path), "--json")
    plan = json.loads(out)
    assert code == 0 and plan["costs_source"] == f"profile {path}"
    assert plan["costs"]["a2a_ep_esp"] == {"alpha": 1e-4, "beta": pytest.approx(2e-9)}   # 5e-10 s/byte * 4 B
    cached = profile(beta_ag=3e-10)
    cached.save(cache_path(tmp_path / "cache", cached.key))
    code, out, _ = run(capsys, *BASE, "--cache-dir", str(tmp_path / "cache"), "--json")
    plan = json.loads(out)
    assert plan["costs_source"].startswith("cached profile ")
    assert plan["costs"]["ag_mp"]["beta"] == pytest.approx(1.2e-9)
    want = choose_schedule(ParmShape(B=4, L=512, M=1024, H=4096, E=8, k=2, f=1.2, mp=2, ep=2, esp=2),
                           ParmCosts.from_profile(cached, 4))
    assert plan["choice"] == want.choice and plan["t_s2"] == pytest.approx(want.t_s2)


def test_text_explains(capsys, tmp_path):
    code, out, _ = run(capsys, *BASE, "--cache-dir", str(tmp_path))
    assert code == 0 and out.startswith("Parm plan: parm-s")
    assert "x = B L M = 2.09715e+06 elements" in out and "costs from default" in out


def test_bad_input_is_one_line_listing_everything(capsys):
    code, _, err = run(capsys, "plan", "parm", "--B", "4", "--L", "512", "--M", "1024", "--H", "4095", "--E", "8",
                       "--k", "9", "--ep", "3", "--esp", "2", "--alpha-a2a", "1")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("moe-plugins plan: error:")
    for part in ("k (9) must not exceed E (8)", "E (8) must be divisible by ep (3)",
                 "H (4095) must be divisible by esp (2)", "--alpha-a2a and --beta-a2a must be given together"):
        assert part in lines[0]


def test_curve_pricing_and_observed_buffer_flags(capsys, tmp_path):
    from moe_plugins.core.costmodel import Measurement
    p = profile()
    kinked = Measurement(x=(4096.0, 1 << 20, 1 << 23), seconds=(1e-4, 5e-4, 2e-2))
    p = CostProfile(key=p.key, dtype=p.dtype, models=p.models, measurements={"all_to_all@ep_esp": kinked})
    path = p.save(tmp_path / "kinked.json")
    code, out, _ = run(capsys, *BASE, "--profile", str(path), "--json")
    plan = json.loads(out)
    assert code == 0 and list(plan["curves"]) == ["a2a_ep_esp"]
    assert plan["curves"]["a2a_ep_esp"]["x"] == [1024.0, 262144.0, 2097152.0]          # elements (fp32)
    want = choose_schedule(ParmShape(B=4, L=512, M=1024, H=4096, E=8, k=2, f=1.2, mp=2, ep=2, esp=2),
                           ParmCosts.from_profile(p, 4))
    assert plan["t_s1"] == pytest.approx(want.t_s1) and plan["s1_slots_source"] == "balanced"
    code, out, _ = run(capsys, *BASE, "--profile", str(path), "--exchange-pricing", "linear", "--s1-slots", "300",
                       "--json")
    plan = json.loads(out)
    assert plan["curves"] == {} and plan["s1_slots"] == 300 and plan["s1_slots_source"] == "observed"
    code, out, _ = run(capsys, *BASE, "--profile", str(path), "--alpha-a2a", "1e-4", "--beta-a2a", "1e-9")
    assert code == 0 and "Every op is priced by its line" in out          # a flag's line replaces the curve
    code, _, err = run(capsys, *BASE, "--s1-slots", "nan")
    assert code == 2 and "--s1-slots (nan) must be a finite number >= 0" in err
