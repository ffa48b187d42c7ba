"""The Rollout role: take prompts from the dataset cursor, generate groups, score them.

A plain class so it can be tested in process; the driver places it as a Ray actor. It owns the
engine, the dataset and its cursor (checkpointed through `cursor_state` / `restore_cursor`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from relax_hpc.algos import group_advantages
from relax_hpc.data.dataset import DataCursor, load_prompt_rows
from relax_hpc.data.rows import sample_to_row
from relax_hpc.data.sample import Sample
from relax_hpc.engines.base import SamplingParams
from relax_hpc.engines.native import NativeEngine
from relax_hpc.rewards.registry import resolve_reward, score_samples
from relax_hpc.transfer.connect import connect_queue
from relax_hpc.transfer.memory import InMemoryTransferQueue
from relax_hpc.transfer.queue import partition_name


@dataclass(frozen=True)
class RolloutConfig:
    model_path: str
    data_path: str
    prompt_key: str
    label_key: str
    max_prompt_tokens: int
    shuffle: bool
    seed: int
    reward_function: str
    prompts_per_step: int
    n_samples_per_prompt: int
    sampling: SamplingParams
    normalize_std: bool = True  # group advantages: False is Dr.GRPO
    dtype: str = "float32"
    device: str = "cpu"
    num_threads: int = 0  # 0: leave torch's default
    queue_timeout_s: float = 3600.0  # how long the producer waits for the trainer to clear a step


class RolloutWorker:
    def __init__(self, cfg: RolloutConfig) -> None:
        if cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        self.cfg = cfg
        self.engine = NativeEngine(cfg.model_path, dtype=cfg.dtype, device=cfg.device)
        tok = self.engine.tokenizer
        stop_ids = tuple(cfg.sampling.stop_token_ids) + (self.engine.eos_id,)
        self.sampling = SamplingParams(**{**cfg.sampling.__dict__, "stop_token_ids": stop_ids})
        self.rows, self.report = load_prompt_rows(
            Path(cfg.data_path), tok, cfg.prompt_key, cfg.label_key, cfg.max_prompt_tokens
        )
        self.cursor = DataCursor(len(self.rows), cfg.seed, cfg.shuffle)
        self.reward_fn = resolve_reward(cfg.reward_function)
        # Producer state: new weights wait here until the next batch boundary.
        self._lock = threading.Lock()
        self._pending_weights: tuple[list[tuple[str, torch.Tensor]], int] | None = None
        self._cursor_after: dict[int, dict] = {}
        self._stats: dict[int, dict[str, float]] = {}
        self._producer: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: str | None = None

    def dataset_summary(self) -> str:
        return self.report.summary()

    def cursor_state(self) -> dict:
        return self.cursor.state()

    def restore_cursor(self, state: dict) -> None:
        self.cursor.restore(state)

    def cursor_after(self, step: int) -> dict:
        """The cursor state right after `step` took its prompts (what a checkpoint at step+1 stores)."""
        with self._lock:
            return self._cursor_after[step]

    def weight_version(self) -> int:
        return self.engine.weight_version

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Take new weights; the engine swaps them in at its next batch boundary."""
        with self._lock:
            self._pending_weights = (list(named_tensors), version)
        if self._producer is None:
            self._apply_pending_weights()

    def _apply_pending_weights(self) -> None:
        with self._lock:
            pending, self._pending_weights = self._pending_weights, None
        if pending is not None:
            self.engine.update_weights(*pending)

    # -- the producer: rollout's own loop, paced by the staleness rule --------------------------

    def start_producer(self, queue: InMemoryTransferQueue | str, start_step: int, total_steps: int,
                       max_staleness: int) -> None:
        """Produce steps start_step..total_steps-1 into the queue in a background thread."""
        self._stop.clear()
        self._producer = threading.Thread(
            target=self._produce, args=(queue, start_step, total_steps, max_staleness),
            name="rollout-producer", daemon=True,
        )
        self._producer.start()

    def stop_producer(self) -> None:
        self._stop.set()

    def producer_error(self) -> str | None:
        return self._error

    def step_stats(self, step: int) -> dict[str, float]:
        with self._lock:
            return self._stats.pop(step, {})

    def _produce(self, target: Any, start_step: int, total_steps: int, max_staleness: int) -> None:
        queue = connect_queue(target, "rollout")
        try:
            for step in range(start_step, total_steps):
                while not self._stop.is_set():
                    try:
                        queue.wait_until_may_start(step, max_staleness, timeout=1.0)
                        break
                    except TimeoutError:
                        continue
                if self._stop.is_set():
                    return
                self._apply_pending_weights()  # the batch boundary
                samples, stats = self.generate(step)
                rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
                advantages = group_advantages(rewards, self.cfg.n_samples_per_prompt, self.cfg.normalize_std)
                for sample, adv in zip(samples, advantages.tolist()):
                    sample.advantage = adv
                with self._lock:
                    self._cursor_after[step] = self.cursor.state()
                    self._stats[step] = stats
                partition = partition_name(step)
                queue.put(partition, [sample_to_row(s) for s in samples], timeout=self.cfg.queue_timeout_s)
                queue.complete(partition, len(samples))
        except Exception as e:  # reported to the driver, which stops with this message
            self._error = f"rollout producer failed: {type(e).__name__}: {e}"
        finally:
            queue.close()

    def generate(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        """Generate and score one step's groups: prompts_per_step prompts x n_samples_per_prompt."""
        t0 = time.perf_counter()
        n = self.cfg.n_samples_per_prompt
        picked = [self.rows[i] for i in self.cursor.take(self.cfg.prompts_per_step)]
        prompts = [row.prompt_ids for row in picked for _ in range(n)]
        gens = self.engine.generate(prompts, self.sampling, seed=self.cfg.seed * 1_000_003 + step)
        samples = []
        for k, gen in enumerate(gens):
            row = picked[k // n]
            samples.append(Sample(
                prompt_ids=gen.prompt_ids, response_ids=gen.token_ids,
                rollout_log_probs=gen.logprobs, weight_version=gen.weight_version,
                group_id=step * self.cfg.prompts_per_step + k // n, prompt_index=row.index,
                label=row.label, prompt_text=row.prompt_text, response_text=gen.text,
                finish_reason=gen.finish_reason, metadata=dict(row.metadata),
            ))
        t1 = time.perf_counter()
        score_samples(self.reward_fn, samples)
        stats = {
            "time/generate_s": t1 - t0,
            "time/reward_s": time.perf_counter() - t1,
            "rollout/response_len": sum(s.response_length for s in samples) / len(samples),
            "rollout/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
        }
        return samples, stats
