"""PipeMoE: pipelined dispatch, experts and combine, with the degree chosen from fitted cost models.
docs/pipemoe.md explains the design.

- :mod:`.model`: the time model (Eq. 9-12 as a recurrence, Theorem 1) and the degree search;
- :mod:`.degree`: ``pipeline_degree="auto"`` per layer call; :mod:`.tune`: ``"tune"``; :mod:`.flag`: the words;
- :mod:`.runner`: the ``Pipelined`` executor on the engine's pipeline lane, and ``build_executor``;
- :mod:`.plan`: ``moe-plugins plan pipemoe``; :mod:`.profile_ops`: the ``chunk`` op of ``moe-plugins profile``.
"""

from __future__ import annotations

from functools import partial


def _planner(subparsers) -> None:
    from moe_plugins.pipemoe import plan       # imported when `moe-plugins plan pipemoe` is asked for
    plan.register(subparsers)


def _chunk_op(spec, groups, device, stack):
    from moe_plugins.pipemoe import profile_ops   # imported when a profile runs
    return profile_ops.CHUNK_OP(spec, groups, device, stack)


def _pipelined(degree, engine):
    from moe_plugins.pipemoe.runner import build_executor    # imported when a layer pipelines
    return build_executor(degree, None, engine)


def register(registry) -> None:
    """Add PipeMoE's pipeline_degree words ("auto", "tune"), its ``pipelined`` executor, its planner and its
    profile op to ``registry``."""
    from moe_plugins.pipemoe.flag import WORDS, degree_from_flag
    for word, summary in WORDS.items():
        registry.add_degree_policy(word, partial(degree_from_flag, word), paper="pipemoe", summary=summary)
    registry.add_executor("pipelined", _pipelined, paper="pipemoe")
    registry.add_planner("pipemoe", _planner)
    registry.add_profile_op("chunk", _chunk_op)
