"""benchmarks/step_model.py: the step-time model on costs chosen so that every prediction can be
worked out by hand (docs/scaling.md states the model). No measurement, no run."""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Iterator

import pytest
from bench_scripts import benchmark_module


@pytest.fixture(scope="module")
def model() -> Iterator[ModuleType]:
    with benchmark_module("step_model") as module:
        yield module


@pytest.fixture
def costs(model: ModuleType) -> object:
    return model.Costs(
        cores=2.0, gen_call_s=0.01, gen_sample_s=1e-4, remote_call_s=0.02, remote_sample_s=1e-4,
        reward_sample_s=1e-5, rows_sample_s=1e-5, put_row_s=2e-5, get_row_s=1e-5,
        train_fixed_s=0.02, train_sample_s=1e-4, broadcast_fixed_s=0.001, broadcast_byte_s=1e-8,
        snapshot_fixed_s=0.0, snapshot_byte_s=1e-9, engine_share_s=0.002, engine_load_s=0.004,
        ray_rt_s=0.001, queue_rt_s=0.0005, model_bytes=1_000_000, collective_s=0.001, param_tensors=16,
    )


# 256 samples (8 groups of 32), one micro-batch of 256, 1 MB of weights:
#   handoff 2 x 1 ms + 2 x 0.5 ms = 3 ms; broadcast 1 + 10 = 11 ms; snapshot 1 ms
#   one engine: 10 + 25.6 = 35.6 ms; reward + rows 256 x 20 us = 5.12 ms; put 5.12 ms; get 2.56 ms
#   train 20 + 25.6 = 45.6 ms
COLOCATE_1 = 0.003 + 0.011 + 0.0356 + 0.00512 + 0.00512 + 0.00256 + 0.0456 + 0.001  # 0.109


def test_colocate_one_engine_is_the_sum_of_every_part(model: ModuleType, costs: object) -> None:
    p = model.predict(costs, 1, 1, "colocate")
    assert p.step_s == pytest.approx(COLOCATE_1) == pytest.approx(0.109)
    assert p.bound == "serial"
    assert p.terms["generate"] == pytest.approx(0.0356)
    assert p.terms["install"] == 0.0
    assert model.predict_step_s(costs, 1, 1, "colocate") == pytest.approx(0.109)


def test_colocate_more_engines_cut_the_step_into_chunks_that_share_the_cores(model: ModuleType, costs: object) -> None:
    def two_chunks(engines: int, c: object = costs) -> float:
        return model.predict_step_s(c, engines, 1, "colocate", chunks_per_engine=2)

    # 2 engines: 4 chunks of 64, each pass 20 + 6.4 = 26.4 ms, 2 waves: 52.8 ms; install 2 + 4 x 2 / 2 = 6 ms
    assert two_chunks(2) == pytest.approx(COLOCATE_1 - 0.0356 + 0.0528 + 0.006)
    # 4 engines on 2 cores: 8 chunks of 32, each 23.2 ms, 8 / 2 = 4 waves: 92.8 ms; install 2 + 4 x 4 / 2 = 10 ms
    assert two_chunks(4) == pytest.approx(COLOCATE_1 - 0.0356 + 0.0928 + 0.010)
    # with 4 free cores the 8 chunks take 2 waves (each engine still makes 2 passes): 46.4 ms, install 6 ms
    four = dataclasses.replace(costs, cores=4.0)
    assert two_chunks(4, four) == pytest.approx(COLOCATE_1 - 0.0356 + 0.0464 + 0.006)
    # one chunk per engine (the spec's default): 2 engines, 2 chunks of 128, each 20 + 12.8 = 32.8 ms, one wave
    assert model.predict_step_s(costs, 2, 1, "colocate", chunks_per_engine=1) == pytest.approx(
        COLOCATE_1 - 0.0356 + 0.0328 + 0.006)
    # 4 engines: 4 chunks of 64 (26.4 ms each) on 2 cores: 2 waves, 52.8 ms; install 10 ms
    assert model.predict_step_s(costs, 4, 1, "colocate", chunks_per_engine=1) == pytest.approx(
        COLOCATE_1 - 0.0356 + 0.0528 + 0.010)
    assert model.CHUNKS_PER_ENGINE == 1  # what the real runs use: [rollout] chunks_per_engine's default


def test_async_is_the_slower_side_or_the_cores_whichever_binds(model: ModuleType, costs: object) -> None:
    # rollout side 35.6 + 5.12 + 5.12 = 45.84 ms; trainer side 2.56 + 45.6 + 1 = 49.16 ms;
    # CPU work 45.84 + 49.16 + 11 (broadcast) = 106 ms on 2 cores: 53 ms, which binds
    p = model.predict(costs, 1, 1, "async")
    assert p.step_s == pytest.approx(0.053)
    assert p.bound == "cores"
    assert p.terms["rollout side"] == pytest.approx(0.04584)
    assert p.terms["trainer side"] == pytest.approx(0.04916)
    # on 4 cores the trainer side binds
    four = dataclasses.replace(costs, cores=4.0)
    assert model.predict(four, 1, 1, "async").bound == "trainer"
    assert model.predict_step_s(four, 1, 1, "async") == pytest.approx(0.04916)
    # a slow engine: rollout side binds (generation 10 + 256 x 0.5 ms = 138 ms)
    slow = dataclasses.replace(four, gen_sample_s=5e-4)
    assert model.predict(slow, 1, 1, "async").bound == "rollout"
    assert model.predict_step_s(slow, 1, 1, "async") == pytest.approx(0.138 + 0.00512 + 0.00512)


def test_trainer_ranks_split_whole_micro_batches_and_pay_an_all_reduce(model: ModuleType, costs: object) -> None:
    # one micro-batch of 256: one rank trains it all (45.6 ms), plus the all-reduce:
    # (16 tensors + 4) collectives x 1 ms + 2 x 1 MB x 10 ns = 20 + 20 = 40 ms
    assert model.train_s(costs, 256, 2, 256) == pytest.approx(0.0856)
    # micro-batches of 64: 4 of them, 2 per rank: 20 + 12.8 ms each, both ranks busy on 2 cores
    assert model.train_s(costs, 256, 2, 64) == pytest.approx(0.0328 + 0.040)
    # 4 ranks on 2 cores: one micro-batch each (26.4 ms), at half speed: 52.8 ms, plus 40 ms
    assert model.train_s(costs, 256, 4, 64) == pytest.approx(2 * 0.0264 + 0.040)
    # colocate with 2 ranks and micro-batches of 64: train 72.8 ms in place of 45.6 ms
    assert model.predict_step_s(costs, 1, 2, "colocate", micro_batch=64) == pytest.approx(COLOCATE_1 - 0.0456 + 0.0728)


def test_parsing_configurations_and_fitting_a_line(model: ModuleType) -> None:
    configs = model.parse_configs("colocate:1:1, async:2:2")
    assert [(c.mode, c.engines, c.ranks) for c in configs] == [("colocate", 1, 1), ("async", 2, 2)]
    assert configs[1].label == "async e2 r2"
    with pytest.raises(ValueError):
        model.parse_configs("overlap:1:1")
    assert model.fit_line([(1.0, 3.0), (2.0, 5.0), (4.0, 9.0)]) == pytest.approx((1.0, 2.0))
    with pytest.raises(ValueError):
        model.predict_step_s(model.Costs(*[1.0] * 19), 1, 1, "overlap")
