"""Routed experts: which experts each token of a mixture-of-experts model was sent to (R3).

With ``[algorithm] routing_replay = true`` the rollout engine records, for every token it ran
through the model, the top-k expert indices each MoE layer chose; the trainer then forces its own
routers to the same choices (relax_hpc/backends/megatron_replay.py), so that numeric differences
between engine and trainer cannot flip a near-tied routing decision.

One sample's routes are an integer tensor ``[tokens - 1, moe_layers, top_k]``: row t holds the
experts of sequence position t (prompt, then response), for every position the engine fed to the
model. The last token of a sequence is never fed (it is only sampled), which is also SGLang's
convention (``meta_info["routed_experts"]`` covers ``[0, seqlen - 1)``); its logits are never
trained on, so the trainer can route it freely. The dtype is the narrowest that holds an expert
index (`expert_index_dtype`): uint8 up to 256 experts, so a 4k-token sample of a 48-layer top-8
model travels as 1.5 MB.

`RoutingRecorder` records from a Hugging Face model (the native engine); `decode_sglang_routes`
parses SGLang's encoding. Nothing here runs unless routing replay is on.
"""

from __future__ import annotations

import base64
import binascii
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import torch

__all__ = ["RoutingRecorder", "assemble_routes", "decode_sglang_routes", "expert_index_dtype", "moe_blocks",
           "moe_routing_shape"]


def expert_index_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer dtype that holds every index of `num_experts` experts."""
    if num_experts < 1:
        raise ValueError(f"a mixture-of-experts model has at least one expert, got num_experts={num_experts}")
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    return torch.int32


def moe_routing_shape(model_dir: str | Path) -> tuple[int, int, int]:
    """(MoE layers, top_k, experts) from a Qwen3-MoE-style ``config.json``: the layers not in
    ``mlp_only_layers`` whose index + 1 is a multiple of ``decoder_sparse_step``."""
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    top_k = int(config.get("num_experts_per_tok") or 0)
    if experts < 1 or top_k < 1:
        raise ValueError(f"{path}: not a mixture-of-experts model (no num_experts / num_experts_per_tok); "
                         "routing replay needs one: set [algorithm] routing_replay = false")
    step = int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or [])
    layers = sum(1 for i in range(int(config["num_hidden_layers"])) if i not in dense and (i + 1) % step == 0)
    return layers, top_k, experts


def moe_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The sparse MoE blocks of a Hugging Face decoder (those with a `gate` router and `experts`),
    in layer order; empty for a dense model."""
    return [m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]


class RoutingRecorder:
    """Records the top-k experts of every MoE layer of a Hugging Face model, per forward call.

    Use as a context manager around the forward calls: it hooks each block's router (`gate`) and
    removes the hooks on exit. After each forward over ``[batch, seq]`` tokens, `take(batch, seq)`
    returns ``[batch, seq, layers, top_k]`` (int64) and forgets it. Only forwards run by the thread
    that entered it are recorded, so concurrent generate calls, each with its own recorder, do
    not see each other's tokens.

    The router's output differs across transformers versions: 5.x's ``Qwen3MoeTopKRouter`` returns
    ``(logits, scores, indices)``; 4.x's gate is a plain Linear returning logits, and the block
    takes ``topk(softmax(logits.float()), k)``, which the hook recomputes exactly.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        config = getattr(model, "config", None)
        self.top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
        self.num_experts = int(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0) or 0)
        self.blocks = moe_blocks(model)
        if not self.blocks or self.top_k < 1 or self.num_experts < 1:
            raise ValueError(
                f"routing replay needs a mixture-of-experts model; {type(model).__name__} has "
                f"{len(self.blocks)} MoE blocks, num_experts_per_tok={self.top_k}, num_experts={self.num_experts}. "
                "Set [algorithm] routing_replay = false for a dense model"
            )
        self._layers: list[torch.Tensor | None] = [None] * len(self.blocks)
        self._handles: list[Any] = []
        self._thread = 0

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    def __enter__(self) -> Self:
        self._thread = threading.get_ident()
        for layer, block in enumerate(self.blocks):
            gate: torch.nn.Module = block.gate  # type: ignore[assignment]
            self._handles.append(gate.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._layers = [None] * len(self.blocks)

    def _hook(self, layer: int) -> Any:
        def record(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            if threading.get_ident() != self._thread:
                return
            if isinstance(output, tuple):
                indices = output[2]
            else:  # router logits; the block routes on topk(softmax(logits in float32))
                probs = torch.softmax(output.reshape(-1, output.shape[-1]), dim=-1, dtype=torch.float)
                indices = torch.topk(probs, self.top_k, dim=-1).indices
            self._layers[layer] = indices.detach().reshape(-1, self.top_k)

        return record

    def take(self, batch: int, seq: int) -> torch.Tensor:
        """The routes of the last forward over ``[batch, seq]`` tokens: ``[batch, seq, layers, top_k]``."""
        missing = [i for i, t in enumerate(self._layers) if t is None]
        if missing:
            raise RuntimeError(f"no routing was recorded for MoE layers {missing}: the forward did not run "
                               "their routers (is the recorder entered around the model's forward?)")
        out = torch.stack([t for t in self._layers if t is not None], dim=1)  # [batch * seq, layers, k]
        self._layers = [None] * len(self.blocks)
        return out.reshape(batch, seq, self.num_layers, self.top_k).cpu()


def assemble_routes(prefill: torch.Tensor, steps: Sequence[torch.Tensor], prompt_lengths: Sequence[int],
                    response_lengths: Sequence[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """Each sample's routes ``[prompt + response - 1, layers, top_k]`` from a batched decode.

    `prefill` ``[B, W, layers, k]`` is the routing of the left-padded prompts (width W); `steps[j]`
    ``[B, 1, layers, k]`` that of generated token j, fed at decode step j. A sample with n tokens
    had tokens 0..n-2 fed (its last one is only sampled).
    """
    decoded = torch.cat(list(steps), dim=1) if steps else prefill[:, :0]
    width = prefill.shape[1]
    out = []
    for i, (p, n) in enumerate(zip(prompt_lengths, response_lengths)):
        if not 1 <= p <= width or n < 0 or max(n - 1, 0) > decoded.shape[1]:
            raise ValueError(f"sample {i}: prompt length {p} / response length {n} do not fit a prefill of "
                             f"width {width} and {decoded.shape[1]} decode steps")
        fed = [prefill[i, width - p:], decoded[i, : max(n - 1, 0)]]
        routes = torch.cat(fed, dim=0) if n >= 1 else prefill[i, width - p: width - 1]
        out.append(routes.to(dtype))
    return out


def decode_sglang_routes(value: str, num_layers: int, top_k: int, num_experts: int,
                         num_tokens: int | None = None) -> torch.Tensor:
    """SGLang's ``meta_info["routed_experts"]`` as ``[tokens, layers, top_k]`` (`expert_index_dtype`).

    SGLang (0.5.23, server flag ``--enable-return-routed-experts``, request field
    ``return_routed_experts``) sends base64 of native-endian int32, row-major
    ``[tokens, layers, top_k]``, for positions ``[routed_experts_start_len, seqlen - 1)``.
    `num_tokens`, when given, is checked (``len(prompt) + len(output) - 1`` for start 0).
    """
    try:
        raw = base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError) as e:
        raise ValueError(f"meta_info['routed_experts'] is not base64 ({e}); is the SGLang server "
                         "older or newer than 0.5.23, whose encoding this parses?") from None
    row = num_layers * top_k * 4
    if len(raw) % row:
        raise ValueError(f"meta_info['routed_experts'] has {len(raw)} bytes, not a whole number of "
                         f"[layers={num_layers}, top_k={top_k}] int32 rows; check the model config")
    flat = torch.frombuffer(bytearray(raw), dtype=torch.int32) if raw else torch.zeros(0, dtype=torch.int32)
    routes = flat.reshape(-1, num_layers, top_k)
    if num_tokens is not None and routes.shape[0] != num_tokens:
        raise ValueError(f"meta_info['routed_experts'] covers {routes.shape[0]} tokens, expected {num_tokens} "
                         "(prompt + output - 1); was routed_experts_start_len set on the request?")
    if routes.numel() and (int(routes.min()) < 0 or int(routes.max()) >= num_experts):
        raise ValueError(f"meta_info['routed_experts'] has expert indices outside [0, {num_experts}): "
                         f"min {int(routes.min())}, max {int(routes.max())}")
    return routes.to(expert_index_dtype(num_experts))
