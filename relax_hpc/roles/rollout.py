"""The Rollout role: take prompts from the dataset cursor, generate groups, score them.

A plain class so it can be tested in process; the driver places it as a Ray actor. It owns the
engine, the dataset and its cursor (checkpointed through `cursor_state` / `restore_cursor`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from relax_hpc.data.dataset import DataCursor, load_prompt_rows
from relax_hpc.data.sample import Sample
from relax_hpc.engines.base import SamplingParams
from relax_hpc.engines.native import NativeEngine
from relax_hpc.rewards.registry import resolve_reward, score_samples


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
    dtype: str = "float32"
    device: str = "cpu"
    num_threads: int = 0  # 0: leave torch's default


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

    def dataset_summary(self) -> str:
        return self.report.summary()

    def cursor_state(self) -> dict:
        return self.cursor.state()

    def restore_cursor(self, state: dict) -> None:
        self.cursor.restore(state)

    def weight_version(self) -> int:
        return self.engine.weight_version

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.engine.update_weights(named_tensors, version)

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
