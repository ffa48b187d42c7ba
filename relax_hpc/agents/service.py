"""The rollout role's agentic generator: multi-turn environments, custom generate, agents.

`RolloutWorker` makes one `AgenticRollout` when `[rollout] env`, `generate` or `agent` is set and
calls `generate_groups` instead of its single-turn path. It owns an event loop in a background
thread; the engine batcher and (for agents) the HTTP proxy live there for the whole run, and
each call blocks the caller until the step's episodes or sessions are done. With a multimodal
model (`media_processor` given), samples carry their prompt's media, environment observations
and agent requests may add images and audio, and every sample has media (maybe none). An agent
is offered its row's images and audio as ready OpenAI content parts, `data["media_parts"]`.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections import Counter
from typing import Any, Coroutine, TypeVar

from relax_hpc.agents.batcher import EngineBatcher
from relax_hpc.agents.config import samples_per_session
from relax_hpc.agents.dotted import load_dotted
from relax_hpc.agents.export import assign_rewards, export_concat, export_individual
from relax_hpc.agents.media import offered
from relax_hpc.agents.multiturn import GenerateArgs, generate_with_env, run_generate
from relax_hpc.agents.proxy import AgentProxy, proxy_token
from relax_hpc.agents.workflow import AgentRunner, SessionResult
from relax_hpc.data.sample import Sample
from relax_hpc.engines.base import RolloutEngine, SamplingParams
from relax_hpc.media.items import PromptMedia
from relax_hpc.spec.schema import RolloutSpec

T = TypeVar("T")


class AgenticRollout:
    def __init__(self, cfg: RolloutSpec, engine: RolloutEngine, tokenizer: Any, sampling: SamplingParams,
                 eos_id: int, max_context_tokens: int | None = None, media_processor: Any = None) -> None:
        """`cfg`: the job's [rollout], which names the env, generate or agent and their keys.
        `media_processor`: the model's `relax_hpc.media.processor.MediaProcessor`, None for a text model."""
        self.cfg, self.engine, self.sampling = cfg, engine, sampling
        self.media_processor = media_processor
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="agentic-rollout", daemon=True)
        self._thread.start()
        self.batcher = EngineBatcher(engine)
        self.proxy: AgentProxy | None = None
        self.runner: AgentRunner | None = None
        if cfg.agent:
            self.proxy = AgentProxy(self.batcher, tokenizer, sampling, token=proxy_token(),
                                    ttl_s=cfg.agent_session_timeout_s, max_context_tokens=max_context_tokens,
                                    media_processor=media_processor)
            self._call(self.proxy.start())
            self.runner = AgentRunner(cfg.agent, cfg.agent_mode, self.proxy,  # type: ignore[arg-type]
                                      cfg.agent_subproc_max_workers)
        else:
            env_class = load_dotted("[rollout] env", cfg.env) if cfg.env else None
            self.generate_fn = (load_dotted("[rollout] generate", cfg.generate) if cfg.generate
                                else generate_with_env)
            self.args = GenerateArgs(self.batcher, tokenizer, env_class, cfg, eos_id, media_processor)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate_groups(self, rows: list[Any], n: int, seed: int, first_group_id: int
                        ) -> tuple[list[list[Sample]], dict[str, float]]:
        """Samples of `rows` (dataset PromptRows), n per row, grouped per row; and step metrics."""
        if self.runner is not None:
            return self._agent_groups(rows, n, seed, first_group_id)
        samples = [
            Sample(prompt_ids=list(row.prompt_ids), response_ids=[], rollout_log_probs=[],
                   weight_version=self.engine.weight_version, group_id=first_group_id + k,
                   prompt_index=row.index, label=row.label, prompt_text=row.prompt_text,
                   metadata=dict(row.metadata), media=self._row_media(row))
            for k, row in enumerate(rows) for _ in range(n)
        ]
        done = self._call(run_generate(self.generate_fn, self.args, samples, self.sampling, seed))
        groups = [done[k * n:(k + 1) * n] for k in range(len(rows))]
        stats: dict[str, float] = {}
        turns = [s.metadata.get("num_turns") for s in done if "num_turns" in s.metadata]
        if turns:
            stats["rollout/turns"] = sum(turns) / len(turns)
        for reason, count in Counter(s.metadata.get("termination") for s in done if "termination" in s.metadata).items():
            stats[f"rollout/end_{reason}_frac"] = count / len(done)
        return groups, stats

    def _row_media(self, row: Any) -> PromptMedia | None:
        if self.media_processor is None:
            return row.media
        return row.media or PromptMedia()

    def _agent_groups(self, rows: list[Any], n: int, seed: int, first_group_id: int
                      ) -> tuple[list[list[Sample]], dict[str, float]]:
        assert self.runner is not None
        # The row's images and audio, encoded once per row and shared by its n sessions.
        # Each session gets its own copy of the messages (the strings in them are shared).
        offers = [offered(row.messages, row.prompt_text, row.media) for row in rows]
        datas = [{"prompt": row.prompt_text, "label": row.label, "metadata": dict(row.metadata),
                  "messages": copy.deepcopy(messages), "media_parts": list(parts)}
                 for row, (parts, messages) in zip(rows, offers) for _ in range(n)]
        assert self.proxy is not None
        malformed_before = self.proxy.malformed_tool_calls
        results = self._call(self._run_sessions(datas, seed))
        groups: list[list[Sample]] = []
        completions = most = 0
        for k, row in enumerate(rows):
            group: list[Sample] = []
            for res in results[k * n:(k + 1) * n]:
                exported = self._session_samples(res, row, first_group_id + k)
                group.extend(exported)
                completions += len(res.records)
                most = max(most, len(exported))
            groups.append(group)
        if not any(groups):
            raise RuntimeError(f'[rollout] agent = "{self.cfg.agent}": no session made a completion this step; '
                               "the agent must call the chat completions endpoint at base_url")
        if most > samples_per_session(self.cfg):
            raise RuntimeError(
                f'[rollout] agent = "{self.cfg.agent}": a session exported {most} samples (agent_export_style = '
                f'"{self.cfg.agent_export_style}"), more than [rollout] max_turns = {self.cfg.max_turns}, the most '
                "one session may export (the transfer queue holds prompts_per_step x n_samples_per_prompt x "
                f"max_turns rows a step); set [rollout] max_turns to at least {most}, the most completions a "
                "session of this agent makes")
        return groups, {"rollout/completions_per_session": completions / max(1, len(results)),
                        # replies this step with a tool-call block the proxy could not read
                        "agent/malformed_tool_calls": float(self.proxy.malformed_tool_calls - malformed_before)}

    async def _run_sessions(self, datas: list[dict[str, Any]], seed: int) -> list[SessionResult]:
        assert self.runner is not None
        cap = len(datas) if self.cfg.agent_mode == "inline" else min(len(datas), self.cfg.agent_subproc_max_workers)
        self.batcher.begin(cap, seed)
        remaining = len(datas)

        async def one(data: dict[str, Any]) -> SessionResult:
            nonlocal remaining
            try:
                return await self.runner.run_session(data)  # type: ignore[union-attr]
            finally:
                remaining -= 1
                if remaining < cap:  # a pool slot stays idle from now on
                    self.batcher.finish_one()

        return list(await asyncio.gather(*(one(d) for d in datas)))

    def _session_samples(self, res: SessionResult, row: Any, group_id: int) -> list[Sample]:
        if not res.records:
            return []
        rewards = assign_rewards(res.records, res.result, self.cfg.agent_turn_discount)
        export = export_concat if self.cfg.agent_export_style == "concat" else export_individual
        out = []
        for e in export(res.records, rewards):
            meta = {**row.metadata, "env_reward": e.reward, "completion_ids": e.completion_ids,
                    "session_completions": len(res.records)}
            out.append(Sample(
                prompt_ids=e.prompt_ids, response_ids=e.response_ids, rollout_log_probs=e.logprobs,
                weight_version=e.weight_version, group_id=group_id, prompt_index=row.index,
                label=row.label, prompt_text=row.prompt_text, response_text=e.text,
                finish_reason=e.finish_reason, loss_mask=e.loss_mask, metadata=meta, media=e.media,
            ))
        return out

    def close(self) -> None:
        async def shutdown() -> None:
            if self.runner is not None:
                await self.runner.aclose()
            if self.proxy is not None:
                await self.proxy.stop()
            self.batcher.close()

        if self._loop.is_running():
            self._call(shutdown())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
