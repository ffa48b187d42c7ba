"""A lean decode loop for Llama-family causal LMs (Qwen3, Qwen2, Llama): the model's own weights
and layers' arithmetic, without the Hugging Face forward's per-call machinery.

The native engine spends most of a decode step outside the arithmetic on a small model: the
HF forward builds a fresh attention mask, grows its `DynamicCache` by concatenation, and goes
through several layers of keyword handling for each token. `LeanDecoder` runs the same
computation from the model's modules, in the same order and dtypes (its RMSNorm and rotary
modules are called as they are; projections are `F.linear` on the same weights; attention is
`scaled_dot_product_attention` with grouped KV heads), on a KV cache allocated once per batch
and written in place. It reads the weights from the model at each call, so weights swapped in
by `update_weights` or `bind_weights` are what it runs.

`LeanDecoder.supports(model)` says whether a model can take this path; the engine falls back to
the HF forward for anything else (other architectures, sliding windows, MoE blocks).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED_TYPES = ("qwen3", "qwen2", "llama")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LeanDecoder:
    """Prefill a left-padded batch, then decode one token per call; see the module docstring."""

    def __init__(self, model: Any) -> None:
        self.model = model
        config = model.config
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads

    @staticmethod
    def supports(model: Any) -> bool:
        config = getattr(model, "config", None)
        if config is None or getattr(config, "model_type", None) not in SUPPORTED_TYPES:
            return False
        if getattr(config, "use_sliding_window", False) or getattr(config, "hidden_act", "silu") != "silu":
            return False
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if layers is None or not hasattr(model, "lm_head") or not hasattr(inner, "rotary_emb"):
            return False
        return all(hasattr(layer.mlp, "gate_proj") and hasattr(layer.self_attn, "q_proj") for layer in layers)

    def prefill(self, input_ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor,
                max_new_tokens: int) -> torch.Tensor:
        """Run the prompts (left-padded `input_ids`, `attention` 1 on real tokens); returns the
        last position's logits (batch, vocab). Allocates the cache for `max_new_tokens` more."""
        batch, width = input_ids.shape
        total = width + max_new_tokens
        dtype, device = self.model.lm_head.weight.dtype, input_ids.device
        layers = len(self.model.model.layers)
        self.keys = torch.zeros((layers, batch, self.kv_heads, total, self.head_dim), dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.key_valid = torch.zeros((batch, total), dtype=torch.bool, device=device)
        self.key_valid[:, :width] = attention.bool()
        self.length = 0
        return self._forward(input_ids, positions)

    def select_rows(self, index: torch.Tensor) -> None:
        """Make row r of the batch a copy of row `index[r]` (after `prefill`: one prefill of each
        distinct prompt serves all of its rows)."""
        self.keys = self.keys.index_select(1, index)
        self.values = self.values.index_select(1, index)
        self.key_valid = self.key_valid.index_select(0, index)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Decode one token per row (`tokens` (batch,), `positions` (batch, 1)); returns the logits."""
        self.key_valid[:, self.length] = True
        return self._forward(tokens.unsqueeze(-1), positions)

    def _mask(self, start: int, stop: int) -> torch.Tensor:
        """(batch, 1, queries, keys) bool: causal, real keys only; a query always sees itself, so
        a padding query's row is never all masked (its output is discarded; NaN would spread)."""
        if stop - start == 1:  # one new token: every earlier real key, and itself (marked real)
            return self.key_valid[:, None, None, :stop]
        device = self.key_valid.device
        query = torch.arange(start, stop, device=device)[:, None]
        key = torch.arange(stop, device=device)[None, :]
        mask = (key <= query)[None] & self.key_valid[:, None, :stop]
        mask |= (key == query)[None]
        return mask[:, None]

    def _layer_tensors(self) -> list[_Layer]:
        """The weights each layer uses, looked up once per batch (they change only between calls)."""
        def norm(module: Any) -> _Norm:
            return _Norm(module.weight, module.variance_epsilon)

        layers = []
        for layer in self.model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qk_norm = (norm(attn.q_norm), norm(attn.k_norm)) if hasattr(attn, "q_norm") else None
            layers.append(_Layer(
                norm(layer.input_layernorm), attn.q_proj, attn.k_proj, attn.v_proj, qk_norm, attn.o_proj,
                attn.scaling, norm(layer.post_attention_layernorm), mlp.gate_proj, mlp.up_proj, mlp.down_proj,
            ))
        return layers

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        inner = self.model.model
        if self.length == 0:
            self._layers = self._layer_tensors()
        batch, count = ids.shape
        start, stop = self.length, self.length + count
        hidden = F.embedding(ids, inner.embed_tokens.weight)
        cos, sin = inner.rotary_emb(hidden, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        mask = self._mask(start, stop)
        gqa = self.kv_heads != self.heads
        for i, layer in enumerate(self._layers):
            x = layer.input_norm(hidden)
            q = layer.q(x).view(batch, count, self.heads, self.head_dim)
            k = layer.k(x).view(batch, count, self.kv_heads, self.head_dim)
            v = layer.v(x).view(batch, count, self.kv_heads, self.head_dim)
            if layer.qk_norm is not None:  # Qwen3 normalises each head's query and key
                q, k = layer.qk_norm[0](q), layer.qk_norm[1](k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self.keys[i, :, :, start:stop] = k
            self.values[i, :, :, start:stop] = v
            out = F.scaled_dot_product_attention(
                q, self.keys[i, :, :, :stop], self.values[i, :, :, :stop], attn_mask=mask,
                scale=layer.scaling, enable_gqa=gqa,
            )
            out = out.transpose(1, 2).reshape(batch, count, self.heads * self.head_dim)
            hidden = hidden + layer.o(out)
            x = layer.post_norm(hidden)
            hidden = hidden + layer.down(F.silu(layer.gate(x)) * layer.up(x))
        self.length = stop
        last = inner.norm(hidden[:, -1])
        return F.linear(last, self.model.lm_head.weight)


class _Norm:
    """RMSNorm as the HF Llama-family modules compute it (float32 statistics, then the weight)."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight, self.eps = weight, eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class _Linear:
    def __init__(self, module: Any) -> None:
        self.weight, self.bias = module.weight, module.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _Layer:
    """One decoder layer's tensors."""

    def __init__(self, input_norm: _Norm, q: Any, k: Any, v: Any, qk_norm: tuple[_Norm, _Norm] | None,
                 o: Any, scaling: float, post_norm: _Norm, gate: Any, up: Any, down: Any) -> None:
        self.input_norm, self.post_norm, self.qk_norm, self.scaling = input_norm, post_norm, qk_norm, scaling
        self.q, self.k, self.v, self.o = _Linear(q), _Linear(k), _Linear(v), _Linear(o)
        self.gate, self.up, self.down = _Linear(gate), _Linear(up), _Linear(down)
