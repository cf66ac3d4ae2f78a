"""Layout: pure rank arithmetic, tested without processes (unit and hypothesis property tests)."""

import pytest
from hypothesis import given, strategies as st

from moe_plugins.core.layout import GROUP_KINDS, ParallelLayout, layout_problems


def test_paper_example_groups():
    lay = ParallelLayout(world=4, ranks_per_node=2, mp=2, ep=2, esp=2)
    assert lay.groups("mp") == [(0, 1), (2, 3)]
    assert lay.groups("dp") == [(0, 2), (1, 3)]
    assert lay.groups("esp") == [(0, 1), (2, 3)]          # ESP innermost: the MP groups, inside a node
    assert lay.groups("ep") == [(0, 2), (1, 3)]           # across nodes
    assert lay.groups("ep_esp") == [(0, 1, 2, 3)]
    assert lay.groups("expert_dp") == [(0,), (1,), (2,), (3,)]
    assert lay.dp == 2 and lay.expert_dp == 1 and lay.num_nodes == 2
    assert lay.intra_node("mp") and lay.intra_node("esp") and not lay.intra_node("ep")
    assert lay.remote_peers("ep", 0) == 1 and lay.remote_peers("esp", 0) == 0 and lay.remote_peers("ep_esp", 3) == 2


def test_expert_dp_replicas():
    lay = ParallelLayout(world=8, ranks_per_node=4, mp=1, ep=2, esp=1)
    assert lay.groups("ep") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert lay.groups("expert_dp") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert lay.coords(5) == {"mp": 0, "dp": 5, "esp": 0, "ep": 1, "expert_dp": 2}


@pytest.mark.parametrize("kwargs, message", [
    (dict(world=6, ranks_per_node=4), r"world \(6\) must be divisible by ranks_per_node \(4\)"),
    (dict(world=4, ranks_per_node=4, mp=3), r"world \(4\) must be divisible by mp \(3\)"),
    (dict(world=4, ranks_per_node=4, ep=4, esp=2), r"world \(4\) must be divisible by ep\*esp \(4\*2=8\)"),
    (dict(world=4, ranks_per_node=2, ep=0), r"ep \(0\) must be a positive integer"),
])
def test_invalid_layout_names_field_and_numbers(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelLayout(**kwargs)


def test_all_problems_reported_at_once():
    problems = layout_problems(6, 4, 4, 4, 1)
    assert len(problems) == 3 and any("ranks_per_node" in p for p in problems) and any("mp (4)" in p for p in problems)


def test_unknown_group_kind():
    with pytest.raises(ValueError, match="group kind 'tp' is unknown"):
        ParallelLayout(world=2, ranks_per_node=2).groups("tp")


def _divisor(n):
    return st.sampled_from([d for d in range(1, n + 1) if n % d == 0])


@st.composite
def layouts(draw):
    world = draw(st.sampled_from([1, 2, 4, 6, 8, 12, 16]))
    mp = draw(_divisor(world))
    ep = draw(_divisor(world))
    esp = draw(_divisor(world // ep))
    rpn = draw(_divisor(world))
    return ParallelLayout(world=world, ranks_per_node=rpn, mp=mp, ep=ep, esp=esp)


@given(layouts())
def test_every_kind_partitions_the_world(lay):
    sizes = {"mp": lay.mp, "dp": lay.dp, "ep": lay.ep, "esp": lay.esp, "ep_esp": lay.ep * lay.esp,
             "expert_dp": lay.expert_dp}
    for kind in GROUP_KINDS:
        groups = lay.groups(kind)
        assert sorted(r for g in groups for r in g) == list(range(lay.world))
        assert all(len(g) == sizes[kind] for g in groups)


@given(layouts())
def test_groups_agree_with_coords(lay):
    for rank in range(lay.world):
        c = lay.coords(rank)
        assert lay.group_of("mp", rank)[c["mp"]] == rank
        assert lay.group_of("esp", rank)[c["esp"]] == rank
        assert lay.group_of("ep", rank)[c["ep"]] == rank
        assert lay.group_of("expert_dp", rank)[c["expert_dp"]] == rank
        fused = set(lay.group_of("ep_esp", rank))
        # the fused group is exactly the union of this rank's EP group's ESP groups
        assert fused == {r for e in lay.group_of("ep", rank) for r in lay.group_of("esp", e)}
        # every member of an expert-DP group holds the same shard: same (ep, esp) coordinates
        assert {(lay.coords(r)["ep"], lay.coords(r)["esp"]) for r in lay.group_of("expert_dp", rank)} == \
            {(c["ep"], c["esp"])}
        assert lay.remote_peers("mp", rank) == sum(lay.node_of(r) != lay.node_of(rank) for r in lay.group_of("mp", rank))
