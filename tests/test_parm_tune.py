"""parm-tune: Algorithm 1's pick checked by timing the layer. Pure choice helpers, the shared Search on a
mocked (size-1) mesh, and the schedule on 4 gloo ranks (exact against parm-s1 at every call, fp64, drops)."""

from types import SimpleNamespace

import pytest
import torch

from moe_plugins.parm.tune import candidates, fastest, first_unmeasured, model_pick
from moe_plugins.core.tuning import Search
from moe_plugins.tools.verify import VerifySpec
from tests.workers import parm as jobs

ONE = SimpleNamespace(size=1)
MOCK_GROUPS = SimpleNamespace(ep_esp=ONE, mp=ONE)      # agree_seconds is a no-op on groups of one rank


def test_model_pick_and_candidates():
    assert model_pick("parm-s2", "saa") == "parm-s2-saa" and model_pick("parm-s2", "sequential") == "parm-s2"
    assert model_pick("parm-s1", "saa") == "parm-s1"
    assert candidates("parm-s2-saa", mp=2) == ("parm-s2-saa", "parm-s1", "parm-s2")
    assert candidates("parm-s1", mp=2, tp=True) == ("parm-s1", "parm-s2", "parm-s2-saa", "baseline-tp")
    assert candidates("baseline-tp", mp=2, tp=True) == ("baseline-tp", "parm-s1", "parm-s2", "parm-s2-saa")
    assert candidates("parm-s1", mp=1) == ("parm-s1",)
    assert first_unmeasured(("b", "a"), {"b": 1.0}) == "a" and first_unmeasured(("a",), {"a": 1.0}) is None


def test_fastest_prefers_the_model_within_the_tolerance():
    times = {"parm-s1": 1.005, "parm-s2": 1.0, "parm-s2-saa": 1.2}
    assert fastest("parm-s1", times) == "parm-s1"               # 0.5% slower: a tie, the model's pick stays
    assert fastest("parm-s2-saa", times) == "parm-s2"
    assert fastest("parm-s1", times, tie_tolerance=0.0) == "parm-s2"


def test_search_times_each_candidate_then_decides():
    """warmup untimed calls, then timed ones whose clocks run from the call to wrap_output; the next
    candidate starts only when every timed call of the last one is clocked; the pick is made once."""
    order = ("a", "b")
    search = Search(start="a", propose=lambda t: first_unmeasured(order, t), pick=lambda t: min(t, key=t.get),
                    warmup=1, timed=2)
    cpu, ran = torch.device("cpu"), []
    for _ in range(7):
        cand, sample = search.call(MOCK_GROUPS, cpu, backward=False)
        ran.append((cand, sample is not None))
        if sample is not None:
            sample.wrap_output(torch.zeros(1))
    assert ran[:6] == [("a", False), ("a", True), ("a", True), ("b", False), ("b", True), ("b", True)]
    assert set(search.times_s) == {"a", "b"} and search.decided == min(search.times_s, key=search.times_s.get)
    assert ran[6] == (search.decided, False)          # then the measured pick runs, untimed
    assert "model's pick a" in search.describe() and f"chose {search.decided}" in search.describe()


def test_search_waits_for_pending_backward():
    """A timed call whose backward has not run yet (1F1B pipelines) holds the probe: the next call repeats
    the candidate, untimed."""
    search = Search(start=2, propose=lambda t: None if t else 2, pick=lambda t: 2, warmup=0, timed=1)
    cand, sample = search.call(MOCK_GROUPS, torch.device("cpu"), backward=True)
    x = torch.ones(2, requires_grad=True)
    y = sample.wrap_output(sample.wrap_input(x) * 3)
    assert search.call(MOCK_GROUPS, torch.device("cpu"), backward=True) == (2, None) and search.decided is None
    y.sum().backward()
    assert sample.complete() and sample.seconds() >= 0
    assert search.call(MOCK_GROUPS, torch.device("cpu"), backward=True) == (2, None) and search.decided == 2


@pytest.mark.parametrize("degree", [1, 2])
def test_parm_tune_is_exact_at_every_call(world, degree):
    """Every call (whichever candidate it ran, pipelined or not) equals parm-s1 in fp64 with drops: outputs,
    input gradients, aux loss and dropped routes. Ranks run the same candidates in the same order: the
    model's pick, then the others (DeepSpeed's flow among them: esp = mp), 1 untimed + 3 timed calls each,
    then the fastest."""
    spec = VerifySpec(world=4, ranks_per_node=2, k=2, tokens=16, schedule="parm-tune", mp=2, ep=2, esp=2)
    res = world(4).run(jobs.tuned_parm, spec, degree, 18)
    first = res[0]
    assert all(r["ran"] == first["ran"] and r["times"] == first["times"] for r in res)
    assert max(r["max_diff"] for r in res) <= 1e-12
    order = candidates(first["start"], mp=2, tp=True)
    assert len(order) == 4 and first["ran"][:16] == [c for c in order for _ in range(4)]
    assert first["decided"] == fastest(first["start"], first["times"]) and set(first["ran"][16:]) == {first["decided"]}
    assert any(f"chose {first['decided']}" in n for n in first["notes"])


def test_a_single_candidate_is_not_timed():
    """N_MP = 1 (parm-tune) or r_max = 1 (pipeline_degree "tune"): the search starts decided."""
    search = Search(start="parm-s1", propose=lambda t: None, pick=lambda t: "never", warmup=1, timed=3,
                    decided="parm-s1")
    assert [search.call(MOCK_GROUPS, torch.device("cpu"), backward=True) for _ in range(3)] == [("parm-s1", None)] * 3
    assert search.times_s == {}
