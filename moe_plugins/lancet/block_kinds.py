"""The transformer blocks Lancet's executor (:mod:`moe_plugins.lancet.blocks`) knows, and how it runs each around
its MoE layer. A kind reads a block's forward arguments (:meth:`read`), runs its part before the MoE layer on the
whole batch (:meth:`before`: the tensor the MoE output joins, and the MoE input h), calls the MoE layer
(:meth:`moe_call`), finishes a partition after it (:meth:`after`) and calls a whole dense block on a partition
(:meth:`whole`). Every part goes through the block's own submodules (their hooks fire), as the stock forward does.
A kind also says where its tensors hold the batch (:attr:`batch_dim`, :meth:`dropout_dim`), which arguments it
cuts per partition (:attr:`cut_extra`) and what its forward returns (:meth:`output`).

- **GPT2Block** (transformers' GPT-2, pre-LN): before: x = x + attn(ln_1(x)), h = ln_2(x); MoE layer:
  ``block.mlp(h)``; after: x + MoE(h).
- **BertLayer** (transformers' BERT, post-LN) with the recipes' MoE output (``recipes.models.BertMoEOutput``:
  ``intermediate`` an ``nn.Identity``, ``output`` computing LayerNorm(h + dropout(MoE(h))) with submodules
  ``block``, ``dropout`` and ``LayerNorm``): before: h = attention(x)[0]; MoE layer: ``block.output.block(h)``;
  after: output.LayerNorm(h + output.dropout(MoE(h))). Dense BertLayers run whole.
- **TransformerLayer** (Megatron-core's own, sequence-first ``[L, B, M]``; :class:`MegatronKind`): before: the
  layer's ``_forward_attention`` (input norm, self-attention, bias-dropout-add) and ``_forward_pre_mlp_layernorm``;
  MoE layer: ``layer.mlp(h)``; after: ``_forward_post_mlp`` (the bias-dropout-add of the MoE output). Its forward
  returns ``(output, context)``.

The papers' packages import no host framework: blocks are told apart by their class name and submodules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

CONSUMED = ("past_key_values", "attention_mask", "encoder_hidden_states", "encoder_attention_mask", "use_cache")


@dataclass(frozen=True)
class BlockCall:
    """A block forward's arguments as the executor reads them: ``stock`` when it must run unpartitioned (a KV
    cache, cross-attention, ``use_cache``)."""

    hidden: torch.Tensor
    mask: Any
    extra: Dict[str, Any]
    stock: bool


def _extra(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k not in CONSUMED}


def _arg(args: Tuple, kwargs: Dict[str, Any], index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


def _dropout_problem(where: str, p: float, config: Any) -> List[str]:
    impl = getattr(config, "_attn_implementation", "eager")
    if p > 0 and impl != "eager":
        return [f"{where}: attention dropout ({p}) under the {impl!r} attention draws its mask inside the kernel, "
                "where partitions cannot replay it; load the model with attn_implementation=\"eager\" or attention "
                "dropout 0"]
    return []


class _Kind:
    """What every kind shares: :meth:`matches` (the class ``name`` with the ``submodules``) and :meth:`read`, from
    where its forward takes the mask, cross-attention input and cache positionally (``positions``: name -> index)."""

    name = ""
    submodules: Tuple[str, ...] = ()
    positions: Dict[str, int] = {}
    batch_dim = 0           # the hidden states' batch dim (HF: [B, L, M])
    cut_extra = True        # the forward's other tensor arguments with the batch as dim 0 are cut per partition

    @staticmethod
    def dropout_dim(x: torch.Tensor) -> int:
        """The batch dim of a tensor a dropout in the block draws a mask for."""
        return 0

    @staticmethod
    def output(x: torch.Tensor) -> Any:
        """The block forward's return value for hidden states ``x``."""
        return x

    @classmethod
    def matches(cls, block: nn.Module) -> bool:
        return type(block).__name__ == cls.name and all(hasattr(block, n) for n in cls.submodules)

    @classmethod
    def read(cls, args: Tuple, kwargs: Dict[str, Any]) -> BlockCall:
        mask, encoder, past = (_arg(args, kwargs, cls.positions[name], name)
                               for name in ("attention_mask", "encoder_hidden_states", "past_key_values"))
        stock = past is not None or encoder is not None or bool(kwargs.get("use_cache"))
        return BlockCall(args[0] if args else kwargs["hidden_states"], mask, _extra(kwargs), stock)


class GPT2Kind(_Kind):
    name = "GPT2Block"
    moe_path = "mlp"
    caches = True           # HF's GPT-2 passes a KV cache to its blocks unless use_cache is off
    submodules = ("ln_1", "attn", "ln_2", "mlp")
    positions = {"past_key_values": 1, "attention_mask": 2, "encoder_hidden_states": 3}

    @staticmethod
    def problems(block: nn.Module, where: str, moe: bool) -> List[str]:
        attn = block.attn
        if getattr(attn, "is_cross_attention", False) or hasattr(block, "crossattention"):
            return [f"{where}: cross-attention blocks are not supported by Lancet's batch partitions"]
        return _dropout_problem(where, attn.attn_dropout.p, getattr(attn, "config", None))

    @staticmethod
    def before(block: nn.Module, x_BLM: torch.Tensor, mask: Any, extra: Dict[str, Any]):
        a_BLM, _ = block.attn(block.ln_1(x_BLM), past_key_values=None, attention_mask=mask, use_cache=False, **extra)
        x_BLM = a_BLM + x_BLM
        return x_BLM, block.ln_2(x_BLM)

    @staticmethod
    def moe_call(block: nn.Module, h_BLM: torch.Tensor) -> Any:
        return block.mlp(h_BLM)

    @staticmethod
    def after(block: nn.Module, x_BLM: torch.Tensor, moe_BLM: torch.Tensor) -> torch.Tensor:
        return x_BLM + moe_BLM

    @staticmethod
    def whole(block: nn.Module, x_BLM: torch.Tensor, mask: Any, extra: Dict[str, Any]) -> torch.Tensor:
        return block(x_BLM, None, mask, None, use_cache=False, **extra)

    @staticmethod
    def heads(block: nn.Module) -> int:
        return int(block.attn.num_heads)


class BertKind(_Kind):
    name = "BertLayer"
    moe_path = "output.block"
    caches = False          # an encoder: no cache reaches its layers (a decoder BERT's is run stock, as GPT-2's)
    submodules = ("attention", "intermediate", "output")
    positions = {"attention_mask": 1, "encoder_hidden_states": 2, "past_key_values": 4}

    @staticmethod
    def problems(block: nn.Module, where: str, moe: bool) -> List[str]:
        if getattr(block, "add_cross_attention", False) or hasattr(block, "crossattention"):
            return [f"{where}: cross-attention blocks are not supported by Lancet's batch partitions"]
        out = block.output
        if moe and not (isinstance(block.intermediate, nn.Identity)
                        and all(hasattr(out, n) for n in ("block", "dropout", "LayerNorm"))):
            return [f"{where} is a BertLayer whose MoE output is a {type(out).__name__}, not the recipes' "
                    "BertMoEOutput (intermediate an nn.Identity; output.block the MoE, then LayerNorm(h + "
                    "dropout(MoE(h)))): Lancet's batch partitions cannot split it; use partitions 1"]
        if moe and getattr(block, "chunk_size_feed_forward", 0):
            return [f"{where}: chunk_size_feed_forward ({block.chunk_size_feed_forward}) cuts the MoE block's "
                    "feed-forward along the sequence; Lancet's batch partitions need it 0"]
        self_attn = block.attention.self
        return _dropout_problem(where, self_attn.dropout.p, getattr(self_attn, "config", None))

    @staticmethod
    def before(block: nn.Module, x_BLM: torch.Tensor, mask: Any, extra: Dict[str, Any]):
        h_BLM = block.attention(x_BLM, mask, **extra)[0]
        return h_BLM, h_BLM

    @staticmethod
    def moe_call(block: nn.Module, h_BLM: torch.Tensor) -> Any:
        return block.output.block(h_BLM)

    @staticmethod
    def after(block: nn.Module, h_BLM: torch.Tensor, moe_BLM: torch.Tensor) -> torch.Tensor:
        out = block.output
        return out.LayerNorm(h_BLM + out.dropout(moe_BLM))

    @staticmethod
    def whole(block: nn.Module, x_BLM: torch.Tensor, mask: Any, extra: Dict[str, Any]) -> torch.Tensor:
        return block(x_BLM, mask, None, **extra)

    @staticmethod
    def heads(block: nn.Module) -> int:
        return int(block.attention.self.num_attention_heads)


class MegatronKind(_Kind):
    """Megatron-core's ``TransformerLayer`` (told apart by its class name and submodules: this package imports no
    host). Its forward takes keyword arguments (``TransformerBlock`` passes them so); only ``attention_mask``
    (``[B, 1, L, L]`` or broadcast ``[1, 1, L, L]``) is cut per partition, the rest (rotary embeddings: per
    position) passes whole."""

    name = "TransformerLayer"
    names = ("TransformerLayer", "MoETransformerLayer")
    moe_path = "mlp"
    caches = False          # an inference context runs stock (read)
    submodules = ("input_layernorm", "self_attention", "pre_mlp_layernorm", "mlp", "mlp_bda")
    batch_dim = 1
    cut_extra = False
    STOCK = ("context", "inference_context", "inference_params", "packed_seq_params")
    REFUSED = ("attention_bias", "padding_mask")

    @classmethod
    def matches(cls, block: nn.Module) -> bool:
        return type(block).__name__ in cls.names and all(hasattr(block, n) for n in cls.submodules)

    @staticmethod
    def dropout_dim(x: torch.Tensor) -> int:
        return 0 if x.dim() == 4 else 1          # attention probabilities [B, heads, L, L]; hidden [L, B, M]

    @staticmethod
    def output(x: torch.Tensor) -> Any:
        return x, None

    @classmethod
    def read(cls, args: Tuple, kwargs: Dict[str, Any]) -> BlockCall:
        if len(args) > 3:
            raise ValueError("Lancet's batch partitions: pass Megatron's TransformerLayer its arguments after "
                             "hidden_states, attention_mask and context by keyword (as TransformerBlock does)")
        named = dict(kwargs)
        for name, value in zip(("hidden_states", "attention_mask") + cls.STOCK[:1], args):
            named[name] = value
        refused = [n for n in cls.REFUSED if named.get(n) is not None]
        if refused:
            raise ValueError(f"Lancet's batch partitions: Megatron's TransformerLayer got {', '.join(refused)}; "
                             "partitions run without one (use partitions 1)")
        stock = any(named.get(n) is not None for n in cls.STOCK)
        extra = {k: v for k, v in named.items() if k not in ("hidden_states", "attention_mask") + cls.REFUSED}
        return BlockCall(named["hidden_states"], named.get("attention_mask"), extra, stock)

    @staticmethod
    def problems(block: nn.Module, where: str, moe: bool) -> List[str]:
        config, problems = block.config, []
        if type(block.cross_attention).__name__ != "IdentityOp":
            problems.append(f"{where}: cross-attention layers are not supported by Lancet's batch partitions")
        if config.recompute_granularity is not None:
            problems.append(f"{where}: recompute_granularity ({config.recompute_granularity!r}) must be None: "
                            "partitions run the layer's parts themselves")
        if config.bias_dropout_fusion and block.hidden_dropout > 0:
            problems.append(f"{where}: bias_dropout_fusion (True) with hidden_dropout ({block.hidden_dropout}) draws "
                            "its mask in a fused kernel, where partitions cannot replay it; set bias_dropout_fusion "
                            "False (Megatron-LM: --no-bias-dropout-fusion) or hidden_dropout 0")
        core = getattr(block.self_attention, "core_attention", None)
        if config.attention_dropout > 0 and type(core).__name__ != "DotProductAttention":
            problems.append(f"{where}: attention dropout ({config.attention_dropout}) in {type(core).__name__} is "
                            "drawn inside the kernel, where partitions cannot replay it; use Megatron's "
                            "DotProductAttention (the local spec; Megatron-LM: --transformer-impl local) or "
                            "attention_dropout 0")
        if getattr(config, "cuda_graph_impl", "none") != "none":
            problems.append(f"{where}: cuda_graph_impl ({config.cuda_graph_impl!r}) must be 'none'")
        return problems

    @staticmethod
    def before(block: nn.Module, x_LBM: torch.Tensor, mask: Any, extra: Dict[str, Any]):
        x_LBM, _ = block._forward_attention(x_LBM, attention_mask=mask, **extra)
        return x_LBM, block._forward_pre_mlp_layernorm(x_LBM)

    @staticmethod
    def moe_call(block: nn.Module, h_LBM: torch.Tensor) -> Any:
        return block.mlp(h_LBM)[0]

    @staticmethod
    def after(block: nn.Module, x_LBM: torch.Tensor, moe_LBM: torch.Tensor) -> torch.Tensor:
        return block._forward_post_mlp((moe_LBM, None), x_LBM)

    @staticmethod
    def whole(block: nn.Module, x_LBM: torch.Tensor, mask: Any, extra: Dict[str, Any]) -> torch.Tensor:
        return block(hidden_states=x_LBM, attention_mask=mask, **extra)[0]

    @staticmethod
    def heads(block: nn.Module) -> int:
        return int(block.config.num_attention_heads)


KINDS = (GPT2Kind, BertKind, MegatronKind)


def kind_of(block: nn.Module) -> Optional[type]:
    """The kind of ``block`` (None: one the executor does not know)."""
    return next((kind for kind in KINDS if kind.matches(block)), None)


def unknown_problem(block: nn.Module, where: str) -> str:
    return (f"{where} is a {type(block).__name__}: Lancet's batch partitions know the blocks "
            f"{', '.join(k.name for k in KINDS)} only (transformers' GPT-2 and BERT, Megatron-core's); use "
            "partitions 1 for this model")


def stack_problems(blocks: List[nn.Module], moe: List[int]) -> List[str]:
    """Why the executor cannot run this stack (empty when it can): every block of one known kind, each one's own
    problems (``moe``: the indices of the MoE blocks)."""
    problems = []
    kinds = set()
    for i, block in enumerate(blocks):
        kind = kind_of(block)
        if kind is None:
            problems.append(unknown_problem(block, f"block {i}"))
            continue
        kinds.add(kind.name)
        problems += kind.problems(block, f"block {i}", i in moe)
    if len(kinds) > 1:
        problems.append(f"the stack mixes the block kinds {', '.join(sorted(kinds))}: Lancet's batch partitions run "
                        "one kind per stack")
    return problems
