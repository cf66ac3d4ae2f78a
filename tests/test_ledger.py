"""The communication ledger of the baseline against parm.txt §IV-A:
AG_ESP(BLM*N_ESP), A2A_EP(ETM*N_ESP) twice and AR_ESP(ETM*N_ESP), in forward and in backward."""

import json

from moe_plugins.core.gating import capacity
from moe_plugins.core.ledger import CommLedger, CommRecord
from moe_plugins.tools.verify import VerifySpec
from tests.workers.core import verify_many


def test_baseline_volumes_match_paper(world):
    spec = VerifySpec(world=4, ranks_per_node=2, mp=2, ep=2, esp=2, k=2, tokens=16, hidden=8, experts=4)
    report = world(4).run(verify_many, [spec])[0][0]
    assert report["ok"]
    blm, n_esp, E, M = spec.tokens * spec.hidden, spec.esp, spec.experts, spec.hidden
    T = capacity(spec.tokens, E, spec.k, spec.capacity_factor, spec.min_capacity)
    ledger = report["ledger"]["moe"]
    for phase in ("forward", "backward"):
        assert ledger[f"{phase}:all_gather@esp"] == {"count": 1, "numel": blm * n_esp, "bytes": blm * n_esp * 8,
                                                      "inter_node_bytes": 0}
        a2a = ledger[f"{phase}:all_to_all@ep"]
        assert a2a["count"] == 2 and a2a["numel"] == 2 * E * T * M * n_esp
        assert ledger[f"{phase}:all_reduce@esp"]["numel"] == E * T * M * n_esp
        # EP groups span the two nodes (ranks 0,2): half of each all-to-all crosses the node boundary
        assert a2a["inter_node_bytes"] == a2a["bytes"] // 2
    assert set(ledger) == {f"{p}:{op}" for p in ("forward", "backward")
                           for op in ("all_gather@esp", "all_to_all@ep", "all_reduce@esp")}


def test_dropless_records_capacity_agreement(world):
    spec = VerifySpec(world=4, ranks_per_node=2, mp=1, ep=4, esp=1, k=1, drop=False)
    ledger = world(4).run(verify_many, [spec])[0][0]["ledger"]["moe"]
    assert ledger["forward:all_reduce_max@ep_esp"]["numel"] == 1      # O(1) integers, not tokens


def test_ledger_summary_and_json():
    ledger = CommLedger()
    for phase in ("forward", "backward", "forward"):
        ledger.add(CommRecord(layer="l0", op="all_to_all", group="ep", group_ranks=(0, 1), numel=10, bytes=40,
                              inter_node_bytes=20, phase=phase))
    ledger.add(CommRecord(layer="l1", op="all_reduce", group="esp", group_ranks=(0, 1), numel=5, bytes=20,
                          inter_node_bytes=0, phase="backward"))
    summary = ledger.summary()
    assert summary["l0"]["forward:all_to_all@ep"] == {"count": 2, "numel": 20, "bytes": 80, "inter_node_bytes": 40}
    assert len(ledger.for_layer("l1")) == 1 and ledger.total_inter_node_bytes() == 60
    assert json.loads(ledger.to_json())["summary"] == summary
    ledger.enabled = False
    ledger.add(ledger.records[0])
    assert len(ledger.records) == 4
