"""Small Hugging Face models of every family shrink supports (random weights from configs, no download)."""

from __future__ import annotations

from typing import Any, Dict

import torch

VOCAB = 64

_DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)

#: family name -> (config class, keyword arguments, model class) -- names of ``transformers``
SPECS: Dict[str, Any] = {
    "llama": ("LlamaConfig", _DECODER, "LlamaForCausalLM"),
    "mistral": ("MistralConfig", _DECODER, "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", _DECODER, "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", dict(_DECODER, head_dim=8), "Qwen3ForCausalLM"),
    "gemma": ("GemmaConfig", dict(_DECODER, head_dim=8), "GemmaForCausalLM"),
    "gemma2": ("Gemma2Config", dict(_DECODER, head_dim=8, sliding_window=16), "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", dict(_DECODER, head_dim=8, sliding_window=16), "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", dict(_DECODER, pad_token_id=0, bos_token_id=0, eos_token_id=0), "Phi3ForCausalLM"),
    "gpt2": ("GPT2Config", dict(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=64, n_inner=48,
                         bos_token_id=0, eos_token_id=0),
             "GPT2LMHeadModel"),
    "opt": ("OPTConfig", dict(vocab_size=VOCAB, hidden_size=32, ffn_dim=48, num_hidden_layers=4, num_attention_heads=4,
                              max_position_embeddings=64, word_embed_proj_dim=32), "OPTForCausalLM"),
    "mixtral": ("MixtralConfig", dict(_DECODER, num_local_experts=4, num_experts_per_tok=2), "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", dict(_DECODER, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                         num_experts=4, num_experts_per_tok=2), "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", dict(_DECODER, head_dim=8, moe_intermediate_size=24, num_experts=4,
                                         num_experts_per_tok=2), "Qwen3MoeForCausalLM"),
    "bert": ("BertConfig", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                intermediate_size=48, max_position_embeddings=64), "BertModel"),
    "roberta": ("RobertaConfig", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                      intermediate_size=48, max_position_embeddings=72, pad_token_id=1), "RobertaModel"),
    "distilbert": ("DistilBertConfig", dict(vocab_size=VOCAB, dim=32, n_layers=4, n_heads=4, hidden_dim=48,
                                            max_position_embeddings=64), "DistilBertModel"),
    "vit": ("ViTConfig", dict(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=4,
                              num_attention_heads=4, intermediate_size=48), "ViTModel"),
}
FAMILIES = sorted(SPECS)
MOE = ["mixtral", "qwen2_moe", "qwen3_moe"]


def build(family: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A small random model of ``family`` in eval mode (``overrides`` change its config)."""
    import transformers as T

    config_name, kwargs, model_name = SPECS[family]
    torch.manual_seed(seed)
    config = getattr(T, config_name)(**dict(kwargs, **overrides))
    return getattr(T, model_name)(config).eval()


def batches(family: str, n: int = 4, batch: int = 2, tokens: int = 9, seed: int = 0) -> list:
    """``n`` calibration batches the family's model accepts (dicts of keyword inputs)."""
    g = torch.Generator().manual_seed(seed)
    if family == "vit":
        return [{"pixel_values": torch.randn(batch, 3, 16, 16, generator=g)} for _ in range(n)]
    low = 2 if family == "roberta" else 0  # RoBERTa's padding index is 1
    return [{"input_ids": torch.randint(low, VOCAB, (batch, tokens), generator=g),
             "attention_mask": torch.ones(batch, tokens, dtype=torch.long)} for _ in range(n)]


def output(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The tensor to compare: logits of a language model, else the last hidden state."""
    with torch.no_grad():
        out = model(**batch)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


# ------------------------------------------------------------------ the transformers zoo (tests/compact/test_zoo_hf.py)

_ZOO_DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64)
_ZOO_MOE = dict(num_experts_per_tok=2)

#: the families of the compaction round trip, hidden 64, 2 layers, 4 heads (MoE: 4 experts) -- as :data:`SPECS`
ZOO: Dict[str, Any] = {
    "llama": ("LlamaConfig", _ZOO_DECODER, "LlamaForCausalLM"),
    "mistral": ("MistralConfig", _ZOO_DECODER, "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", _ZOO_DECODER, "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", dict(_ZOO_DECODER, head_dim=16), "Qwen3ForCausalLM"),
    "gemma": ("GemmaConfig", dict(_ZOO_DECODER, head_dim=16), "GemmaForCausalLM"),
    "gemma2": ("Gemma2Config", dict(_ZOO_DECODER, head_dim=16, sliding_window=16), "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", dict(_ZOO_DECODER, head_dim=16, sliding_window=16), "Gemma3ForCausalLM"),
    "granite": ("GraniteConfig", dict(_ZOO_DECODER, embedding_multiplier=2.0, residual_multiplier=0.5,
                                      attention_multiplier=0.2, logits_scaling=4.0), "GraniteForCausalLM"),
    "cohere": ("CohereConfig", _ZOO_DECODER, "CohereForCausalLM"),
    "cohere_qk_norm": ("CohereConfig", dict(_ZOO_DECODER, use_qk_norm=True), "CohereForCausalLM"),
    "starcoder2": ("Starcoder2Config", _ZOO_DECODER, "Starcoder2ForCausalLM"),
    "stablelm": ("StableLmConfig", _ZOO_DECODER, "StableLmForCausalLM"),
    "olmo2": ("Olmo2Config", _ZOO_DECODER, "Olmo2ForCausalLM"),
    "phi": ("PhiConfig", _ZOO_DECODER, "PhiForCausalLM"),
    "phi3": ("Phi3Config", dict(_ZOO_DECODER, pad_token_id=0, bos_token_id=0, eos_token_id=0), "Phi3ForCausalLM"),
    "gpt_neox": ("GPTNeoXConfig", dict(_ZOO_DECODER, rotary_pct=0.25), "GPTNeoXForCausalLM"),
    "gptj": ("GPTJConfig", dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_inner=128, rotary_dim=8,
                                n_positions=64, bos_token_id=0, eos_token_id=0), "GPTJForCausalLM"),
    "opt": ("OPTConfig", dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                              max_position_embeddings=64, word_embed_proj_dim=64), "OPTForCausalLM"),
    "falcon": ("FalconConfig", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    bos_token_id=0, eos_token_id=0), "FalconForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", dict(_ZOO_DECODER, **_ZOO_MOE, moe_intermediate_size=32, n_routed_experts=4,
                                             n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                                             kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                             v_head_dim=16, num_key_value_heads=4), "DeepseekV3ForCausalLM"),
    "mixtral": ("MixtralConfig", dict(_ZOO_DECODER, **_ZOO_MOE, num_local_experts=4), "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", dict(_ZOO_DECODER, **_ZOO_MOE, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64, num_experts=4), "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", dict(_ZOO_DECODER, **_ZOO_MOE, head_dim=16, moe_intermediate_size=32, num_experts=4),
                  "Qwen3MoeForCausalLM"),
    "gpt2": ("GPT2Config", dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, n_inner=128,
                                bos_token_id=0, eos_token_id=0), "GPT2LMHeadModel"),
    "t5": ("T5Config", dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                            decoder_start_token_id=0), "T5ForConditionalGeneration"),
    "bert": ("BertConfig", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=128, max_position_embeddings=64), "BertModel"),
    "roberta": ("RobertaConfig", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=128, max_position_embeddings=72, pad_token_id=1), "RobertaModel"),
    "distilbert": ("DistilBertConfig", dict(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                                            max_position_embeddings=64), "DistilBertModel"),
    "vit": ("ViTConfig", dict(image_size=16, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=2,
                              num_attention_heads=4, intermediate_size=128), "ViTModel"),
}


def build_zoo(family: str, seed: int = 0) -> torch.nn.Module:
    """A random model of :data:`ZOO`'s ``family`` in eval mode."""
    import transformers as T

    config_name, kwargs, model_name = ZOO[family]
    torch.manual_seed(seed)
    return getattr(T, model_name)(getattr(T, config_name)(**kwargs)).eval()


def zoo_batch(family: str, batch: int = 2, tokens: int = 9, seed: int = 0) -> dict:
    """A batch :data:`ZOO`'s ``family`` accepts (T5: the decoder's tokens too)."""
    g = torch.Generator().manual_seed(seed)
    if family == "vit":
        return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=g)}
    low = 2 if family == "roberta" else 0
    out = {"input_ids": torch.randint(low, VOCAB, (batch, tokens), generator=g)}
    if family == "t5":
        out["decoder_input_ids"] = torch.randint(0, VOCAB, (batch, 5), generator=g)
    return out
