"""Generated equivalence (issue #28, item 4): hypothesis draws MoE layer configurations, and each one is
checked against the single-process fp64 reference the way ``moe-plugins verify`` checks it (outputs, input
gradients, gate and expert weight gradients, aux loss, routing counts and dropped tokens, within
``TOLERANCE["float64"]``).

What is drawn, per configuration: the layout (ranks per node, MP, EP, ESP of the world), the schedule (an
equal share for every one registered in ``default_registry()`` and valid on the world, parm-auto, parm-tune
and hecate included), the exchange (padded or ragged, where the schedule runs it), experts, top-k, FFN width, hidden size, token count, capacity factor, min capacity, drop
or dropless, gate skew (forces drops and idle experts), the data seed, a cost profile (none, or one of the
synthetic flavours below, written to a temporary cache dir) and the pipeline degree (1, 2, 3, or a
registered word, "auto" / "tune", which reads the profile). Each value is drawn among those the project's own
validation (``spec_problems``) accepts; :func:`draw_specs` says how the draw is laid out.

Size: ``MOE_PLUGINS_GENERATED=ci`` (the default: at least 200 configurations on world 4) or ``nightly``
(1500 on world 4 and 500 on world 8), read once, here. A world's configurations run in a few jobs on one
pool of gloo ranks. The test prints the seed and a count of every drawn dimension.

Replay: ``GEN_SEED=<the printed seed>`` (with the same ``MOE_PLUGINS_GENERATED``) draws the same
configurations again (hypothesis's ``@seed``). A failing configuration is reported with the
``moe-plugins verify ...`` line that re-runs it alone; its ``--cache-dir`` is this run's synthetic profiles
under pytest's temporary directory (:func:`write_profiles` writes them again).
"""
from __future__ import annotations

import os
import random
import shlex
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings, strategies as st

from moe_plugins.core.costmodel import CostProfile, LinearModel, cache_path
from moe_plugins.plugins import default_registry
from moe_plugins.tools.cli import build_parser
from moe_plugins.tools.cli.verify_cmd import spec_from_args, verify_command
from moe_plugins.tools.pool import WorkerError, WorkerPool
from moe_plugins.tools.verify import TOLERANCE, VerifySpec, spec_problems
from tests.workers.generated import verify_batch


@dataclass(frozen=True)
class GenProfile:
    name: str
    configs: Dict[int, int]     # world -> configurations drawn on it
    batch: int                  # specs per pool job


PROFILES = {"ci": GenProfile("ci", {4: 200}, batch=50),
            "nightly": GenProfile("nightly", {4: 1500, 8: 500}, batch=100)}


def _profile_from_env() -> GenProfile:
    name = os.environ.get("MOE_PLUGINS_GENERATED", "ci")
    if name not in PROFILES:
        raise ValueError(f"MOE_PLUGINS_GENERATED ({name!r}) must be one of {', '.join(PROFILES)}")
    return PROFILES[name]


def _seed_from_env() -> int:
    text = os.environ.get("GEN_SEED")
    return int(text) if text else random.SystemRandom().randrange(2 ** 32)


PROFILE, GEN_SEED = _profile_from_env(), _seed_from_env()      # the module boundary: read nowhere else
REPLAY = f"GEN_SEED={GEN_SEED} MOE_PLUGINS_GENERATED={PROFILE.name} pytest tests/test_generated.py"
REGISTRY = default_registry()
DIVISORS = {4: (1, 2, 4), 8: (1, 2, 4, 8)}

# Synthetic cost profiles (seconds; x in bytes or multiply-adds), one per flavour and layout. "lean": start-up
# terms near 0, so PipeMoE's model pipelines; "startup": start-up terms dominate, so it keeps r = 1; the two
# price the MP all-gather against the all-to-all differently, so parm-auto's choice differs too.
FLAVOURS: Dict[str, Dict[str, Tuple[float, float]]] = {
    "lean": {"all_to_all": (1e-9, 1e-8), "all_gather": (1e-9, 1e-9), "gemm": (1e-9, 1e-9)},
    "startup": {"all_to_all": (1e-3, 1e-9), "all_gather": (1e-3, 1e-7), "gemm": (1e-6, 1e-10)},
}
MODEL_KEYS = {"all_to_all@ep": "all_to_all", "all_to_all@ep_esp": "all_to_all", "saa@ep_esp+mp": "all_to_all",
              "all_gather@mp": "all_gather", "all_gather@esp": "all_gather", "all_reduce@esp": "all_gather",
              "gemm": "gemm"}


EXCHANGES = ("padded", "ragged")


def valid_layouts(world: int, schedule: str = "baseline") -> List[Tuple[int, int, int, int]]:
    """(ranks_per_node, mp, ep, esp) the project accepts for ``schedule`` on ``world`` with some exchange
    (with enough experts for any EP)."""
    ds = DIVISORS[world]
    return [(rpn, mp, ep, esp) for rpn in ds for mp in ds for ep in ds for esp in ds
            if any(not spec_problems(VerifySpec(world=world, ranks_per_node=rpn, mp=mp, ep=ep, esp=esp,
                                                experts=world, schedule=schedule, exchange=exchange), REGISTRY)
                   for exchange in EXCHANGES)]


def write_profiles(root: Path, worlds: Iterable[int]) -> Dict[str, str]:
    """Each flavour's cache dir under ``root``, with a synthetic profile for every valid layout of ``worlds``."""
    dirs = {}
    for flavour, terms in FLAVOURS.items():
        models = {key: LinearModel(alpha=terms[op][0], beta=terms[op][1], unit="mac" if op == "gemm" else "byte")
                  for key, op in MODEL_KEYS.items()}
        for world in worlds:
            for rpn, mp, ep, esp in valid_layouts(world):
                key = VerifySpec(world=world, ranks_per_node=rpn, mp=mp, ep=ep, esp=esp).profile_key()
                CostProfile(key=key, dtype="float64", models=models, source=f"synthetic {flavour}").save(
                    cache_path(root / flavour, key))
        dirs[flavour] = str(root / flavour)
    return dirs


def _draw_valid(draw: Callable, spec: VerifySpec, field: str, candidates: Iterable[Any]) -> VerifySpec:
    """``spec`` with ``field`` drawn among the candidates that ``spec_problems`` accepts there."""
    options = [v for v in candidates if not spec_problems(replace(spec, **{field: v}), REGISTRY)]
    return replace(spec, **{field: draw(st.sampled_from(options))})


@st.composite
def verify_specs(draw: Callable, world: int, schedule: str, profile_dirs: Sequence[str]) -> VerifySpec:
    """One configuration of ``schedule`` on ``world``; ``profile_dirs``: the synthetic profiles' cache dirs."""
    rpn, mp, ep, esp = draw(st.sampled_from(valid_layouts(world, schedule)))
    spec = VerifySpec(world=world, ranks_per_node=rpn, mp=mp, ep=ep, esp=esp, experts=world, schedule=schedule)
    spec = _draw_valid(draw, spec, "exchange", EXCHANGES)
    spec = _draw_valid(draw, spec, "experts", range(2, 9))
    spec = _draw_valid(draw, spec, "k", range(1, 5))
    spec = _draw_valid(draw, spec, "ffn", (8, 12, 16, 24, 32))
    spec = replace(spec, hidden=draw(st.integers(8, 16)), tokens=draw(st.integers(1, 32)),
                   capacity_factor=draw(st.integers(1, 12)) / 4, min_capacity=draw(st.integers(0, 4)),
                   drop=draw(st.booleans()), skew=draw(st.sampled_from((0.0, 0.0, 2.0, 20.0))),
                   seed=draw(st.integers(0, 2 ** 31 - 1)))
    spec = _draw_valid(draw, spec, "profile_dir", (None, *profile_dirs))
    return _draw_valid(draw, spec, "pipeline_degree", (1, 2, 3, *REGISTRY.degree_policies()))


def hypothesis_examples(strategy: st.SearchStrategy, gen_seed: int, examples: int) -> List[Any]:
    """The values hypothesis generates for ``strategy`` in its first ``examples`` examples, from ``gen_seed``."""
    got: List[Any] = []

    @seed(gen_seed)
    @settings(max_examples=examples, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def record(value: Any) -> None:
        got.append(value)

    record()
    return got


def draw_specs(world: int, count: int, profile_dirs: Sequence[str], gen_seed: int) -> List[VerifySpec]:
    """At least ``count`` distinct configurations, reproducibly from ``gen_seed``: an equal share for every
    registered schedule valid on ``world``, everything else drawn freely.

    Each schedule's share is one hypothesis example of a list strategy, and the test runs the lists. Why not
    one spec per example: hypothesis's first example is the simplest one, and once its health checks are
    over it mutates earlier examples by copying values between fields, so per-example draws cluster (in a
    trial: 131 distinct layout/size/seed families among 203 configurations, tokens = 1 in a quarter of them,
    a whole schedule never drawn). Two examples of the list: the first is the all-simplest list (kept: one
    edge case), the second draws every element afresh."""
    schedules = [name for name in REGISTRY.schedule_names() if valid_layouts(world, name)]
    share = -(-count // len(schedules))
    drawn: List[VerifySpec] = []
    for stratum, schedule in enumerate(schedules):
        lists = hypothesis_examples(st.lists(verify_specs(world, schedule, profile_dirs), min_size=share,
                                             max_size=share), gen_seed * 64 + stratum, examples=2)
        fresh = max(lists, key=lambda specs: len(set(specs)))
        if len(set(fresh)) < 0.9 * share:     # guards the reasoning above against a change in hypothesis
            raise AssertionError(f"hypothesis drew only {len(set(fresh))} distinct {schedule} configurations "
                                 f"of {share}")
        drawn += dict.fromkeys(spec for specs in lists for spec in specs)
    return list(dict.fromkeys(drawn))


@dataclass(frozen=True)
class Outcome:
    spec: VerifySpec
    report: Optional[Dict[str, Any]]     # compare's report (rank 0)
    errors: Tuple[Tuple[str, str], ...] = ()    # (where, traceback): each rank where it raised, or its pool job

    @property
    def ok(self) -> bool:
        return not self.errors and self.report is not None and bool(self.report["ok"])

    def describe(self) -> str:
        if self.errors:                  # each distinct error once, with where it was raised
            where: Dict[str, List[str]] = {}
            for place, tb in self.errors:
                where.setdefault(_tail(tb), []).append(place)
            return "\n".join(f"    raised on {', '.join(places)}:\n      " + tail.replace("\n", "\n      ")
                             for tail, places in where.items())
        r = self.report
        errs = " ".join(f"{k}={r[k]:.3g}" for k in ("max_err_out", "max_err_grad_in", "max_err_grad_w", "max_err_aux"))
        return (f"    {errs} (tolerance {r['tolerance']:g}); routing_equal={r['routing_equal']} "
                f"dropped_routes={r['dropped_routes']} ran={r['ran']} degrees={r['degrees']}")


def _tail(tb: str) -> str:
    """A traceback's innermost frame and its exception line."""
    lines = tb.strip().splitlines()
    frames = [line.strip() for line in lines if line.strip().startswith("File ")]
    return "\n".join(frames[-1:] + lines[-1:])


def run_specs(pool: WorkerPool, specs: List[VerifySpec], batch: int) -> List[Outcome]:
    """Every spec verified on ``pool``, ``batch`` per job; a spec that raises is an outcome too."""
    outcomes: List[Outcome] = []
    pending = list(specs)
    while pending:
        chunk = pending[:batch]
        try:
            per_rank = pool.run(verify_batch, chunk)
        except WorkerError as exc:          # a rank died or hung: the whole job's specs are suspects
            outcomes += [Outcome(s, None, (("its pool job", str(exc)),)) for s in chunk]
            pending = pending[len(chunk):]
            continue
        done = min(len(r) for r in per_rank)
        for i in range(done):
            errors = tuple((f"rank {r[i]['rank']}", r[i]["error"]) for r in per_rank if "error" in r[i])
            outcomes.append(Outcome(chunk[i], per_rank[0][i].get("report"), errors))
        if any("error" in r[-1] for r in per_rank if r):
            pool.close()                    # collectives may be out of step; the next job restarts the pool
        pending = pending[done:]
    return outcomes


def dimensions(o: Outcome) -> Dict[str, str]:
    """What the summary counts for one configuration: the drawn values, and what the deciding schedules
    and degree words ran ("(tuning)": a tuner still measuring after the one call decided nothing yet)."""
    s, r = o.spec, o.report or {}
    bucket = (s.tokens - 1) // 8 * 8
    return {"layout n/mp/ep/esp": f"{s.ranks_per_node}/{s.mp}/{s.ep}/{s.esp}", "schedule": s.schedule,
            "exchange": s.exchange,
            "ran": "+".join(r.get("ran", ())) or "(tuning)", "pipeline_degree": str(s.pipeline_degree),
            "degrees run": "+".join(map(str, r.get("degrees", ()))) or "(tuning)",
            "profile": Path(s.profile_dir).name if s.profile_dir else "none", "experts/k": f"{s.experts}/{s.k}",
            "drop": str(s.drop), "capacity_factor": str(s.capacity_factor), "min_capacity": str(s.min_capacity),
            "tokens": f"{bucket + 1:2d}-{bucket + 8}", "skew": str(s.skew),
            "dropped routes": "some" if r.get("dropped_routes") else "none"}


def _order(value: str) -> Tuple[int, float, str]:
    """Numbers by value, then words."""
    try:
        return 0, float(value), ""
    except ValueError:
        return 1, 0.0, value


def summary(outcomes: List[Outcome]) -> str:
    """One line per dimension: how many configurations drew each value."""
    rows = [dimensions(o) for o in outcomes]
    lines = []
    for name in rows[0]:
        counts = Counter(row[name] for row in rows)
        lines.append(f"  {name:18s} " + ", ".join(f"{v}: {counts[v]}" for v in sorted(counts, key=_order)))
    return "\n".join(lines)


def failure_message(bad: List[Outcome], total: int) -> str:
    lines = [f"{len(bad)} of {total} generated configurations differ from the fp64 reference "
             f"(seed {GEN_SEED}; replay all: {REPLAY}); each one alone:"]
    for o in bad:
        lines += [f"  {verify_command(o.spec)}", o.describe()]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def drawn(tmp_path_factory) -> Dict[int, List[VerifySpec]]:
    dirs = write_profiles(tmp_path_factory.mktemp("generated-profiles"), PROFILE.configs)
    return {world: draw_specs(world, n, sorted(dirs.values()), GEN_SEED) for world, n in PROFILE.configs.items()}


def test_degree_words_are_drawn_only_with_the_layouts_cached_profile(tmp_path):
    """The draw leans on spec_problems to pair "auto" / "tune" with a profile cached for the layout."""
    spec = VerifySpec(world=4, ranks_per_node=2, mp=2, ep=2, pipeline_degree="auto")
    assert "needs a cost profile" in " ".join(spec_problems(spec, REGISTRY))
    assert "none cached at" in " ".join(spec_problems(replace(spec, profile_dir=str(tmp_path)), REGISTRY))
    dirs = write_profiles(tmp_path, [4])
    assert all(not spec_problems(replace(spec, profile_dir=d), REGISTRY) for d in dirs.values())
    assert "must be a positive integer" in " ".join(spec_problems(replace(spec, pipeline_degree="fast"), REGISTRY))


@pytest.mark.parametrize("world_size", sorted(PROFILE.configs))
def test_reproduce_commands_rebuild_the_drawn_specs(drawn, world_size):
    """Each printed ``moe-plugins verify`` line parses back to exactly the configuration that was run."""
    specs = drawn[world_size]
    assert len(specs) >= PROFILE.configs[world_size]
    for spec in specs:
        args = build_parser().parse_args(shlex.split(verify_command(spec))[1:])
        assert spec_from_args(args, args.world) == spec, verify_command(spec)


@pytest.mark.parametrize("world_size", sorted(PROFILE.configs))
def test_generated_configurations_match_the_reference(world, drawn, world_size, capsys):
    specs = drawn[world_size]
    with capsys.disabled():
        print(f"\n[generated] profile {PROFILE.name}, world {world_size}: {len(specs)} configurations, "
              f"seed {GEN_SEED} (replay: {REPLAY})", flush=True)
    outcomes = run_specs(world(world_size), specs, PROFILE.batch)
    with capsys.disabled():
        print(summary(outcomes), flush=True)
    assert len(outcomes) == len(specs) >= PROFILE.configs[world_size]
    assert all(o.report is None or o.report["tolerance"] == TOLERANCE["float64"] for o in outcomes)
    bad = [o for o in outcomes if not o.ok]
    if bad:
        pytest.fail(failure_message(bad, len(outcomes)), pytrace=False)
    # the draw exercised what it is for: every registered schedule, drops, and a pipelined degree word
    assert {o.spec.schedule for o in outcomes} == set(REGISTRY.schedule_names())
    assert any(o.report["dropped_routes"] for o in outcomes)
    assert any(isinstance(o.spec.pipeline_degree, str) and max(o.report["degrees"], default=1) > 1
               for o in outcomes)
