"""Native rollout engine vs Hugging Face `model.generate`: generated tokens/s on the same model.

    python benchmarks/bench_engine.py [--batch 16] [--max-new-tokens 64] [--repeats 5]
                                      [--hidden 64 --layers 2] [--eos] [--threads N] [--device cpu|cuda]

Both sides run the same model object (a freshly built tiny Qwen3, or a wider/deeper one with
`--hidden` / `--layers`), the same batch of tiny-task prompts in the chat template, and the
same sampling settings: temperature 1.0, no top-k, no top-p, `--max-new-tokens`. By default
EOS is disabled on both (the engine's stop set holds no real token id; the model's generation
config loses its EOS, which HF would otherwise fall back to), so every row produces exactly
`--max-new-tokens` tokens on each side (checked in the warm-up). With `--eos` both stop rows
at EOS and keep decoding the batch until every row has stopped; tokens are then counted up to
and including each row's EOS. The engine also returns each token's log-prob, which HF's
generate does not compute; that work is counted against it.
Each side is warmed up once; then `--repeats` pairs of timed batches run, alternating which
side goes first, and the median of the pairs' ratios is reported (the host's speed drifts;
both batches of a pair see about the same host). The last line is the summary:

    engine vs HF generate: 1.71x (engine 19536 tok/s, HF 11369 tok/s; median of 5 pairs: 1.65 1.74 1.68 1.71 1.71)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch

from relax_hpc.data.tiny_task import tiny_sum_rows
from relax_hpc.engines.base import SamplingParams
from relax_hpc.engines.native import NativeEngine
from relax_hpc.models.tiny import TinyModelSize, write_tiny_model

NO_TOKEN = -1  # a stop id no sampled token can equal: disables the engine's EOS stop


def model_size(hidden: int, layers: int, max_positions: int) -> TinyModelSize:
    """The tiny model's shape scaled to `hidden` / `layers` (the defaults give the tiny model itself)."""
    heads = max(4, hidden // 32)
    return TinyModelSize(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads // 2,
                         head_dim=hidden // heads, max_position_embeddings=max_positions)


def task_prompts(engine: NativeEngine, batch: int) -> list[list[int]]:
    rows = tiny_sum_rows()
    return [engine.tokenizer.apply_chat_template([{"role": "user", "content": rows[i % len(rows)]["prompt"]}],
                                                 add_generation_prompt=True, tokenize=True, return_dict=False)
            for i in range(batch)]


def engine_tokens(engine: NativeEngine, prompts: list[list[int]], params: SamplingParams, seed: int) -> int:
    return sum(len(g.token_ids) for g in engine.generate(prompts, params, seed=seed))


def hf_tokens(engine: NativeEngine, prompts: list[list[int]], params: SamplingParams, seed: int,
              eos: bool) -> int:
    """Generated tokens of `model.generate` on the engine's own model, left-padded like the engine."""
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), engine.pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p)
        attention[i, width - len(p):] = 1
    config = GenerationConfig(do_sample=True, temperature=params.temperature, top_k=0, top_p=1.0,
                              max_new_tokens=params.max_new_tokens, pad_token_id=engine.pad_id,
                              eos_token_id=engine.eos_id if eos else None)
    model: Any = engine.model  # a transformers model: torch's Module type does not know generate
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids.to(engine.device), attention_mask=attention.to(engine.device),
                                    generation_config=config)
    new = out[:, width:].cpu()
    if not eos:
        return new.numel()
    # A row that stopped is padded after its EOS; count up to and including the first EOS.
    is_eos = new == engine.eos_id
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, torch.full((len(new),), new.size(1)))
    return int(first.sum())


def timed(fn, *args) -> float:  # type: ignore[no-untyped-def]
    """Tokens per second of one call of `fn(*args)`, which returns the tokens it generated."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = fn(*args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return tokens / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="timed pairs (the side that goes first alternates)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (64: the tiny model)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (2: the tiny model)")
    parser.add_argument("--eos", action="store_true", help="stop rows at EOS on both sides (default: disabled on both)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (0: torch's default); 1 steadies the figures on a busy host")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: needs at least 1")
    if args.hidden % 32 or args.hidden < 64:
        parser.error(f"--hidden {args.hidden}: use a multiple of 32, at least 64")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
    with tempfile.TemporaryDirectory(prefix="relax-bench-engine-") as tmp:
        size = model_size(args.hidden, args.layers, max_positions=64 + args.max_new_tokens)
        engine = NativeEngine(write_tiny_model(Path(tmp) / "model", seed=1, size=size), device=args.device)
    if not args.eos:  # HF falls back to the model's generation config for an EOS of None
        engine.eos_id = NO_TOKEN
        engine.model.generation_config.eos_token_id = None  # type: ignore[union-attr]
    prompts = task_prompts(engine, args.batch)
    sides = {"engine": lambda seed: engine_tokens(engine, prompts, params, seed),
             "HF": lambda seed: hf_tokens(engine, prompts, params, seed, args.eos)}
    for name, run in sides.items():  # warm-up; with EOS off, every row must run to the end
        produced = run(0)
        if not args.eos and produced != args.batch * args.max_new_tokens:
            raise RuntimeError(f"{name} produced {produced} tokens, not {args.batch} x {args.max_new_tokens}: "
                               "EOS was not disabled, and the comparison is void")
    pairs: list[dict[str, float]] = []
    for repeat in range(args.repeats):
        order = ("engine", "HF") if repeat % 2 == 0 else ("HF", "engine")
        rates = {name: timed(sides[name], repeat + 1) for name in order}
        print(f"pair {repeat + 1}: engine {rates['engine']:.0f} tok/s, HF {rates['HF']:.0f} tok/s "
              f"({rates['engine'] / rates['HF']:.2f}x)", flush=True)
        pairs.append(rates)
    ratios = [p["engine"] / p["HF"] for p in pairs]
    engine_rate = statistics.median(p["engine"] for p in pairs)
    hf_rate = statistics.median(p["HF"] for p in pairs)
    spread = f"; median of {len(pairs)} pairs: {' '.join(f'{r:.2f}' for r in ratios)}" if len(pairs) > 1 else ""
    print(f"hidden {args.hidden}, {args.layers} layers, batch {args.batch}, {args.max_new_tokens} new tokens, "
          f"EOS {'on' if args.eos else 'off'}, {args.device}")
    print(f"engine vs HF generate: {statistics.median(ratios):.2f}x "
          f"(engine {engine_rate:.0f} tok/s, HF {hf_rate:.0f} tok/s{spread})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
