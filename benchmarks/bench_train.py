"""One training step of `TorchBackend.train` vs a bare torch loop on the same model, batch and optimizer.

    python benchmarks/bench_train.py [--batch 32] [--micro-batch 8] [--response-len 32] [--steps 10]
                                     [--hidden 64 --layers 2] [--old-log-probs] [--threads N] [--device cpu|cuda]

Both sides start from the same freshly built model (the tiny Qwen3, or a wider/deeper one with
`--hidden` / `--layers`) with AdamW at the same lr, the same micro-batch size and grad clip 1.0,
and train on the same batch of `--batch` tiny-task prompts with random responses of 1 to
`--response-len` tokens and advantages of either sign. The framework side is
`TorchBackend.train(samples)` with the GRPO loss and `loss_agg = "token_mean"`; the bare side
is a plain torch loop over the same micro-batches (each padded to its own longest row, as the
framework packs them): forward, log-softmax and gather of the response tokens,
advantage-weighted, masked mean over the step's tokens, backward, clip, step.
(On policy the PPO ratio is 1, so the two losses have the same gradient.) The bare side gets
its tensors packed before the clock starts; the framework packs its `Sample`s inside the step.
The first step of each, from the same weights, must give the same gradients, or the run stops.

Samples come as rollout gives them, with no old log-probs, so `TorchBackend.train` first runs
a no-grad forward of the batch to get them; `--old-log-probs` fills them in, as the ActorFwd
role does, and the step skips that forward. After `--warmup` steps each, `--steps` pairs of
steps run, alternating which side goes first; the figure is the median of the pairs' ratios
of framework time to bare time. The last line is the summary:

    train step vs bare torch: 1.52x (framework 59.4 ms, bare 39.4 ms; median of 10 pairs)
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch

from relax_hpc.backends.torch_backend import TorchBackend
from relax_hpc.data.sample import Sample
from relax_hpc.data.tiny_task import tiny_sum_rows
from relax_hpc.models.hf import load_causal_lm, load_tokenizer
from relax_hpc.models.tiny import TinyModelSize, vocab_size, write_tiny_model
from relax_hpc.spec.schema import AlgorithmSpec, TrainSpec

LR = 1e-5
GRAD_CLIP = 1.0


def model_size(hidden: int, layers: int, max_positions: int) -> TinyModelSize:
    """The tiny model's shape scaled to `hidden` / `layers` (the defaults give the tiny model itself)."""
    heads = max(4, hidden // 32)
    return TinyModelSize(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads // 2,
                         head_dim=hidden // heads, max_position_embeddings=max_positions)


def make_samples(model_dir: Path, batch: int, response_len: int, seed: int = 0) -> list[Sample]:
    tokenizer = load_tokenizer(model_dir)
    rows, rng = tiny_sum_rows(), random.Random(seed)
    samples = []
    for i in range(batch):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": rows[i % len(rows)]["prompt"]}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
        response = [rng.randrange(3, vocab_size()) for _ in range(rng.randint(1, response_len))]
        samples.append(Sample(prompt, response, [0.0] * len(response), 0, group_id=i // 4, prompt_index=i,
                              advantage=rng.choice([-1.0, 1.0]) * rng.uniform(0.2, 1.0)))
    return samples


class BareLoop:
    """The same step in plain torch: no framework code once the batch is packed."""

    def __init__(self, model_dir: Path, samples: list[Sample], pad_id: int, micro_batch: int,
                 device: str) -> None:
        self.model = load_causal_lm(model_dir, device=device).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.0)
        self.micro_batch = micro_batch
        length = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        mask = torch.zeros((len(samples), length - 1))
        for i, s in enumerate(samples):
            seq, p = s.prompt_ids + s.response_ids, len(s.prompt_ids)
            ids[i, : len(seq)] = torch.tensor(seq)
            attention[i, : len(seq)] = 1
            mask[i, p - 1 : len(seq) - 1] = 1.0  # column t predicts token t + 1
        advantages = torch.tensor([s.advantage for s in samples])
        self.tokens = mask.sum().to(device)
        # Each micro-batch as long as its longest row, as the framework packs them.
        self.micro_batches = []
        for i in range(0, len(samples), micro_batch):
            j = i + micro_batch
            used = int(attention[i:j].sum(dim=1).max())
            self.micro_batches.append(tuple(t.to(device) for t in (
                ids[i:j, :used], attention[i:j, :used], mask[i:j, : used - 1], advantages[i:j, None])))

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for ids, attention, mask, advantages in self.micro_batches:
            logits = self.model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, :-1]
            logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            loss = -(advantages * logp * mask).sum() / self.tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
        self.optimizer.step()


def check_same_gradients(framework: torch.nn.Module, bare: torch.nn.Module) -> None:
    for (name, p), q in zip(framework.named_parameters(), bare.parameters()):
        if p.grad is None or q.grad is None or not torch.allclose(p.grad, q.grad, rtol=1e-3, atol=1e-7):
            raise RuntimeError(f"the two steps differ: gradients of {name} disagree; the comparison is void")


def seconds(fn) -> float:  # type: ignore[no-untyped-def]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--response-len", type=int, default=32, help="longest response; lengths are 1..this")
    parser.add_argument("--steps", type=int, default=10, help="timed pairs (the side that goes first alternates)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (64: the tiny model)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (2: the tiny model)")
    parser.add_argument("--old-log-probs", action="store_true",
                        help="give the samples old log-probs (as ActorFwd does): the step skips its own forward")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (0: torch's default); 1 steadies the figures on a busy host")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.micro_batch < 1:
        parser.error("--steps, --batch and --micro-batch need at least 1")
    if args.hidden % 32 or args.hidden < 64:
        parser.error(f"--hidden {args.hidden}: use a multiple of 32, at least 64")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="relax-bench-train-") as tmp:
        size = model_size(args.hidden, args.layers, max_positions=64 + args.response_len)
        model_dir = write_tiny_model(Path(tmp) / "model", seed=1, size=size)
        optim = TrainSpec(steps=args.steps, lr=LR, grad_clip=GRAD_CLIP, micro_batch_size=args.micro_batch)
        backend = TorchBackend(model_dir, optim, AlgorithmSpec(loss_agg="token_mean"), device=args.device)
        samples = make_samples(model_dir, args.batch, args.response_len)
        bare = BareLoop(model_dir, samples, backend.pad_id, args.micro_batch, args.device)
    if args.old_log_probs:
        for s, lp in zip(samples, backend.compute_log_probs(samples)):
            s.old_log_probs = lp
    sides = {"framework": lambda: backend.train(samples), "bare": bare.step}
    for step in sides.values():  # the first step, from the same weights, must give the same gradient
        step()
    check_same_gradients(backend.model, bare.model)
    for _ in range(args.warmup):
        for step in sides.values():
            step()
    pairs: list[dict[str, float]] = []
    for n in range(args.steps):
        order = ("framework", "bare") if n % 2 == 0 else ("bare", "framework")
        pairs.append({name: seconds(sides[name]) for name in order})
    ratios = [p["framework"] / p["bare"] for p in pairs]
    framework_ms = 1e3 * statistics.median(p["framework"] for p in pairs)
    bare_ms = 1e3 * statistics.median(p["bare"] for p in pairs)
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    print(f"hidden {args.hidden}, {args.layers} layers, batch {args.batch} ({tokens} tokens), micro-batch "
          f"{args.micro_batch}, old log-probs {'given' if args.old_log_probs else 'computed by the step'}, "
          f"{args.device}; ratios {' '.join(f'{r:.2f}' for r in ratios)}")
    print(f"train step vs bare torch: {statistics.median(ratios):.2f}x "
          f"(framework {framework_ms:.1f} ms, bare {bare_ms:.1f} ms; median of {len(pairs)} pairs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
