"""The native rollout engine: batched sampling with a KV cache on a Hugging Face model in torch.

It is the embedded default (CPU or one local GPU). Prompts are left-padded into one batch, the
prompt is prefilled once, then one token per step is decoded against the cache. A prompt that
comes several times in one call (a GRPO group: n samples of one prompt, with the same media) is
prefilled once, and its cache and first logits are copied to each of its rows before sampling.
Finished rows keep decoding padding (their outputs are discarded) so the batch stays
rectangular. Llama-family models (Qwen3, Qwen2, Llama) decode through `LeanDecoder`
(engines/lean_decoder.py), others through the HF forward with a `DynamicCache`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from relax_hpc.engines.base import Generation, SamplingParams
from relax_hpc.engines.call_gate import CallGate
from relax_hpc.engines.lean_decoder import LeanDecoder
from relax_hpc.engines.routed_experts import RoutingRecorder, assemble_routes, expert_index_dtype
from relax_hpc.engines.sampling import sample_next
from relax_hpc.media.items import PromptMedia
from relax_hpc.media.processor import media_processor_for
from relax_hpc.models.hf import cache_argument, load_policy_model, load_tokenizer
from relax_hpc.weights.flat import FlatWeights, bind_module, copy_into_module


class NativeEngine:
    """A `RolloutEngine` that runs the model in this process."""

    def __init__(
        self, model_path: str | Path, dtype: str = "float32", device: str = "cpu", lean: bool = True,
        record_routing: bool = False, share_prefill: bool = True,
    ) -> None:
        """`lean`: decode with `LeanDecoder` where the architecture allows (the same arithmetic
        without the HF forward's per-token overhead); False: always the HF forward.
        `record_routing`: return each generation's `routed_experts` (routing replay; a
        mixture-of-experts model only). Off, no hook is installed.
        `share_prefill`: prefill a prompt that comes several times in a call once (see the module
        docstring); False prefills every row (benchmarks/bench_prefill.py compares the two)."""
        self.model = load_policy_model(model_path, dtype=dtype, device=device).eval()
        self.lean = lean
        self.share_prefill = share_prefill
        # A multimodal model: media prefill through the model's own encoders, M-RoPE positions.
        self.media_processor = media_processor_for(model_path)
        # Checked here, so a dense model with routing replay on fails at start-up.
        self.record_routing = record_routing and RoutingRecorder(self.model).num_layers > 0
        self.tokenizer = load_tokenizer(model_path)
        self.device = torch.device(device)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id)
        self.eos_id = int(self.tokenizer.eos_token_id)
        self._version = 0
        self._gate = CallGate()
        self._released = False
        self._dropped: dict[str, tuple[torch.Size, torch.dtype]] = {}  # released on CPU: name -> shape
        self._needs_weights = False  # True from a CPU release until new weights are installed

    @property
    def weight_version(self) -> int:
        return self._version

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy new weights in place (called between batches, never during `generate`)."""
        copy_into_module(self.model, named_tensors, "rollout")
        self._version = version
        self._needs_weights = False

    def bind_weights(self, flat: FlatWeights, version: int) -> bool:
        """Run on `flat`'s tensors from now on, without a copy (between batches, like
        `update_weights`); False, nothing changed, when its dtypes, shapes or device differ."""
        if not bind_module(self.model, flat):
            return False
        self._version = version
        self._needs_weights = False
        return True

    def pause(self) -> None:
        """Wait for the generate calls in flight; hold new ones until `resume`."""
        self._gate.pause()

    def resume(self) -> None:
        self._gate.resume()

    def release_memory(self) -> int:
        """Free the weights' memory while the engine is not needed (a colocated training step);
        returns the bytes freed on the engine's device.

        On an accelerator the weights move to host memory and come back as they were. On CPU
        they already are host memory, so their storage is dropped: `resume_memory` allocates it
        again, and the next `update_weights` / `bind_weights` must fill it before `generate`
        (a colocated step always installs new weights first)."""
        with self._gate.lock:
            if self._released:
                return 0
            if self.device.type == "cpu":
                freed = self._drop_weights()
            else:
                freed = _nbytes([*self.model.parameters(), *self.model.buffers()])
                self.model.to("cpu")
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            self._released = True
            return freed

    def resume_memory(self) -> None:
        with self._gate.lock:
            if not self._released:
                return
            if self.device.type == "cpu":
                self._allocate_weights()
            else:
                self.model.to(self.device)
            self._released = False

    def _drop_weights(self) -> int:
        """Empty every parameter (what a weight update carries), remembering shapes and dtypes."""
        params = dict(self.model.named_parameters(remove_duplicate=False))  # tied: under each name
        freed = _nbytes(list(params.values()))
        for name, param in params.items():
            self._dropped.setdefault(name, (param.shape, param.dtype))
            param.data = torch.empty(0, dtype=param.dtype)
        self._needs_weights = True
        return freed

    def _allocate_weights(self) -> None:
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for name, (shape, dtype) in self._dropped.items():
            if params[name].numel() == 0:  # a tied one got its storage under its first name
                params[name].data = torch.empty(shape, dtype=dtype)
        self._dropped = {}

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None,
        media: Sequence[PromptMedia | None] | None = None,
    ) -> list[Generation]:
        """`media[i]`: prompt i's images / videos / audios, its placeholders already expanded in
        `prompts[i]` (relax_hpc.media.processor.MediaProcessor.expand)."""
        if media is not None and len(media) != len(prompts):
            raise ValueError(f"generate got {len(prompts)} prompts but {len(media)} media entries")
        if media is not None and any(media) and self.media_processor is None:
            raise ValueError("this engine's model is text-only and cannot read images, video or audio; "
                             "point [model] path at a multimodal model or unset the [data] media keys")
        with self._gate.admit(self._check_ready):
            return self._generate(prompts, params, seed, media)

    def _check_ready(self) -> None:
        if self._released:
            raise RuntimeError("the engine released its memory; call resume_memory() before generate()")
        if self._needs_weights:
            raise RuntimeError("the engine dropped its weights when it released its memory on CPU; "
                               "install new weights (update_weights or bind_weights) before generate()")

    def _generate(
        self, prompts: list[list[int]], params: SamplingParams, seed: int | None,
        media: Sequence[PromptMedia | None] | None = None,
    ) -> list[Generation]:
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        stop_ids = set(params.stop_token_ids) | {self.eos_id}
        # One recorder per call: its hooks record only this thread's forwards.
        recorder = RoutingRecorder(self.model) if self.record_routing else None
        routes: list[torch.Tensor] = []
        with torch.inference_mode(), recorder or contextlib.nullcontext():
            tokens, logprobs, finish = self._decode(prompts, params, stop_ids, generator, recorder, routes, media)
        version = self._version
        routed: list[torch.Tensor | None] = [None] * len(prompts)
        if recorder is not None:
            routed = list(assemble_routes(routes[0], routes[1:], [len(p) for p in prompts],
                                          [len(t) for t in tokens], expert_index_dtype(recorder.num_experts)))
        out = []
        for i, prompt in enumerate(prompts):
            # The text leaves out the stop token itself but keeps any other special token the
            # model produced, so a reward function sees exactly what was generated.
            shown = tokens[i][:-1] if finish[i] == "stop" and tokens[i][-1] in stop_ids else tokens[i]
            text = self.tokenizer.decode(shown, skip_special_tokens=False)
            out.append(Generation(prompt, tokens[i], logprobs[i], finish[i], version, text,
                                  routed_experts=routed[i]))
        return out

    def _decode(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        stop_ids: set[int],
        generator: torch.Generator | None,
        recorder: RoutingRecorder | None,
        routes: list[torch.Tensor],
        media: Sequence[PromptMedia | None] | None = None,
    ) -> tuple[list[list[int]], list[list[float]], list[str]]:
        """Sample up to `max_new_tokens` per prompt. With a `recorder`, `routes` gets the prefill's
        routing ``[batch, width, layers, k]``, then one ``[batch, 1, layers, k]`` per decode step."""
        from transformers import DynamicCache

        batch = len(prompts)
        # Each distinct prompt (tokens and media) is prefilled once; `rows` maps every row of the
        # batch to its prompt's row in the prefill.
        distinct, rows = distinct_prompts(prompts, media) if self.share_prefill else (list(range(batch)), [])
        firsts = [prompts[i] for i in distinct]
        width = max(len(p) for p in firsts)
        input_ids = torch.full((len(firsts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(firsts), width), dtype=torch.long)
        for i, p in enumerate(firsts):
            input_ids[i, width - len(p):] = torch.tensor(p)
            attention[i, width - len(p):] = 1
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        extra: dict[str, Any] = {}
        if self.media_processor is not None:
            from relax_hpc.media.positions import rows_forward_kwargs

            firsts_media = None if media is None else [media[i] for i in distinct]
            extra = rows_forward_kwargs(self.model, self.media_processor, input_ids, attention, firsts_media)
            positions = extra["position_ids"]  # (3, B, L): M-RoPE
        # The recorder hooks the HF routers, which only the HF forward runs.
        use_lean = self.lean and recorder is None and not extra and LeanDecoder.supports(self.model)
        lean = LeanDecoder(self.model) if use_lean else None
        if lean is not None:
            logits = lean.prefill(input_ids, attention, positions, params.max_new_tokens)
        else:
            cache_name = cache_argument(self.model)
            kwargs = {"position_ids": positions, cache_name: DynamicCache(), **extra}
            out = self.model(input_ids=input_ids, attention_mask=attention, use_cache=True, **kwargs)
            cache = getattr(out, cache_name)
            logits = out.logits[:, -1, :]
        if recorder is not None:
            routes.append(recorder.take(len(firsts), width))
        if len(firsts) < batch:  # every row gets its prompt's cache, positions and first logits
            index = torch.tensor(rows, device=self.device)
            logits, attention = logits.index_select(0, index), attention.index_select(0, index)
            positions = positions.index_select(-2, index)
            if lean is not None:
                lean.select_rows(index)
            else:
                cache.reorder_cache(index)
            if recorder is not None:
                routes[-1] = routes[-1].index_select(0, index.cpu())
        markup = self.media_processor.mask_markup if self.media_processor is not None else None
        if markup is not None:
            logits = markup(logits)
        tokens: list[list[int]] = [[] for _ in range(batch)]
        logprobs: list[list[float]] = [[] for _ in range(batch)]
        finish = ["length"] * batch
        done = torch.zeros(batch, dtype=torch.bool)
        next_pos = positions[..., -1:] + 1  # text after the prompt: one step on every M-RoPE axis
        for _ in range(params.max_new_tokens):
            new, new_lp = sample_next(logits, params.temperature, params.top_k, params.top_p, generator)
            new_cpu, lp_cpu = new.cpu().tolist(), new_lp.cpu().tolist()
            for i in range(batch):
                if done[i]:
                    continue
                tokens[i].append(new_cpu[i])
                logprobs[i].append(lp_cpu[i])
                if new_cpu[i] in stop_ids or self._hit_stop_string(tokens[i], params.stop):
                    done[i] = True
                    finish[i] = "stop"
            if bool(done.all()):
                break
            if lean is not None:
                logits = lean.step(new, next_pos)
            else:
                attention = torch.cat([attention, torch.ones((batch, 1), dtype=torch.long, device=self.device)], 1)
                out = self.model(input_ids=new.unsqueeze(-1), attention_mask=attention, position_ids=next_pos,
                                 use_cache=True, **{cache_name: cache})
                cache = getattr(out, cache_name)
                logits = out.logits[:, -1, :]
            if markup is not None:
                logits = markup(logits)
            if recorder is not None:
                routes.append(recorder.take(batch, 1))
            next_pos = next_pos + 1
        return tokens, logprobs, finish

    def _hit_stop_string(self, token_ids: list[int], stop: tuple[str, ...]) -> bool:
        if not stop:
            return False
        # Only the tail can newly complete a stop string; decode a window, not the whole response.
        # Every token carries at least one byte of UTF-8 and a character is at most 4 bytes, so
        # 4 tokens per character of the longest stop string always cover a newly completed one.
        window = max(16, 4 * max(len(s) for s in stop))
        tail = self.tokenizer.decode(token_ids[-window:], skip_special_tokens=False)
        return any(s in tail for s in stop)


def distinct_prompts(prompts: Sequence[list[int]], media: Sequence[PromptMedia | None] | None = None,
                     ) -> tuple[list[int], list[int]]:
    """The index of each distinct prompt's first row (same tokens and same media, by content), in
    order, and for every row the position of its prompt among them (pure)."""
    first: dict[tuple[tuple[int, ...], PromptMedia | None], int] = {}
    distinct: list[int] = []
    rows: list[int] = []
    for i, prompt in enumerate(prompts):
        key = (tuple(prompt), None if media is None else media[i])
        if key not in first:
            first[key] = len(distinct)
            distinct.append(i)
        rows.append(first[key])
    return distinct, rows


def _nbytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of `tensors`, each distinct one counted once (tied weights share theirs)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t.numel() and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total

