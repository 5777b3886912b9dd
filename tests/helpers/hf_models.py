"""Small Hugging Face models built from configs (random weights, no download) for the compaction tests."""

from __future__ import annotations

import torch

VOCAB = 64


def ids(batch: int = 2, tokens: int = 7, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def llama(kind: str = "llama", layers: int = 2, heads: int = 4, kv_heads: int = 2, hidden: int = 32, ffn: int = 48):
    import transformers as T

    cfg_cls, model_cls = {
        "llama": (T.LlamaConfig, T.LlamaModel),
        "mistral": (T.MistralConfig, T.MistralModel),
        "qwen2": (T.Qwen2Config, T.Qwen2Model),
    }[kind]
    cfg = cfg_cls(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64)
    return model_cls(cfg).eval()


def gpt2(layers: int = 2, heads: int = 4, hidden: int = 32):
    import transformers as T

    cfg = T.GPT2Config(vocab_size=VOCAB, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=64, n_inner=48)
    return T.GPT2Model(cfg).eval()


def vit(layers: int = 2, heads: int = 4, hidden: int = 32):
    import transformers as T

    cfg = T.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, intermediate_size=48)
    return T.ViTModel(cfg, add_pooling_layer=False).eval()


def distilbert(layers: int = 2, heads: int = 4, hidden: int = 32):
    import transformers as T

    cfg = T.DistilBertConfig(vocab_size=VOCAB, dim=hidden, n_layers=layers, n_heads=heads, hidden_dim=48,
                             max_position_embeddings=64)
    return T.DistilBertModel(cfg).eval()


def t5_encoder(layers: int = 2, heads: int = 4, hidden: int = 32, gated: bool = False):
    import transformers as T

    cfg = T.T5Config(vocab_size=VOCAB, d_model=hidden, d_kv=8, d_ff=48, num_layers=layers, num_heads=heads,
                     feed_forward_proj="gated-gelu" if gated else "relu", dropout_rate=0.0)
    return T.T5EncoderModel(cfg).eval()


def bert(kind: str = "bert", layers: int = 2, heads: int = 4, hidden: int = 32, cross: bool = False):
    import transformers as T

    cfg_cls, model_cls = {"bert": (T.BertConfig, T.BertModel), "roberta": (T.RobertaConfig, T.RobertaModel)}[kind]
    kw = {"is_decoder": True, "add_cross_attention": True} if cross else {}
    cfg = cfg_cls(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  intermediate_size=48, max_position_embeddings=64, **kw)
    return model_cls(cfg, add_pooling_layer=False).eval()


def pixels(batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(seed))
