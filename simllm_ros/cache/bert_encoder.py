"""A BERT encoder's forward (the fingerprint's MiniLM) on torch alone, its weights mapped from the folder's
safetensors file.

Why: transformers' BertModel costs every node start seconds and ~100 MB resident to import its modeling code
(modeling_utils pulls torch.distributed, scipy and quantizer integrations), more than the encoder itself. This
computes what BertModel's last_hidden_state is, with the same operations in the same order (embeddings summed as
it sums them, its LayerNorms, SDPA with no mask where nothing is padded and its boolean padding mask otherwise,
exact GELU), so the same bits (test_sentence_encoder compares it with sentence-transformers). Folders of another
architecture or BERT variant return None from `open`; the caller then takes transformers' AutoModel.
"""
from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

from ..mapped_safetensors import MappedSafetensors

WEIGHTS = "model.safetensors"


class BertEncoder:
    @classmethod
    def open(cls, path: str) -> "BertEncoder | None":
        """The encoder of a plain BERT folder (absolute positions, exact GELU, an encoder only), else None."""
        try:
            with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
                cfg = json.load(f)
            if not isinstance(cfg, dict) or cfg.get("model_type") != "bert" or cfg.get("is_decoder") or \
                    cfg.get("position_embedding_type", "absolute") != "absolute" or cfg.get("hidden_act") != "gelu" \
                    or cfg.get("add_cross_attention"):
                return None
            mapped = MappedSafetensors(os.path.join(path, WEIGHTS))
            return cls(cfg, mapped)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def __init__(self, cfg: dict, mapped: MappedSafetensors):
        prefix = "bert." if "bert.embeddings.word_embeddings.weight" in mapped.entries else ""

        def w(name: str) -> torch.Tensor:
            t = mapped.tensor(prefix + name)
            if t.dtype != torch.float32:
                raise ValueError(f"{name} is {t.dtype}, not float32")
            return t

        self._mapped = mapped  # the weights are views of its mapping
        self.hidden = int(cfg["hidden_size"])
        self.heads = int(cfg["num_attention_heads"])
        self.head_dim = self.hidden // self.heads
        self.scaling = self.head_dim ** -0.5
        self.eps = float(cfg.get("layer_norm_eps", 1e-12))
        self.max_positions = int(cfg["max_position_embeddings"])
        e = "embeddings."
        self.word, self.position, self.token_type = (w(e + "word_embeddings.weight"),
                                                     w(e + "position_embeddings.weight"),
                                                     w(e + "token_type_embeddings.weight"))
        self.embed_norm = (w(e + "LayerNorm.weight"), w(e + "LayerNorm.bias"))
        self.layers = []
        for i in range(int(cfg["num_hidden_layers"])):
            p = f"encoder.layer.{i}."
            lin = lambda n, p=p: (w(p + n + ".weight"), w(p + n + ".bias"))
            self.layers.append({
                "q": lin("attention.self.query"), "k": lin("attention.self.key"), "v": lin("attention.self.value"),
                "o": lin("attention.output.dense"), "ln1": lin("attention.output.LayerNorm"),
                "up": lin("intermediate.dense"), "down": lin("output.dense"), "ln2": lin("output.LayerNorm")})

    def _norm(self, x: torch.Tensor, wb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden,), wb[0], wb[1], self.eps)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """last_hidden_state [B, T, hidden] of a tokenizer's batch."""
        B, T = input_ids.shape
        if T > self.max_positions:
            raise ValueError(f"{T} tokens: the encoder has {self.max_positions} positions")
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = F.embedding(input_ids, self.word) + F.embedding(token_type_ids, self.token_type)
        x = x + F.embedding(torch.arange(T)[None], self.position)
        x = self._norm(x, self.embed_norm)
        # bidirectional: a key is masked only where it is padding; no mask at all where nothing is
        mask = None if bool(attention_mask.all()) else attention_mask.bool()[:, None, None, :].expand(B, 1, T, T)
        def heads(y: torch.Tensor) -> torch.Tensor:  # [B, T, hidden] -> [B, heads, T, head_dim]
            return y.view(B, T, -1, self.head_dim).transpose(1, 2)

        for L in self.layers:
            q, k, v = heads(F.linear(x, *L["q"])), heads(F.linear(x, *L["k"])), heads(F.linear(x, *L["v"]))
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=self.scaling,
                                               is_causal=False)
            a = a.transpose(1, 2).reshape(B, T, -1)
            x = self._norm(F.linear(a, *L["o"]) + x, L["ln1"])
            x = self._norm(F.linear(F.gelu(F.linear(x, *L["up"])), *L["down"]) + x, L["ln2"])
        return x
