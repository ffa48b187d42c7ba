"""The RolloutEngine contract, held by the native engine and by the in-memory twin alike; the
factory; and the rollout role driving an engine it was handed."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest

from relax_hpc.engines.base import RolloutEngine, SamplingParams
from relax_hpc.engines.factory import make_engine
from relax_hpc.engines.memory import ScriptedEngine
from relax_hpc.engines.native import NativeEngine

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["native", "scripted"])
def engine(request: pytest.FixtureRequest, tiny_model_dir: Path) -> RolloutEngine:
    native = NativeEngine(tiny_model_dir)
    return native if request.param == "native" else ScriptedEngine(native.tokenizer, ["7", "12"])


def _new_weights(engine: Any) -> list[tuple[str, Any]]:
    model = getattr(engine, "model", None)
    return [(n, p.detach().clone()) for n, p in model.named_parameters()] if model is not None else []


def test_generations_report_the_version_of_the_last_update(engine: RolloutEngine) -> None:
    params = SamplingParams(max_new_tokens=3)
    assert {g.weight_version for g in engine.generate([[5, 6], [7]], params, seed=1)} == {engine.weight_version}
    engine.update_weights(_new_weights(engine), version=4)
    generations = engine.generate([[5, 6]], params, seed=1)
    assert engine.weight_version == 4 and generations[0].weight_version == 4
    assert len(generations[0].token_ids) == len(generations[0].logprobs) <= 3
    assert isinstance(engine.eos_id, int) and isinstance(engine.tokenizer.decode([engine.eos_id]), str)


def test_pause_holds_new_generations_until_resume(engine: RolloutEngine) -> None:
    engine.pause()
    done = threading.Event()
    thread = threading.Thread(target=lambda: (engine.generate([[5]], SamplingParams(max_new_tokens=2)), done.set()))
    thread.start()
    thread.join(0.3)
    assert thread.is_alive() and not done.is_set()  # held while paused
    engine.resume()
    thread.join(30)
    assert done.is_set()


def test_release_and_resume_memory(engine: RolloutEngine) -> None:
    # What the rollout role does around a colocated training step: release, resume, new weights.
    weights = ([(n, t.detach().clone()) for n, t in engine.model.state_dict().items()]
               if isinstance(engine, NativeEngine) else [])
    before = engine.generate([[5]], SamplingParams(max_new_tokens=3), seed=11)
    freed = engine.release_memory()
    assert freed >= 0 and engine.release_memory() == 0  # a second release frees nothing more
    with pytest.raises(RuntimeError, match=r"call resume_memory\(\) before generate\(\)"):
        engine.generate([[5]], SamplingParams(max_new_tokens=2))
    engine.resume_memory()
    engine.update_weights(weights, engine.weight_version)
    after = engine.generate([[5]], SamplingParams(max_new_tokens=3), seed=11)
    assert len(after) == 1
    if isinstance(engine, NativeEngine):  # the same weights back: the same tokens
        assert after[0].token_ids == before[0].token_ids


def test_a_cpu_engine_frees_its_weights_and_refuses_to_generate_until_new_ones_arrive(
    tiny_model_dir: Path,
) -> None:
    engine = NativeEngine(tiny_model_dir)
    weights = [(n, t.detach().clone()) for n, t in engine.model.state_dict().items()]
    param_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert engine.release_memory() == param_bytes
    assert all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())
    engine.resume_memory()
    assert all(p.numel() > 0 for p in engine.model.parameters())
    with pytest.raises(RuntimeError, match=r"dropped its weights.*install new weights"):
        engine.generate([[5]], SamplingParams(max_new_tokens=2))
    engine.update_weights(weights, 1)
    assert engine.generate([[5]], SamplingParams(max_new_tokens=2))[0].weight_version == 1


def test_factory_builds_the_named_engine_and_names_what_is_allowed(tiny_model_dir: Path) -> None:
    assert isinstance(make_engine("native", str(tiny_model_dir)), NativeEngine)
    # SGLang engines are servers the rollout role starts (sglang/fleet.py), not built in place.
    with pytest.raises(ValueError, match=r"SGLang engines are server processes that the rollout role starts"):
        make_engine("sglang", str(tiny_model_dir))
    with pytest.raises(ValueError, match=r"rollout.engine = 'vllm': allowed values are native, sglang"):
        make_engine("vllm", str(tiny_model_dir))


def test_the_scripted_engine_can_fail_its_first_calls(tiny_model_dir: Path) -> None:
    engine = ScriptedEngine(NativeEngine(tiny_model_dir).tokenizer, ["3"], fail_first=1)
    with pytest.raises(RuntimeError, match="simulated"):
        engine.generate([[1]], SamplingParams())
    assert engine.generate([[1]], SamplingParams())[0].text == "3"


def test_the_rollout_role_drives_the_engine_it_is_given(tiny_model_dir: Path) -> None:
    from relax_hpc.roles.rollout import RolloutConfig, RolloutWorker
    from relax_hpc.spec import parse_spec

    spec = parse_spec(f'[job]\nname = "r"\n[model]\npath = "{tiny_model_dir}"\n'
                      f'[data]\npath = "{REPO / "jobspecs/data/tiny_sum.jsonl"}"\n'
                      '[reward]\nfunction = "tiny_sum"\n[train]\nsteps = 1\n')
    rollout = dataclasses.replace(spec.rollout, prompts_per_step=2, n_samples_per_prompt=4, max_new_tokens=3)
    cfg = RolloutConfig(model=spec.model, data=spec.data, reward=spec.reward, rollout=rollout,
                        algorithm=spec.algorithm, job=dataclasses.replace(spec.job, seed=3))
    scripted = ScriptedEngine(NativeEngine(tiny_model_dir).tokenizer, ["7"], version=0)
    worker = RolloutWorker(cfg, engine=scripted)
    try:
        samples, _ = worker.generate(0)
    finally:
        worker.rewards.close()
    assert len(scripted.calls) == 1 and len(samples) == 8
    assert all(s.response_text == "7" for s in samples)
    assert {s.reward for s in samples} <= {0.0, 1.0}  # tiny_sum scored the scripted "7"
