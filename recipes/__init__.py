"""Recipes: BERT-MoE and GPT-2-MoE built from HF transformers configs, trained with DeepSpeed (and
Megatron-core), installed as ``moe_plugins.recipes``."""
