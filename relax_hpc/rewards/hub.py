"""The reward hub: which reward scores each sample, and scoring a batch through the worker pool.

`[reward] function` names the default reward: a built-in (`math`, `dapo`, `deepscaler`,
`multiple_choice`, `gpqa`, `f1`, `ifbench`, `openr1mm`, `tiny_sum`), a configured one
(`remote_rm` needs `remote_url`; `genrm` needs a judge engine) or "package.module:function".
With `type_key` set, a sample whose metadata has that key (e.g. Relax's "rm_type", or a
"data_source" column) is scored by the reward that value names; well-known data-source
names map through DATA_SOURCE_ALIASES. Samples without the key use the default. A dataset
names only registered rewards (built-in and configured), aliases, or the spec's own
`function`: a "module:function" path in a row is refused (it would import and call whatever
the data names, `builtins:bool` paying 1 for anything, `sys:exit` ending the workers), so
dotted paths come from the spec alone.

    hub = RewardHub.from_settings(spec.reward, genrm_engine=judge, genrm_tokenizer=tok)
    metrics = hub.score(samples)   # sets reward / raw_reward / reward_info in place
    hub.close()
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from relax_hpc.data.sample import Sample
from relax_hpc.engines.base import Generator
from relax_hpc.rewards.genrm import DEFAULT_GENRM_PROMPT, GenRMJudge
from relax_hpc.rewards.pool import RewardPool
from relax_hpc.rewards.registry import BUILTIN_REWARDS, CONFIGURED_REWARDS, RewardFn, resolve_reward
from relax_hpc.rewards.remote import RemoteRewardModel

# data_source values of public datasets -> reward names (verl / Relax conventions).
DATA_SOURCE_ALIASES: dict[str, str] = {
    "math_dapo": "dapo",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "openai/gsm8k": "math",
    "deepscaler": "deepscaler",
    "multimodal-open-r1": "openr1mm",
    "lmms-lab/multimodal-open-r1-8k-verified": "openr1mm",
}


class RewardSettings(Protocol):
    """The fields of `[reward]` the hub reads (relax_hpc.spec.RewardSpec has them)."""

    function: str
    type_key: str | None
    concurrency: int
    timeout_s: float
    worker_processes: int | None
    worker_memory_mb: int
    ifbench_keyword_match: str
    remote_url: str | None
    remote_max_retries: int
    genrm_prompt: str | None


class RewardHub:
    """Picks a reward per sample and scores batches concurrently."""

    def __init__(
        self,
        function: str,
        *,
        type_key: str | None = None,
        concurrency: int = 16,
        timeout_s: float = 60.0,
        worker_processes: int | None = None,
        worker_memory_mb: int = 0,
        ifbench_keyword_match: str = "reference",
        remote_url: str | None = None,
        remote_max_retries: int = 3,
        genrm_prompt: str | None = None,
        genrm_engine: Generator | None = None,
        genrm_tokenizer: Any = None,
    ) -> None:
        self.default_name, self.type_key = function, type_key
        self._remote_url, self._remote_retries, self._timeout_s = remote_url, remote_max_retries, timeout_s
        self._genrm_prompt = genrm_prompt or DEFAULT_GENRM_PROMPT
        self._genrm_engine, self._genrm_tokenizer = genrm_engine, genrm_tokenizer
        self._ifbench_keyword_match = ifbench_keyword_match
        self._cache: dict[str, RewardFn] = {}
        self._cache_lock = threading.Lock()
        self.default_fn = self.build(function)  # a bad default fails here, at start-up
        self.pool = RewardPool(concurrency, timeout_s, worker_processes, worker_memory_mb)

    @classmethod
    def from_settings(
        cls, settings: RewardSettings, genrm_engine: Generator | None = None, genrm_tokenizer: Any = None
    ) -> RewardHub:
        return cls(
            settings.function, type_key=settings.type_key, concurrency=settings.concurrency,
            timeout_s=settings.timeout_s, worker_processes=settings.worker_processes,
            worker_memory_mb=settings.worker_memory_mb,
            ifbench_keyword_match=settings.ifbench_keyword_match, remote_url=settings.remote_url,
            remote_max_retries=settings.remote_max_retries, genrm_prompt=settings.genrm_prompt,
            genrm_engine=genrm_engine, genrm_tokenizer=genrm_tokenizer,
        )

    def build(self, name: str) -> RewardFn:
        """The reward callable for a name (cached); ValueError saying what to set when it cannot."""
        with self._cache_lock:
            if name not in self._cache:
                self._cache[name] = self._construct(name)
            return self._cache[name]

    def _construct(self, name: str) -> RewardFn:
        if name == "remote_rm":
            if not self._remote_url:
                raise ValueError('reward "remote_rm" needs [reward] remote_url = "http://host:port/path"')
            # Every attempt and backoff must fit in the pool's per-sample timeout, or the pool
            # would cut the retries short; split what is left after the backoffs.
            model = RemoteRewardModel(self._remote_url, max_retries=self._remote_retries)
            spare = self._timeout_s - model.policy.total_wait_s()
            model.timeout_s = max(spare / (self._remote_retries + 1), 0.1)
            return model
        if name == "genrm":
            if self._genrm_engine is None or self._genrm_tokenizer is None:
                raise ValueError(
                    'reward "genrm" needs a judge engine and its tokenizer (RewardHub(genrm_engine=..., '
                    "genrm_tokenizer=...)); the rollout role builds them from the GenRM model"
                )
            return GenRMJudge(self._genrm_engine, self._genrm_tokenizer, self._genrm_prompt)
        if name == "ifbench":
            from relax_hpc.rewards.ifbench import IfbenchReward

            return IfbenchReward(self._ifbench_keyword_match)  # type: ignore[arg-type]
        return resolve_reward(name)

    def pick(self, sample: Sample) -> tuple[str, RewardFn]:
        """(reward name, callable) for one sample: its metadata's choice, else the default."""
        if self.type_key is None:
            return self.default_name, self.default_fn
        chosen = sample.metadata.get(self.type_key)
        if chosen is None or chosen == "":
            return self.default_name, self.default_fn
        name = DATA_SOURCE_ALIASES.get(str(chosen), str(chosen))
        if name == self.default_name:
            return self.default_name, self.default_fn
        if name not in BUILTIN_REWARDS and name not in CONFIGURED_REWARDS:
            dotted = ":" in name
            raise ValueError(
                f"metadata {self.type_key}={str(chosen)[:80]!r} "
                + ("is a 'module:function' path, which a dataset may not name (only [reward] function may); "
                   if dotted else "names no reward; ")
                + f"use one of {', '.join(sorted([*BUILTIN_REWARDS, *CONFIGURED_REWARDS]))} or a data source in "
                "DATA_SOURCE_ALIASES"
                + (", or set [reward] function to that path" if dotted else "")
            )
        return name, self.build(name)

    def score(self, samples: list[Sample]) -> dict[str, float]:
        """Score samples in place; returns metrics (errors, timeouts, count per reward type)."""
        stats = self.pool.score(samples, self.pick)
        return stats.as_metrics()

    def close(self) -> None:
        self.pool.close()
