"""Lancet's block executor (moe_plugins/lancet/blocks.py): a tiny HF GPT-2 with two core MoE layers on 4 gloo
ranks in fp64, dropout on: the loss, the aux loss and every parameter's gradient with the batch cut into 2 and 4
partitions equal those of the stock forward (<= 1e-12) for the same RNG state; refusals for blocks it does not
know and for dropout it cannot replay."""

from __future__ import annotations

import pytest
import torch

from moe_plugins.lancet.blocks import DropoutReplay, block_problems, in_layout, memory_order
from tests.workers.lancet_blocks import stock_and_partitioned

EXACT = 1e-12


def _replayed(x_BLM: torch.Tensor, order, parts: int = 2) -> torch.Tensor:
    """``parts`` partitions of ``x_BLM`` through one replayed dropout, each laid out in dim ``order`` (None: as
    cut)."""
    torch.manual_seed(3)
    replay = DropoutReplay(parts)
    size = x_BLM.shape[0] // parts
    with replay.patched():
        outs = []
        for p in range(parts):
            replay.start(p)
            x_p = replay.lay_out(x_BLM[size * p:size * (p + 1)].contiguous(), order)
            outs.append(torch.nn.functional.dropout(x_p, 0.3, True))
    assert torch.nn.functional.dropout is not replay.dropout              # restored
    return torch.cat(outs)


def test_dropout_replay_gives_each_partition_its_rows_of_the_whole_mask():
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    torch.manual_seed(3)
    whole = torch.nn.functional.dropout(x, 0.3, True)
    assert torch.equal(_replayed(x, None), whole)


def test_dropout_replay_draws_in_the_memory_layout_of_its_input():
    """A dropout draws its mask in memory order: on a transposed MoE output (Megatron's sequence-first layer behind
    a batch-first block) stock's mask is not the contiguous one. Partitions laid out as the whole output was
    (:func:`in_layout` with its :func:`memory_order`) get stock's mask; contiguous partitions another one."""
    x_BLM = torch.randn(3, 4, 5, dtype=torch.float64).transpose(0, 1)         # [B 4, L 3, M 5], sequence-first
    assert memory_order(x_BLM) == [1, 0, 2] and memory_order(x_BLM.contiguous()) == [0, 1, 2]
    torch.manual_seed(3)
    stock = torch.nn.functional.dropout(x_BLM, 0.3, True)
    assert torch.equal(_replayed(x_BLM, memory_order(x_BLM)), stock)
    assert not torch.equal(_replayed(x_BLM, None), stock)
    # one sample per partition: its batch dim has size 1, whose stride says nothing; the layout it was handed in
    # (lay_out) decides, as the executor hands the MoE output
    assert torch.equal(_replayed(x_BLM, memory_order(x_BLM), parts=4), stock)
    assert not torch.equal(_replayed(x_BLM, None, parts=4), stock)
    assert memory_order(x_BLM[:1]) == [0, 1, 2]          # a size-1 dim counts as in a contiguous tensor
    laid = in_layout(x_BLM.contiguous(), [1, 0, 2])
    assert torch.equal(laid, x_BLM) and laid.stride() == x_BLM.stride()


def test_unknown_blocks_and_unreplayable_dropout_are_refused():
    from transformers import BertConfig, GPT2Config, GPT2Model
    from transformers.models.bert.modeling_bert import BertLayer

    other = torch.nn.TransformerEncoderLayer(8, 2)
    assert block_problems(other, "block 0") == [
        "block 0 is a TransformerEncoderLayer: Lancet's batch partitions know the blocks GPT2Block, BertLayer, "
        "TransformerLayer only (transformers' GPT-2 and BERT, Megatron-core's); use partitions 1 for this model"]
    eager_bert = BertConfig(hidden_size=8, num_attention_heads=2, intermediate_size=8, attn_implementation="eager")
    bert = BertLayer(eager_bert)
    assert block_problems(bert, "block 1") == []                         # a dense BERT layer runs whole
    assert block_problems(bert, "block 1", moe=True) == [              # an MoE one needs the recipes' MoE output
        "block 1 is a BertLayer whose MoE output is a BertOutput, not the recipes' BertMoEOutput (intermediate an "
        "nn.Identity; output.block the MoE, then LayerNorm(h + dropout(MoE(h)))): Lancet's batch partitions cannot "
        "split it; use partitions 1"]
    sdpa_bert = BertLayer(BertConfig(hidden_size=8, num_attention_heads=2, intermediate_size=8,
                                     attn_implementation="sdpa"))
    assert "draws its mask inside the kernel" in block_problems(sdpa_bert, "block 0")[0]
    sdpa = GPT2Model(GPT2Config(n_embd=8, n_layer=1, n_head=2, attn_pdrop=0.1, attn_implementation="sdpa")).h[0]
    assert "draws its mask inside the kernel" in block_problems(sdpa, "block 0")[0]
    eager = GPT2Model(GPT2Config(n_embd=8, n_layer=1, n_head=2, attn_pdrop=0.1, attn_implementation="eager")).h[0]
    assert block_problems(eager, "block 0") == []


JOBS = [{"parts": 2, "dropout": 0.1, "batch": 4}, {"parts": 4, "dropout": 0.1, "batch": 4},
        {"parts": 2, "dropout": 0.0, "batch": 6}, {"parts": "auto", "dropout": 0.1, "batch": 4}]


def _err(a, b) -> float:
    return float((a - b).abs().max())


def test_partitioned_blocks_equal_the_stock_forward(world):
    results = world(4).run(stock_and_partitioned, JOBS, timeout_s=300)
    for i, job in enumerate(JOBS):
        for r in (rank[i] for rank in results):
            for got, want in ((r["parted"], r["stock"]), (r["again"], r["other"])):
                assert abs(got[0] - want[0]) <= EXACT and abs(got[1] - want[1]) <= EXACT, (job, got[:2], want[:2])
                assert got[2].keys() == want[2].keys() and len(got[2]) > 20
                assert max(_err(got[2][n], want[2][n]) for n in want[2]) <= EXACT, job
            if job["dropout"]:          # the two draws differ: the replay follows the RNG, not a fixed mask
                assert abs(r["stock"][0] - r["other"][0]) > 1e-6
            assert r["ranges"] == 2 * 2 and r["restored"]
            assert r["chosen"] == r["planned"] * 2, (r["chosen"], r["planned"])    # per range, in order
            if job["parts"] == "auto":        # the first range hides its exchanges under the next attention
                assert r["planned"][0] in (2, 4), r["planned"]


def test_tuned_partitions_climb_and_pick_the_fewest_near_the_fastest():
    from moe_plugins.lancet.tune import best_candidate, next_candidate

    allowed = [1, 2, 4, 8]
    assert next_candidate(allowed, {}) == 1
    assert next_candidate(allowed, {1: 10.0}) == 2
    assert next_candidate(allowed, {1: 10.0, 2: 8.0}) == 4                # faster: climb on
    assert next_candidate(allowed, {1: 10.0, 2: 8.0, 4: 9.0}) is None     # slower: stop
    assert next_candidate(allowed, {1: 10.0, 2: 8.0, 4: 7.0, 8: 6.0}) is None   # no larger count left
    assert next_candidate([], {}) is None
    assert best_candidate({1: 10.0, 2: 8.0, 4: 9.0}) == 2
    assert best_candidate({1: 10.0, 2: 9.95, 4: 9.9}) == 2                # 2 within 1% of the fastest: fewer
    with pytest.raises(ValueError, match="at least one"):
        best_candidate({})
