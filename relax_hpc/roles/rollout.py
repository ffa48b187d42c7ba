"""The Rollout role: take prompts from the dataset cursor, generate groups, score them.

A plain class so it can be tested in process; the driver places it as a Ray actor. It owns the
engine, the dataset and its cursor (checkpointed through `cursor_state` / `restore_cursor`).
Its producer thread generates step after step into the transfer queue, paced by the staleness
rule; new weights arrive on another thread into a `WeightInbox` and are swapped in at the
producer's batch boundary, where it also waits for the version the staleness bound requires
(`required_weight_version`), since the trainer broadcasts while it trains the next step.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from relax_hpc.agents.config import is_agentic
from relax_hpc.algos import group_advantages
from relax_hpc.algos.estimators import outcome_advantages, overlong_penalty
from relax_hpc.data.dataset import DataCursor, DataSettings, load_dataset
from relax_hpc.data.rows import samples_to_rows
from relax_hpc.data.sample import Sample, assign_sample_ids
from relax_hpc.engines.base import RolloutEngine, SamplingParams
from relax_hpc.engines.elastic.api import ElasticReply
from relax_hpc.engines.fleet import EngineFleet, build_genrm_judge
from relax_hpc.engines.router import EngineClient, EngineRouter
from relax_hpc.media.items import PromptMedia
from relax_hpc.media.processor import media_processor_for
from relax_hpc.ops.heap import settle_heap
from relax_hpc.rewards.hub import RewardHub, RewardSettings
from relax_hpc.roles.advantages import divides_by_std
from relax_hpc.roles.heartbeat import Heartbeats
from relax_hpc.roles.shipping import StepShipper
from relax_hpc.spec.schema import (
    AlgorithmSpec,
    JobInfoSpec,
    ModelSpec,
    RolloutSpec,
    SGLangSpec,
)
from relax_hpc.transfer.connect import connect_queue, report_failure
from relax_hpc.transfer.memory import InMemoryTransferQueue
from relax_hpc.transfer.queue import staleness_allows
from relax_hpc.weights.base import required_weight_version
from relax_hpc.weights.endpoints import WeightInbox, WeightReceiverEndpoint


@dataclass(frozen=True)
class RolloutConfig:
    """The rollout role: the spec tables it reads, as the spec gives them, and what the driver
    resolves for it. The properties are the fleet's view of them (engines/fleet.py: FleetSettings)."""

    model: ModelSpec  # path, dtype
    data: DataSettings  # the spec's [data] table
    reward: RewardSettings  # the spec's [reward] table
    rollout: RolloutSpec  # prompts and samples per step, sampling, engines, dynamic sampling, an agent or env
    algorithm: AlgorithmSpec  # the advantage estimator, DAPO's overlong shaping, routing replay
    job: JobInfoSpec  # seed
    device: str = "cpu"  # resolved (cpu, cuda:N)
    num_threads: int = 0  # 0: leave torch's default
    queue_timeout_s: float = 3600.0  # how long the producer waits for the trainer to clear a step
    # How long the producer waits for the weights a step needs. The broadcast has started when the
    # wait begins, and the channel's own deadline (600 s) reports a stuck one first and better.
    weights_timeout_s: float = 1800.0
    # Rows go out without `advantages`: the Advantages role or the critic writes them on the queue.
    rows_without_advantages: bool = False
    # [cluster] colocate: engines release their memory from a step's end until the next weights
    release_between_steps: bool = False
    sglang_spec: SGLangSpec | None = None  # engine = "sglang": [rollout.sglang], its python resolved
    job_dir: str | None = None  # the SGLang servers' logs go to JOBDIR/logs (None: a temp dir)
    # Engines started at run time in actors of their own beat every this many seconds into
    # JOBDIR/health/engine_<n>.json (relax_hpc/ops/health.py); 0: they do not.
    engine_heartbeat_interval_s: float = 0.0
    # An engine that joined over HTTP (a grow job's) is given up, its prompts going to the others,
    # when one request takes longer than this: a step never waits longer for a vanished node.
    remote_engine_timeout_s: float = 300.0

    @property
    def model_path(self) -> str:
        return self.model.path

    @property
    def dtype(self) -> str:
        return self.model.dtype

    @property
    def engine(self) -> str:
        return self.rollout.engine

    @property
    def num_engines(self) -> int:
        return self.rollout.num_engines

    @property
    def chunks_per_engine(self) -> int:
        return self.rollout.chunks_per_engine

    @property
    def routing_replay(self) -> bool:
        return self.algorithm.routing_replay


def sampling_of(rollout: RolloutSpec) -> SamplingParams:
    """The sampling of every engine call `[rollout]` makes."""
    return SamplingParams(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
                          top_p=rollout.top_p, top_k=rollout.top_k, stop=tuple(rollout.stop))


def engine_role_name(engine_id: str) -> str:
    """The health role name of a rollout engine ("engine-3" -> "engine_3")."""
    return engine_id.replace("-", "_")


def _max_context(engine: EngineRouter, model_path: str) -> int | None:
    """The model's context length, from the engine in this process or the model's config."""
    config = getattr(engine.model, "config", None)
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path)
    return getattr(config, "max_position_embeddings", None)


def reward_by_media(samples: list[Sample]) -> dict[str, float]:
    """Mean reward per kind of prompt media ("image", "audio", "image+audio"; "text" for none):
    which media a multimodal policy has learnt to use."""
    by_kind: dict[str, list[float]] = {}
    for s in samples:
        kind = "+".join(i.kind for i in s.media.items) if s.media else "text"
        by_kind.setdefault(kind, []).append(s.reward)
    return {f"reward/by_media/{kind}": sum(v) / len(v) for kind, v in sorted(by_kind.items())}


class RolloutWorker(WeightReceiverEndpoint, Heartbeats):
    def __init__(self, cfg: RolloutConfig, engine: RolloutEngine | list[RolloutEngine] | None = None,
                 engine_hosts: list[Any] | None = None, engine_host_options: dict[str, Any] | None = None) -> None:
        """`engine`: the engine (or engines) to drive; `engine_hosts`: `EngineHost` actors to
        drive; neither: build `cfg.num_engines` of the engine `[rollout] engine` names, here.
        `engine_host_options`: Ray options of engines added at run time in actors of their own."""
        if cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        self.cfg = cfg
        engines = [engine] if engine is not None and not isinstance(engine, list) else engine
        self._host_options = engine_host_options if engine_hosts else None
        clients = None
        if engine_hosts:
            from relax_hpc.roles.engine_host import RayEngineClient

            clients = [RayEngineClient(f"engine-{i}", h) for i, h in enumerate(engine_hosts)]
        # The engines, and those added and removed while the job runs (the driver's REST API
        # calls `elastic`).
        self.fleet = EngineFleet(cfg, engines, clients, spawn_actors=self._spawn_engine_actors)
        self.engine = self.fleet.router
        tok = self.engine.tokenizer
        self.sampling = dataclasses.replace(sampling_of(cfg.rollout), stop_token_ids=(self.engine.eos_id,))
        self.algorithm = cfg.algorithm
        self.normalize_std = divides_by_std(cfg.algorithm)
        # A multimodal model: every sample carries its prompt's media (empty for a text prompt),
        # and the media travel with the prompts to the engines.
        self.media_processor = media_processor_for(cfg.model_path)
        self.rows, self.report = load_dataset(cfg.data, tok, self.media_processor)
        self.cursor = DataCursor(len(self.rows), cfg.job.seed, cfg.data.shuffle)
        judge, judge_tokenizer = build_genrm_judge(cfg.reward, cfg.dtype, cfg.device)
        self.rewards = RewardHub.from_settings(cfg.reward, genrm_engine=judge, genrm_tokenizer=judge_tokenizer)
        self.agentic: Any = None
        if is_agentic(cfg.rollout):
            from relax_hpc.agents.service import AgenticRollout

            self.agentic = AgenticRollout(cfg.rollout, self.engine, tok, self.sampling,
                                          self.engine.eos_id, _max_context(self.engine, cfg.model_path),
                                          media_processor=self.media_processor)
        # Producer state: new weights wait in the inbox until the next batch boundary.
        self._lock = threading.Lock()
        self._inbox = WeightInbox()
        self._cursor_after: dict[int, dict] = {}
        self._stats: dict[int, dict[str, float]] = {}
        self._producer: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: str | None = None
        self._next_group = 0
        self._released = False  # the engines gave their memory to the trainer

    def dataset_summary(self) -> str:
        return self.report.summary()

    def cursor_state(self) -> dict:
        return self.cursor.state()

    def restore_cursor(self, state: dict) -> None:
        self.cursor.restore(state)

    def weight_version(self) -> int:
        return self.engine.weight_version

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Take a complete update; the engine swaps it in at its next batch boundary."""
        self.stage_weights(list(named_tensors))
        self.commit_weights(version)

    def stage_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        self._inbox.stage(bucket)

    def commit_weights(self, version: int) -> None:
        self._inbox.commit(version)
        if self._producer is None:  # nothing generates: swap now
            self._apply_pending_weights()

    def weights_failed(self, message: str) -> None:
        self._inbox.fail(message)

    def weight_inbox(self) -> WeightInbox:
        return self._inbox

    def memory_record(self) -> dict[str, Any]:
        """The bytes this role holds, from its tensors (relax_hpc/roles/memory.py): the weights of
        its engines in this process and the inbox's buffers."""
        from relax_hpc.roles.memory import rollout_record

        clients = [e.client for e in getattr(self.engine, "engines", [])]
        modules = [m for m in (getattr(getattr(c, "engine", None), "model", None) for c in clients)
                   if isinstance(m, torch.nn.Module)]
        return rollout_record(modules, self._inbox.buffers(), self.cfg.device, self.weight_home() is None,
                              self.weight_receiver_staging_bytes()).as_dict()

    def weight_home(self) -> str | None:
        """Received versions stay on the wire's device only for the one engine that computes with
        them in place (a native engine in this process binds the buffer). SGLang servers, engine
        actors and several engines each load a version into memory of their own, so this role keeps
        its two buffers in host memory, off the GPUs those engines fill."""
        return None if self.fleet.binds_received_weights() else "cpu"

    def awaited_weight_version(self) -> int | None:
        """The version the producer is waiting for at its batch boundary; None when not waiting."""
        return self._inbox.awaited

    def _apply_pending_weights(self, required: int = 0) -> bool:
        """The batch boundary: wait until a complete update of at least `required` is here (the
        engine may already run it), then swap in the newest one. False when asked to stop."""
        current = self.engine.weight_version
        if not self._inbox.wait_for(required, current, self._stop, self.cfg.weights_timeout_s, "rollout"):
            return False
        if self._released:  # the trainer's step is over: its new weights are here
            self.engine.resume_memory()
            self._released = False
        self._inbox.install(self.engine.bind_weights, self.engine.update_weights)
        return True

    # -- the producer: rollout's own loop, paced by the staleness rule --------------------------

    def start_producer(self, queue: InMemoryTransferQueue | str, start_step: int, total_steps: int,
                       max_staleness: int, start_version: int | None = None) -> None:
        """Produce steps start_step..total_steps-1 into the queue in a background thread.

        `start_version` is the weight version the trainer starts from (the checkpoint's on resume;
        default `start_step`); step s then waits for `required_weight_version(s, ...)`.
        """
        version = start_step if start_version is None else start_version
        self._stop.clear()
        self._producer = threading.Thread(
            target=self._produce, args=(queue, start_step, total_steps, max_staleness, version),
            name="rollout-producer", daemon=True,
        )
        self._producer.start()

    def stop_producer(self) -> None:
        self._stop.set()
        if self._producer is not None:
            self._producer.join(timeout=30)
        self.rewards.close()
        if self.agentic is not None:
            self.agentic.close()
        self.engine.close()

    def release_memory(self) -> int:
        """Give the engines' memory (weights, cache, the weight buffers kept for them) to the
        trainer until the next step's weights arrive; returns the bytes freed."""
        freed = self.engine.release_memory() + self._inbox.release_buffers()
        self._released = True
        return freed

    def engine_report(self) -> list[dict[str, Any]]:
        """Per rollout engine: its id, state, job, the samples it produced, whether it still serves."""
        return self.engine.report()

    # -- engines joining and leaving at run time (docs/federation.md) ---------------------------

    def elastic(self, action: str, body: dict[str, Any] | None = None) -> ElasticReply:
        """One request of the elastic REST API (engines/elastic/api.py)."""
        return self.fleet.elastic(action, body or {})

    def _spawn_engine_actors(self, ids: list[str]) -> list[EngineClient]:
        """Engines added at run time when the job's engines run in actors: `EngineHost` actors
        placed like the job's."""
        cfg = self.cfg
        assert self._host_options is not None, "engines in this process are spawned by the fleet"
        import ray

        from relax_hpc.roles.engine_host import EngineHost, RayEngineClient

        hosts = [ray.remote(EngineHost).options(**self._host_options).remote(
            cfg.engine, cfg.model_path, cfg.dtype, cfg.device, cfg.num_threads, cfg.routing_replay) for _ in ids]
        ray.get([h.pid.remote() for h in hosts], timeout=600)  # started, model loaded
        if cfg.engine_heartbeat_interval_s > 0 and cfg.job_dir:
            ray.get([h.start_heartbeat.remote(cfg.job_dir, engine_role_name(i), cfg.engine_heartbeat_interval_s)
                     for i, h in zip(ids, hosts)], timeout=60)
        return [RayEngineClient(i, h) for i, h in zip(ids, hosts)]

    def kill_engine(self, engine_id: str) -> bool:
        """Kill the actor of engine `engine_id` (a hung one: the health manager's stale check);
        the router then sees it dead and re-issues its prompts. False when it is not an actor here."""
        import ray

        for e in self.engine.engines if hasattr(self.engine, "engines") else []:
            handle = getattr(e.client, "handle", None)
            if e.client.id == engine_id and handle is not None:
                ray.kill(handle)
                return True
        return False

    def producer_error(self) -> str | None:
        return self._error

    def doing(self) -> str:
        """What `relax-hpc status` shows for rollout (relax_hpc/roles/heartbeat.py)."""
        step = getattr(self, "_producing", None)
        return "idle" if step is None else f"producing step {step}"

    def step_report(self, step: int) -> tuple[dict[str, float], dict]:
        """The statistics of `step` and the cursor state right after it took its prompts (what a
        checkpoint after `step` stores), in one call; earlier steps' cursors are dropped, the
        loop never asks for them again."""
        with self._lock:
            for old in [s for s in self._cursor_after if s < step]:
                del self._cursor_after[old]
            return self._stats.pop(step, {}), self._cursor_after[step]

    def _produce(self, target: Any, start_step: int, total_steps: int, max_staleness: int,
                 start_version: int) -> None:
        queue = connect_queue(target, "rollout")
        # Each step's rows are built and put while the next step generates (roles/shipping.py).
        shipper = StepShipper(connect_queue(target, "rollout-ship"), self.cfg.queue_timeout_s)
        try:
            for step in range(start_step, total_steps):
                self._producing = step
                t_wait = time.perf_counter()
                in_flight = shipper.in_flight_step
                if in_flight is not None and not staleness_allows(step, in_flight, max_staleness):
                    # The step before is not on the queue yet, so the queue would not count it as
                    # uncleared (max_staleness 0): wait until it is, then for the trainer to clear it.
                    shipper.wait()
                while not self._stop.is_set():
                    if (failed := shipper.failure()) is not None:
                        raise failed
                    try:
                        queue.wait_until_may_start(step, max_staleness, timeout=1.0)
                        break
                    except TimeoutError:
                        continue
                if self._stop.is_set():
                    return
                t_weights = time.perf_counter()
                required = required_weight_version(step, start_step, start_version, max_staleness)
                if not self._apply_pending_weights(required):  # the batch boundary
                    return
                t_go = time.perf_counter()
                samples, stats = self.generate(step)
                if self.cfg.release_between_steps and step + 1 < total_steps:
                    stats["rollout/released_bytes"] = float(self.release_memory())
                # What rollout waited for before it could start: which side paces the loop.
                stats["time/rollout_wait_staleness_s"] = t_weights - t_wait
                stats["time/rollout_wait_weights_s"] = t_go - t_weights
                if not self.cfg.rows_without_advantages:  # else the Advantages role writes them on the queue
                    self._set_advantages(samples)
                with self._lock:
                    self._cursor_after[step] = self.cursor.state()
                    self._stats[step] = stats
                shipper.ship(step, functools.partial(self._rows_of, samples))
                settle_heap()  # once, after the first step: start-up is over
            shipper.wait()  # the last step is on the queue before the producer ends
        except Exception as e:  # reported to the driver, which stops with this message
            self._error = f"rollout producer failed: {type(e).__name__}: {e}"
        finally:
            try:
                shipper.close()
            except Exception as e:  # noqa: BLE001 - a put that failed while the producer stopped
                self._error = self._error or f"rollout producer failed: {type(e).__name__}: {e}"
            queue.close()
            if self._error:  # in one process the trainer waits on this queue: it stops at once
                report_failure(target, self._error)

    def _rows_of(self, samples: list[Sample]) -> Sequence[dict[str, Any]]:
        # With an Advantages role, that role writes each row's advantage on the queue.
        return samples_to_rows(samples, without=("advantages",) if self.cfg.rows_without_advantages else ())

    def _set_advantages(self, samples: list[Sample]) -> None:
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        estimator = self.algorithm.advantage
        if estimator == "group" and self.agentic is None:  # consecutive groups of n_samples_per_prompt
            advantages = group_advantages(rewards, self.cfg.rollout.n_samples_per_prompt, self.normalize_std)
        else:  # by group id: agent sessions export a varying number of samples per prompt
            trained = torch.tensor([sum(s.mask()) for s in samples], dtype=torch.float32)
            advantages = outcome_advantages(estimator, rewards, [s.group_id for s in samples], trained,
                                            self.normalize_std)
        for sample, adv in zip(samples, advantages.tolist()):
            sample.advantage = adv

    def _shape_overlong(self, samples: list[Sample]) -> None:
        """DAPO's overlong shaping, before anything reads the rewards (dynamic sampling, advantages):
        the soft penalty joins each reward (reward_info["overlong_penalty"]), and with the filter a
        truncated sample keeps its place in its group but trains no token."""
        algo = self.algorithm
        if algo.overlong_buffer_len > 0:
            penalties = overlong_penalty([s.response_length for s in samples], self.sampling.max_new_tokens,
                                         algo.overlong_buffer_len, algo.overlong_penalty)
            for sample, penalty in zip(samples, penalties):
                sample.reward += penalty
                sample.reward_info["overlong_penalty"] = penalty
        if algo.overlong_filter:
            for sample in samples:
                if sample.finish_reason == "length":
                    sample.loss_mask = [0] * len(sample.response_ids)
                    sample.reward_info["overlong_filtered"] = 1.0

    def generate(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        """Generate and score one step's groups: prompts_per_step prompts x n_samples_per_prompt.

        With dynamic sampling (DAPO), groups whose rewards are all equal carry no learning signal:
        they are dropped and more prompts are generated, up to max_sampling_rounds rounds; a step
        still short after that trains on the groups it has.
        """
        t0 = time.perf_counter()
        want, n = self.cfg.rollout.prompts_per_step, self.cfg.rollout.n_samples_per_prompt
        kept: list[list[Sample]] = []
        stats: dict[str, float] = {}
        rounds = dropped = 0
        while len(kept) < want and rounds < self.cfg.rollout.max_sampling_rounds:
            groups, round_stats = self._generate_groups(want - len(kept), step, rounds)
            for k, v in round_stats.items():
                stats[k] = stats.get(k, 0.0) + v
            rounds += 1
            if not self.cfg.rollout.dynamic_sampling:
                kept = groups
                break
            for group in groups:
                rewards = {s.reward for s in group}
                if len(rewards) > 1:
                    kept.append(group)
                else:
                    dropped += 1
            if rounds == self.cfg.rollout.max_sampling_rounds and not kept:
                kept = groups  # nothing had signal: train on zero advantages rather than stall
        assign_sample_ids(step, kept[:want])  # each sample's slot in the step (the exactly-once check)
        samples = [s for group in kept[:want] for s in group]
        stats.update({
            "time/rollout_s": time.perf_counter() - t0,
            "rollout/response_len": sum(s.response_length for s in samples) / len(samples),
            "rollout/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
            "rollout/engines": float(self.engine.serving()),
            "rollout/samples_per_s": len(samples) / max(time.perf_counter() - t0, 1e-9),
        })
        for job, count in self.engine.serving_by_job().items():
            stats[f"rollout/engines_by_job/{job}"] = float(count)
        if self.algorithm.overlong_buffer_len > 0:
            stats["rollout/overlong_penalty_mean"] = sum(
                s.reward_info.get("overlong_penalty", 0.0) for s in samples) / len(samples)
        if self.algorithm.overlong_filter:
            stats["rollout/overlong_filtered_frac"] = sum(
                s.reward_info.get("overlong_filtered", 0.0) for s in samples) / len(samples)
        if self.cfg.rollout.dynamic_sampling:
            stats["rollout/dropped_groups"] = float(dropped)
            stats["rollout/sampling_rounds"] = float(rounds)
        return samples, stats

    def _generate_groups(self, prompts: int, step: int, round_: int) -> tuple[list[list[Sample]], dict[str, float]]:
        t0 = time.perf_counter()
        n = self.cfg.rollout.n_samples_per_prompt
        picked = [self.rows[i] for i in self.cursor.take(prompts)]
        flat = [row.prompt_ids for row in picked for _ in range(n)]
        seed = (self.cfg.job.seed * 1_000_003 + step) * 131 + round_
        if self.agentic is not None:
            groups, extra = self.agentic.generate_groups(picked, n, seed, self._next_group + 1)
            self._next_group += len(groups)
            t1 = time.perf_counter()
            reward_stats = self.rewards.score([s for g in groups for s in g])
            return groups, {**extra, **reward_stats, "time/generate_s": t1 - t0,
                            "time/reward_s": time.perf_counter() - t1}
        media = None
        if self.media_processor is not None:
            media = [row.media or PromptMedia() for row in picked for _ in range(n)]
        gens = (self.engine.generate(flat, self.sampling, seed=seed, group_size=n) if media is None else
                self.engine.generate(flat, self.sampling, seed=seed, group_size=n, media=media))
        groups: list[list[Sample]] = []
        for k, gen in enumerate(gens):
            row = picked[k // n]
            if k % n == 0:
                groups.append([])
                self._next_group += 1
            groups[-1].append(Sample(
                prompt_ids=gen.prompt_ids, response_ids=gen.token_ids,
                rollout_log_probs=gen.logprobs, weight_version=gen.weight_version,
                group_id=self._next_group, prompt_index=row.index,
                label=row.label, prompt_text=row.prompt_text, response_text=gen.text,
                finish_reason=gen.finish_reason, metadata=dict(row.metadata),
                routed_experts=gen.routed_experts, media=None if media is None else media[k],
            ))
        t1 = time.perf_counter()
        reward_stats = self.rewards.score([s for g in groups for s in g])
        self._shape_overlong([s for g in groups for s in g])
        if media is not None:
            reward_stats.update(reward_by_media([s for g in groups for s in g]))
        return groups, {**reward_stats, "time/generate_s": t1 - t0, "time/reward_s": time.perf_counter() - t1}
