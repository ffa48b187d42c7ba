"""NativeEngine on the tiny model: log-probs agree with the trainer's recomputation, stopping
rules, greedy decoding, seeding, and weight updates."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from relax_hpc.backends.torch_backend import TorchBackend
from relax_hpc.data.sample import Sample
from relax_hpc.engines.base import Generation, SamplingParams
from relax_hpc.engines.lean_decoder import LeanDecoder
from relax_hpc.engines.native import NativeEngine, distinct_prompts
from relax_hpc.media.items import MediaItem, PromptMedia
from relax_hpc.spec.schema import AlgorithmSpec, TrainSpec

# Prompts of 1, 4, 6 and 23 tokens: the batch is left-padded up to 23.
PROMPT_TEXTS = ("7", "1+2=", "12+34=", "<|im_start|>user:5+4=<|im_end|><|im_start|>assistant:")
# float32 engine (KV-cache, left-padded) vs trainer (full forward, right-padded); observed ~5e-7.
LOGPROB_TOL = 1e-5


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> NativeEngine:
    return NativeEngine(tiny_model_dir)


@pytest.fixture(scope="module")
def prompts(engine: NativeEngine) -> list[list[int]]:
    return [engine.tokenizer(t, add_special_tokens=False)["input_ids"] for t in PROMPT_TEXTS]


def _as_samples(gens: list[Generation]) -> list[Sample]:
    return [
        Sample(g.prompt_ids, g.token_ids, g.logprobs, g.weight_version, group_id=i, prompt_index=i)
        for i, g in enumerate(gens)
    ]


def _max_logprob_diff(gens: list[Generation], recomputed: list[list[float]]) -> float:
    diffs = [abs(a - b) for g, r in zip(gens, recomputed) for a, b in zip(g.logprobs, r, strict=True)]
    return max(diffs)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_logprobs_match_trainer_recomputation(
    engine: NativeEngine, prompts: list[list[int]], tiny_model_dir: Path, temperature: float
) -> None:
    params = SamplingParams(max_new_tokens=20, temperature=temperature, stop_token_ids=())
    gens = engine.generate(prompts, params, seed=11)
    assert len({len(p) for p in prompts}) == len(prompts)  # really different lengths
    assert all(len(g.logprobs) == len(g.token_ids) > 0 for g in gens)
    # micro_batch_size 3 splits the 4 samples into two trainer batches with different padding.
    backend = TorchBackend(
        tiny_model_dir, TrainSpec(steps=1, micro_batch_size=3), AlgorithmSpec(), temperature=temperature
    )
    recomputed = backend.compute_log_probs(_as_samples(gens))
    assert _max_logprob_diff(gens, recomputed) < LOGPROB_TOL
    # The comparison is sensitive: the trainer at another temperature is far off.
    other = TorchBackend(tiny_model_dir, TrainSpec(steps=1), AlgorithmSpec(), temperature=temperature * 2)
    assert _max_logprob_diff(gens, other.compute_log_probs(_as_samples(gens))) > 1e-3


def test_batched_equals_one_by_one(engine: NativeEngine, prompts: list[list[int]]) -> None:
    params = SamplingParams(max_new_tokens=12, top_k=1)
    batched = engine.generate(prompts, params)
    for prompt, gen in zip(prompts, batched):
        (alone,) = engine.generate([prompt], params)
        assert alone.token_ids == gen.token_ids
        assert alone.logprobs == pytest.approx(gen.logprobs, abs=LOGPROB_TOL)


def test_top_k_1_is_greedy(engine: NativeEngine, prompts: list[list[int]]) -> None:
    params = SamplingParams(max_new_tokens=10, top_k=1, temperature=0.8)
    gens = engine.generate(prompts, params, seed=0)
    for prompt, gen in zip(prompts, gens):
        # Manual greedy decode: a full forward over the whole sequence at each step.
        seq = list(prompt)
        expected: list[int] = []
        with torch.no_grad():
            for _ in range(len(gen.token_ids)):
                logits = engine.model(input_ids=torch.tensor([seq])).logits[0, -1]
                nxt = int(logits.argmax())
                expected.append(nxt)
                seq.append(nxt)
        assert gen.token_ids == expected
        if gen.finish_reason == "length":
            assert len(gen.token_ids) == 10


def test_stops_on_eos(engine: NativeEngine) -> None:
    # The random policy samples EOS with p ~ 1/48 per token, so over 8 x 64 tokens several rows
    # stop and the others run to the limit; both kinds are checked.
    prompts = [engine.tokenizer(f"{a}+{a}=", add_special_tokens=False)["input_ids"] for a in range(8)]
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=64), seed=5)
    eos = engine.tokenizer.eos_token_id
    stopped = [g for g in gens if g.finish_reason == "stop"]
    assert stopped, "no row sampled EOS; the test needs at least one"
    for g in gens:
        if g.finish_reason == "stop":
            assert g.token_ids[-1] == eos
            assert eos not in g.token_ids[:-1]
            assert g.text == engine.tokenizer.decode(g.token_ids[:-1], skip_special_tokens=False)
            assert "<|im_end|>" not in g.text
        else:
            assert g.finish_reason == "length"
            assert len(g.token_ids) == 64 and eos not in g.token_ids
            assert g.text == engine.tokenizer.decode(g.token_ids, skip_special_tokens=False)


def test_max_new_tokens_is_respected(engine: NativeEngine, prompts: list[list[int]]) -> None:
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=3), seed=1)
    eos = engine.tokenizer.eos_token_id
    for g in gens:
        assert 1 <= len(g.token_ids) <= 3
        # "length" exactly when the row ran to the limit without its last token being EOS.
        expected = "length" if len(g.token_ids) == 3 and g.token_ids[-1] != eos else "stop"
        assert g.finish_reason == expected
    assert any(g.finish_reason == "length" and len(g.token_ids) == 3 for g in gens)


def test_extra_stop_token_ids(engine: NativeEngine, prompts: list[list[int]]) -> None:
    free = engine.generate(prompts, SamplingParams(max_new_tokens=30), seed=2)
    target = free[1].token_ids[4]  # a token the unconstrained run samples at step 5
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=30, stop_token_ids=(target,)), seed=2)
    g, f = gens[1], free[1]
    cut = f.token_ids.index(target) + 1
    assert g.token_ids == f.token_ids[:cut] and g.finish_reason == "stop"
    assert g.text == engine.tokenizer.decode(g.token_ids[:-1], skip_special_tokens=False)


def test_stop_strings(engine: NativeEngine, prompts: list[list[int]]) -> None:
    tok = engine.tokenizer
    free = engine.generate(prompts, SamplingParams(max_new_tokens=30), seed=4)
    row = next(i for i, g in enumerate(free) if len(g.token_ids) >= 12)
    stop = tok.decode(free[row].token_ids[8:10])  # two plain characters sampled at steps 9-10
    assert len(stop) == 2
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=30, stop=(stop,)), seed=4)
    # Same seed and batch, so the samples agree up to the first point the stop string appears.
    for g, f in zip(gens, free):
        cut = next(
            (j + 1 for j in range(len(f.token_ids)) if stop in tok.decode(f.token_ids[: j + 1])),
            None,
        )
        if cut is None:
            assert g.token_ids == f.token_ids and g.finish_reason == f.finish_reason
        else:
            assert g.token_ids == f.token_ids[:cut]
            assert g.finish_reason == "stop"
    assert gens[row].finish_reason == "stop" and len(gens[row].token_ids) <= 10
    assert gens[row].text.endswith(stop)  # the stop string stays in the text


def test_seeds(engine: NativeEngine, prompts: list[list[int]]) -> None:
    params = SamplingParams(max_new_tokens=16)
    a = engine.generate(prompts, params, seed=7)
    b = engine.generate(prompts, params, seed=7)
    c = engine.generate(prompts, params, seed=8)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.logprobs for g in a] == [g.logprobs for g in b]
    assert [g.token_ids for g in a] != [g.token_ids for g in c]


def test_update_weights(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    engine = NativeEngine(tiny_model_dir)  # its own copy: the weights are changed below
    params = SamplingParams(max_new_tokens=8, top_k=1)
    before = engine.generate(prompts, params)
    assert engine.weight_version == 0 and all(g.weight_version == 0 for g in before)
    generator = torch.Generator().manual_seed(0)
    new = [
        (name, t + 0.5 * torch.randn(t.shape, generator=generator))
        for name, t in engine.model.state_dict().items()
    ]
    engine.update_weights(new, version=3)
    after = engine.generate(prompts, params)
    assert engine.weight_version == 3 and all(g.weight_version == 3 for g in after)
    assert [g.logprobs for g in after] != [g.logprobs for g in before]
    assert [g.token_ids for g in after] != [g.token_ids for g in before]
    name, tensor = new[1]
    assert torch.equal(engine.model.state_dict()[name], tensor)


def test_update_weights_unknown_name(tiny_model_dir: Path) -> None:
    engine = NativeEngine(tiny_model_dir)
    with pytest.raises(KeyError, match="'model.no_such.weight'"):
        engine.update_weights([("model.no_such.weight", torch.zeros(1))], version=1)
    assert engine.weight_version == 0


def test_empty_inputs(engine: NativeEngine) -> None:
    assert engine.generate([], SamplingParams()) == []
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[4, 5], []], SamplingParams())


def test_long_stop_string(engine: NativeEngine, prompts: list[list[int]]) -> None:
    # With a character-level tokenizer a 20-character stop string spans 20 tokens.
    tok = engine.tokenizer
    free = engine.generate(prompts, SamplingParams(max_new_tokens=40), seed=6)
    row = next(i for i, g in enumerate(free) if len(g.token_ids) >= 30 and 2 not in g.token_ids[:25])
    stop = tok.decode(free[row].token_ids[5:25])
    assert len(stop) >= 20
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=40, stop=(stop,)), seed=6)
    assert gens[row].finish_reason == "stop"
    assert gens[row].token_ids == free[row].token_ids[:25]


def test_the_lean_decoder_samples_what_the_hf_forward_samples(
    tiny_model_dir: Path, prompts: list[list[int]]
) -> None:
    lean, hf = NativeEngine(tiny_model_dir), NativeEngine(tiny_model_dir, lean=False)
    assert LeanDecoder.supports(lean.model)  # the tiny Qwen3 takes the lean path
    params = SamplingParams(max_new_tokens=24, temperature=1.0, stop_token_ids=())
    got, want = lean.generate(prompts, params, seed=5), hf.generate(prompts, params, seed=5)
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    assert _max_logprob_diff(got, [g.logprobs for g in want]) < LOGPROB_TOL


def test_a_model_outside_the_llama_family_takes_the_hf_forward(tiny_model_dir: Path) -> None:
    engine = NativeEngine(tiny_model_dir)
    engine.model.config.model_type = "gpt2"  # what the lean decoder does not know
    assert not LeanDecoder.supports(engine.model)
    with warnings.catch_warnings():  # the cache under the name this transformers takes (models/hf.py)
        warnings.simplefilter("error", FutureWarning)
        gens = engine.generate([[5, 6], [5, 6]], SamplingParams(max_new_tokens=3), seed=1)  # a shared prefill
    assert all(len(g.token_ids) >= 1 for g in gens)


def test_distinct_prompts_by_tokens_and_media() -> None:
    red, blue = (MediaItem("image", np.full((4, 4, 3), v, np.uint8)) for v in (200, 10))
    red_again = MediaItem("image", np.full((4, 4, 3), 200, np.uint8))  # another object, same pixels
    prompts = [[1, 2], [3], [1, 2], [1, 2], [3], [1, 2]]
    media = [PromptMedia((red,)), None, PromptMedia((red_again,)), PromptMedia((blue,)), None, None]
    assert distinct_prompts(prompts) == ([0, 1], [0, 1, 0, 0, 1, 0])
    # Same tokens with other media (or none) are other prompts; equal pixels are the same medium.
    assert distinct_prompts(prompts, media) == ([0, 1, 3, 5], [0, 1, 0, 2, 1, 3])


@pytest.mark.parametrize("lean", [True, False])
def test_a_repeated_prompt_is_prefilled_once_and_each_row_samples_on_its_own(
        tiny_model_dir: Path, prompts: list[list[int]], lean: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = NativeEngine(tiny_model_dir, lean=lean)
    prefill_rows: list[int] = []
    if lean:
        real_prefill = LeanDecoder.prefill

        def prefill(self: LeanDecoder, input_ids: torch.Tensor, *args: object) -> torch.Tensor:
            prefill_rows.append(input_ids.shape[0])
            return real_prefill(self, input_ids, *args)

        monkeypatch.setattr(LeanDecoder, "prefill", prefill)
    else:
        engine.model.model.register_forward_hook(lambda _m, _a, kw, _o: prefill_rows.append(kw["input_ids"].shape[0])
                                                 if kw["input_ids"].shape[1] > 1 else None, with_kwargs=True)
    group = 16
    batch = [p for p in prompts for _ in range(group)]  # 4 prompts x 16 samples, as a GRPO step sends them
    gens = engine.generate(batch, SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=()), seed=3)
    assert prefill_rows == [len(prompts)]
    assert [g.prompt_ids for g in gens] == batch
    for k in range(len(prompts)):  # each row drew its own tokens from its prompt's distribution
        assert len({tuple(g.token_ids) for g in gens[k * group:(k + 1) * group]}) > group // 2
    backend = TorchBackend(tiny_model_dir, TrainSpec(steps=1, micro_batch_size=64), AlgorithmSpec())
    assert _max_logprob_diff(gens, backend.compute_log_probs(_as_samples(gens))) < LOGPROB_TOL
    # Greedy, every row of a prompt is that prompt's one greedy answer.
    greedy = engine.generate(batch, SamplingParams(max_new_tokens=8, top_k=1), seed=0)
    alone = engine.generate(prompts, SamplingParams(max_new_tokens=8, top_k=1), seed=0)
    assert [g.token_ids for g in greedy] == [a.token_ids for a in alone for _ in range(group)]
