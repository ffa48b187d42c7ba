"""The Rollout role in process: dynamic sampling, weight versions, the producer and staleness."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from relax_hpc.data.sample import Sample
from relax_hpc.roles.rollout import RolloutConfig, RolloutWorker
from relax_hpc.roles.shipping import StepShipper
from relax_hpc.spec import parse_spec
from relax_hpc.transfer import InMemoryTransferQueue, partition_name

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from relax_hpc.models.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=1)


def zero_for_zero_plus(sample: Sample) -> float:
    """No signal for prompts "0+b=" (every sample 0); a distinct value per sample otherwise."""
    return 0.0 if sample.prompt_text.startswith("0+") else sample.rollout_log_probs[0]


def _worker(model_dir: Path, dynamic: bool = False, rounds: int = 1, prompts: int = 8,
            reward: str = "tiny_sum", weights_timeout_s: float = 600.0) -> RolloutWorker:
    spec = parse_spec(
        f'[job]\nname = "r"\n[model]\npath = "{model_dir}"\n'
        f'[data]\npath = "{REPO / "jobspecs/data/tiny_sum.jsonl"}"\n'
        f'[reward]\nfunction = "{reward}"\n[train]\nsteps = 1\n'
    )
    rollout = dataclasses.replace(spec.rollout, prompts_per_step=prompts, n_samples_per_prompt=8, max_new_tokens=3,
                                  engine="native", dynamic_sampling=dynamic, max_sampling_rounds=rounds)
    cfg = RolloutConfig(model=spec.model, data=spec.data, reward=spec.reward, rollout=rollout,
                        algorithm=spec.algorithm, job=dataclasses.replace(spec.job, seed=3),
                        weights_timeout_s=weights_timeout_s)
    return RolloutWorker(cfg)


def test_dynamic_sampling_keeps_only_groups_with_signal(model_dir: Path) -> None:
    worker = _worker(model_dir, dynamic=True, rounds=4, prompts=10,
                     reward="test_rollout_worker:zero_for_zero_plus")
    samples, stats = worker.generate(0)
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    assert len(groups) == 10 and all(len(g) == 8 for g in groups.values())
    assert not any(g[0].prompt_text.startswith("0+") for g in groups.values())
    assert all(len({s.reward for s in g}) > 1 for g in groups.values())
    # 10 of the 25 shuffled prompts are taken first; the 0+b ones among them were dropped and
    # replaced from the next round.
    assert stats["rollout/dropped_groups"] >= 1
    assert stats["rollout/sampling_rounds"] >= 2


def test_dynamic_sampling_trains_on_what_it_has_when_nothing_has_signal(model_dir: Path) -> None:
    worker = _worker(model_dir, dynamic=True, rounds=2, prompts=4, reward="test_rollout_worker:always_zero")
    samples, stats = worker.generate(0)
    assert len(samples) == 4 * 8 and stats["rollout/sampling_rounds"] == 2


def always_zero(sample: Sample) -> float:
    return 0.0


def test_without_dynamic_sampling_every_group_is_kept(model_dir: Path) -> None:
    samples, stats = _worker(model_dir).generate(0)
    assert len(samples) == 8 * 8 and "rollout/dropped_groups" not in stats


def test_samples_carry_the_weight_version_the_engine_used(model_dir: Path) -> None:
    worker = _worker(model_dir)
    assert {s.weight_version for s in worker.generate(0)[0]} == {0}
    weights = [(n, t + 0.01) for n, t in worker.engine.model.state_dict().items()]
    worker.update_weights(weights, 7)  # no producer running: applied at once
    assert worker.weight_version() == 7
    assert {s.weight_version for s in worker.generate(1)[0]} == {7}


def _same_weights(worker: RolloutWorker) -> list[tuple[str, torch.Tensor]]:
    return [(n, t * 1.0) for n, t in worker.engine.model.state_dict().items()]


def test_producer_follows_the_staleness_rule_and_swaps_weights_at_a_batch_boundary(model_dir: Path) -> None:
    queue = InMemoryTransferQueue()
    worker = _worker(model_dir, prompts=2)
    worker.start_producer(queue, start_step=0, total_steps=3, max_staleness=0)
    consumer = queue.open_session("test")
    batch0 = consumer.get(partition_name(0), "actor", ["tokens"], 16, timeout=30)
    assert len(batch0) == 16
    # max_staleness 0: step 1 may not start while step 0 is uncleared.
    assert not queue.may_start(1, 0)
    assert [p.name for p in queue.partitions()] == [partition_name(0)]
    # New weights arrive while the producer waits: they must be used for step 1, not before.
    worker.update_weights(_same_weights(worker), 1)
    assert worker.weight_version() == 0
    queue.clear(partition_name(0))
    batch1 = consumer.get(partition_name(1), "actor", ["tokens", "weight_version"], 16, timeout=30)
    assert {int(v) for v in batch1.column("weight_version")} == {1}
    assert worker.step_report(0)[1] != worker.step_report(1)[1]
    worker.update_weights(_same_weights(worker), 2)
    queue.clear(partition_name(1))
    consumer.get(partition_name(2), "actor", ["tokens"], 16, timeout=30)
    worker.stop_producer()
    assert worker.producer_error() is None
    assert torch.is_tensor(batch0.rows[0]["tokens"])


def test_a_step_still_being_put_counts_as_uncleared(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 0's rows go to the queue on the shipper's thread; until its partition exists the queue
    cannot count it, so at max_staleness 0 the producer itself waits for it: step 1 neither
    starts nor takes the weights meant for it before step 0 is on the queue and cleared."""
    holding, release = threading.Event(), threading.Event()
    real_put = StepShipper._put

    def held_put(self: StepShipper, step: int, build_rows: Callable[[], Any]) -> None:
        if step == 0:
            holding.set()
            assert release.wait(60)
        real_put(self, step, build_rows)

    monkeypatch.setattr(StepShipper, "_put", held_put)
    queue = InMemoryTransferQueue()
    worker = _worker(model_dir, prompts=2)
    worker.start_producer(queue, start_step=0, total_steps=2, max_staleness=0)
    assert holding.wait(60)  # step 0 handed over: the producer has turned to step 1
    worker.update_weights(_same_weights(worker), 1)  # what the trainer would send after step 0
    assert worker.awaited_weight_version() is None and worker.weight_version() == 0
    assert queue.partitions() == []  # step 0 is not on the queue yet
    release.set()
    consumer = queue.open_session("test")
    assert len(consumer.get(partition_name(0), "actor", ["tokens"], 16, timeout=30)) == 16
    assert worker.weight_version() == 0  # step 0 is on the queue, not cleared
    queue.clear(partition_name(0))
    batch1 = consumer.get(partition_name(1), "actor", ["tokens", "weight_version"], 16, timeout=30)
    assert {int(v) for v in batch1.column("weight_version")} == {1}
    worker.stop_producer()
    assert worker.producer_error() is None


def _wait_until(condition: Callable[[], bool], what: str, deadline_s: float = 60.0) -> None:
    """Poll for a state the producer thread reaches on its own (a deadline, not a timing assertion)."""
    end = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < end, f"never reached: {what}"
        time.sleep(0.01)


@pytest.mark.parametrize("max_staleness, start_step, start_version, awaited", [
    (0, 0, 0, 1),  # step 1 needs the weights trained on step 0
    (1, 0, 0, 1),  # step 2 may start once step 0 is cleared, and needs version 1
    (0, 5, 9, 10),  # resumed at step 5 with version 9: step 6 needs 9 + 1
])
def test_producer_waits_for_the_version_the_staleness_bound_requires(
    model_dir: Path, max_staleness: int, start_step: int, start_version: int, awaited: int,
) -> None:
    """The trainer clears a step before its broadcast has arrived: rollout must not generate the
    next step with older weights. It waits at the batch boundary, ignores a half-received
    update, and generates with the needed version once it is complete."""
    queue = InMemoryTransferQueue()
    worker = _worker(model_dir, prompts=2)
    worker.update_weights([], start_version)  # what the resume sync would have pushed
    first_blocked = start_step + max_staleness + 1  # the first step that needs newer weights
    worker.start_producer(queue, start_step, first_blocked + 1, max_staleness, start_version)
    consumer = queue.open_session("test")
    for step in range(start_step, first_blocked):
        rows = consumer.get(partition_name(step), "actor", ["weight_version"], 16, timeout=60)
        assert {int(v) for v in rows.column("weight_version")} == {start_version}
    queue.clear(partition_name(start_step))  # as the loop does right after starting the broadcast
    _wait_until(lambda: worker.awaited_weight_version() == awaited, f"producer waiting for {awaited}")
    seen_waiting = time.perf_counter()
    # Half of the update arrives (the receiver stages buckets under the old version).
    state = worker.engine.model.state_dict()
    names = list(state)
    worker.stage_weights([(n, state[n] * 1.0) for n in names[: len(names) // 2]])
    assert worker.awaited_weight_version() == awaited
    assert partition_name(first_blocked) not in [p.name for p in queue.partitions()]
    assert worker.weight_version() == start_version
    worker.stage_weights([(n, state[n] * 1.0) for n in names[len(names) // 2 :]])
    completed = time.perf_counter()
    worker.commit_weights(awaited)  # the last bucket: now the update is complete
    rows = consumer.get(partition_name(first_blocked), "actor", ["weight_version"], 16, timeout=60)
    assert {int(v) for v in rows.column("weight_version")} == {awaited}
    # The step reports the wait for its weights: the producer was seen waiting before the test
    # staged the update and still waited when it completed, so its own measure (same clock)
    # covers at least that span, however fast or slow the host.
    first = worker.step_report(start_step)[0]
    waited = worker.step_report(first_blocked)[0]
    assert "time/rollout_wait_weights_s" in first and "time/rollout_wait_staleness_s" in waited
    assert waited["time/rollout_wait_weights_s"] >= completed - seen_waiting
    worker.stop_producer()
    assert worker.producer_error() is None


def _producer_waiting_for_version_1(model_dir: Path) -> RolloutWorker:
    """A strictly on-policy producer that made step 0 and now waits for the weights of step 1."""
    queue = InMemoryTransferQueue()
    worker = _worker(model_dir, prompts=2)
    worker.start_producer(queue, start_step=0, total_steps=2, max_staleness=0)
    queue.open_session("test").get(partition_name(0), "actor", ["tokens"], 16, timeout=60)
    queue.clear(partition_name(0))
    _wait_until(lambda: worker.awaited_weight_version() == 1, "producer waiting for version 1")
    return worker


def test_producer_waiting_for_weights_stops_when_asked(model_dir: Path) -> None:
    worker = _producer_waiting_for_version_1(model_dir)
    worker.stop_producer()
    assert worker._producer is not None and not worker._producer.is_alive()
    assert worker.producer_error() is None and worker.awaited_weight_version() is None


def test_producer_reports_a_failed_broadcast_and_a_missing_version(model_dir: Path) -> None:
    worker = _producer_waiting_for_version_1(model_dir)
    worker.weights_failed("WeightChannelTimeout: sender rank 0 published nothing within 3 s")
    _wait_until(lambda: worker.producer_error() is not None, "producer error")
    error = worker.producer_error()
    assert error is not None and "weight version 1" in error and "published nothing" in error
    worker.stop_producer()

    timed_out = _worker(model_dir, prompts=2, weights_timeout_s=0.05)
    timed_out.start_producer(InMemoryTransferQueue(), start_step=3, total_steps=4, max_staleness=0,
                             start_version=2)  # step 3 needs version 2; the engine has 0
    _wait_until(lambda: timed_out.producer_error() is not None, "producer error")
    error = timed_out.producer_error()
    assert error is not None and "for weight version 2 (engine has 0" in error
    timed_out.stop_producer()


def test_routing_replay_samples_carry_the_engines_routes(tmp_path: Path) -> None:
    from relax_hpc.data.rows import ROUTED_EXPERTS_FIELD, sample_to_row
    from relax_hpc.models.tiny_moe import write_tiny_moe_model

    moe = write_tiny_moe_model(tmp_path / "moe", seed=0)
    spec = parse_spec(f'[job]\nname = "r"\n[model]\npath = "{moe}"\n[data]\npath = "{REPO / "jobspecs/data/tiny_sum.jsonl"}"\n'
                      '[reward]\nfunction = "tiny_sum"\n[train]\nsteps = 1\n')
    rollout = dataclasses.replace(spec.rollout, prompts_per_step=2, n_samples_per_prompt=2, max_new_tokens=3,
                                  engine="native")
    common = dict(model=spec.model, data=spec.data, reward=spec.reward, rollout=rollout,
                  job=dataclasses.replace(spec.job, seed=3))
    replay = dataclasses.replace(spec.algorithm, routing_replay=True)
    samples, _ = RolloutWorker(RolloutConfig(**common, algorithm=replay)).generate(0)
    assert len(samples) == 4
    for s in samples:
        # [prompt + response - 1 fed tokens, 2 MoE layers, top-2], experts 0..7 in uint8
        assert s.routed_experts is not None and s.routed_experts.dtype == torch.uint8
        assert tuple(s.routed_experts.shape) == (len(s.prompt_ids) + len(s.response_ids) - 1, 2, 2)
        assert int(s.routed_experts.max()) < 8
        assert torch.equal(sample_to_row(s)[ROUTED_EXPERTS_FIELD], s.routed_experts)
    plain, _ = RolloutWorker(RolloutConfig(**common, algorithm=spec.algorithm)).generate(0)
    assert all(s.routed_experts is None and ROUTED_EXPERTS_FIELD not in sample_to_row(s) for s in plain)


def test_received_weights_stay_on_the_device_only_for_one_engine_that_binds_them(model_dir: Path) -> None:
    # One native engine in the process computes with the inbox's buffer in place; with several
    # engines (or SGLang servers, engine actors) each loads a copy of its own, so the role keeps
    # its buffers in host memory, off the GPUs the engines fill.
    single = _worker(model_dir)
    assert single.weight_home() is None
    two_engines = dataclasses.replace(single.cfg.rollout, num_engines=2)
    several = RolloutWorker(dataclasses.replace(single.cfg, rollout=two_engines))
    assert several.weight_home() == "cpu"
