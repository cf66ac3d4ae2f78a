"""BERT-MoE (masked LM) and GPT-2-MoE (causal LM) from HF transformers configs, with every ``moe_every``-th
feed-forward block replaced by an MoE layer built by a factory the host provides (DeepSpeed's
``deepspeed.moe.layer.MoE`` in the DeepSpeed recipes)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

# (hidden_size, expert module) -> module whose forward(x) returns (y, aux_loss, exp_counts), like DeepSpeed's MoE
MoEFactory = Callable[[int, nn.Module], nn.Module]


@dataclass(frozen=True, kw_only=True)
class ModelSize:
    layers: int
    hidden: int
    heads: int
    ffn: int
    seq_len: int
    experts: int
    k: int = 1
    capacity_factor: float = 1.0
    moe_every: int = 2           # every other FFN is an MoE layer


SIZES: Dict[str, ModelSize] = {
    # CPU default: trains on 4 gloo ranks in minutes
    "tiny": ModelSize(layers=4, hidden=64, heads=4, ffn=256, seq_len=64, experts=4, k=1, capacity_factor=1.25),
    # GPU-cluster sizes of parm.txt Table V (BERT-Base and GPT-2 with 8/16 experts)
    "bert-base": ModelSize(layers=12, hidden=768, heads=12, ffn=3072, seq_len=512, experts=16, k=2),
    "gpt2": ModelSize(layers=12, hidden=768, heads=12, ffn=3072, seq_len=1024, experts=16, k=2),
}


class MoEBlock(nn.Module):
    """Wraps a host MoE layer: returns only the output and keeps the aux loss of the last forward."""

    def __init__(self, moe: nn.Module):
        super().__init__()
        self.moe = moe
        self.last_aux = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out, aux, _ = self.moe(hidden_states)
        self.last_aux = aux
        return out


class BertMoEOutput(nn.Module):
    """Replaces BertIntermediate + BertOutput: LayerNorm(x + dropout(MoE(x)))."""

    def __init__(self, moe: nn.Module, hidden: int, eps: float, dropout: float):
        super().__init__()
        self.block = MoEBlock(moe)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(input_tensor + self.dropout(self.block(input_tensor)))


def moe_layer_indices(size: ModelSize) -> List[int]:
    return [i for i in range(size.layers) if i % size.moe_every == size.moe_every - 1]


def expert_mlp(size: ModelSize, activation: nn.Module) -> nn.Module:
    """One expert: Linear(M, H) -> activation -> Linear(H, M). nn.Linear accepts the non-contiguous chunks
    DeepSpeed's Experts hands each expert (HF's GPT-2 Conv1D does not)."""
    return nn.Sequential(nn.Linear(size.hidden, size.ffn), activation, nn.Linear(size.ffn, size.hidden))


def build_gpt2_moe(size: ModelSize, vocab_size: int, moe_factory: MoEFactory, dropout: float = 0.0,
                   attn_implementation: Optional[str] = None, use_cache: Optional[bool] = None):
    """GPT-2-MoE; HF's attention implementation and ``use_cache`` unless given. HF's GPT-2 builds a KV cache in
    every forward by default; ``use_cache=False`` builds none (Lancet's batch partitions need that), at the price of
    HF's packed-sequence check, one host read per forward."""
    from transformers import GPT2Config, GPT2LMHeadModel
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if use_cache is not None:
        extra["use_cache"] = use_cache
    cfg = GPT2Config(vocab_size=vocab_size, n_positions=size.seq_len, n_embd=size.hidden, n_layer=size.layers,
                     n_head=size.heads, n_inner=size.ffn, resid_pdrop=dropout, embd_pdrop=dropout,
                     attn_pdrop=dropout, **extra)
    model = GPT2LMHeadModel(cfg)
    for i in moe_layer_indices(size):
        expert = expert_mlp(size, nn.GELU(approximate="tanh"))       # GPT-2's gelu_new
        model.transformer.h[i].mlp = MoEBlock(moe_factory(size.hidden, expert))
    return model


def build_bert_moe(size: ModelSize, vocab_size: int, moe_factory: MoEFactory, dropout: float = 0.0,
                   attn_implementation: Optional[str] = None):
    """BERT-MoE (masked LM); HF's attention implementation unless given (Lancet's batch partitions with attention
    dropout need ``"eager"``, whose dropout they can replay)."""
    from transformers import BertConfig, BertForMaskedLM
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    cfg = BertConfig(vocab_size=vocab_size, hidden_size=size.hidden, num_hidden_layers=size.layers,
                     num_attention_heads=size.heads, intermediate_size=size.ffn,
                     max_position_embeddings=size.seq_len, hidden_dropout_prob=dropout,
                     attention_probs_dropout_prob=dropout, **extra)
    model = BertForMaskedLM(cfg)
    for i in moe_layer_indices(size):
        layer = model.bert.encoder.layer[i]
        expert = expert_mlp(size, nn.GELU())
        layer.intermediate = nn.Identity()
        layer.output = BertMoEOutput(moe_factory(size.hidden, expert), size.hidden, cfg.layer_norm_eps, dropout)
    return model


def moe_aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of the aux losses of the model's MoE blocks from the last forward."""
    auxes = [m.last_aux for m in model.modules() if isinstance(m, MoEBlock) and m.last_aux is not None]
    return torch.stack([a.float() for a in auxes]).sum() if auxes else torch.zeros(())


def describe(size: ModelSize) -> Dict[str, object]:
    return {**asdict(size), "moe_layers": moe_layer_indices(size)}
