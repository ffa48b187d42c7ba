"""Engine / trainer parity on the tiny multimodal models: the native engine's sampled log-probs
equal what the trainer (TorchBackend, the forward roles) recomputes for the same media, whatever
the padding side, the batch mix or the micro-batch split; the model reads the media; media markup
is never sampled; a text-only engine refuses media."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from relax_hpc.backends.batch import pack_rows
from relax_hpc.backends.torch_backend import TorchBackend
from relax_hpc.data.rows import row_to_sample, sample_to_row
from relax_hpc.data.sample import Sample
from relax_hpc.engines.base import Generation, SamplingParams
from relax_hpc.engines.native import NativeEngine
from relax_hpc.media.canonical import fit_image, fit_video
from relax_hpc.media.items import MediaItem, PromptMedia
from relax_hpc.media.positions import forward_kwargs
from relax_hpc.media.processor import MediaProcessor
from relax_hpc.models.hf import load_policy_model
from relax_hpc.models.tiny import write_tiny_model
from relax_hpc.models.tiny_mm import TINY_MM_ARCHS, write_tiny_multimodal
from relax_hpc.roles.forward import response_log_probs
from relax_hpc.spec.schema import AlgorithmSpec, TrainSpec

TOLERANCE = 1e-5  # float32 on CPU: the padding side and batch mix change summation order only
SAMPLING = SamplingParams(max_new_tokens=8, temperature=1.0)


@dataclass
class Rig:
    arch: str
    path: Path
    engine: NativeEngine
    backend: TorchBackend

    @property
    def processor(self) -> MediaProcessor:
        assert self.engine.media_processor is not None
        return self.engine.media_processor


@pytest.fixture(scope="module", params=TINY_MM_ARCHS)
def rig(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Rig:
    arch = request.param
    path = write_tiny_multimodal(tmp_path_factory.mktemp("parity") / arch, arch, seed=0)
    return Rig(arch, path, NativeEngine(path), TorchBackend(path, TrainSpec(steps=1), AlgorithmSpec()))


def _image(processor: MediaProcessor, seed: int) -> MediaItem:
    rng = np.random.default_rng(seed)
    return MediaItem("image", fit_image(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8), processor.geometry()))


def _video(processor: MediaProcessor) -> MediaItem:
    frames = np.random.default_rng(7).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    return MediaItem("video", fit_video(frames, processor.geometry()), rate=2.0)


def _audio() -> MediaItem:
    t = np.arange(16000) / 16000
    return MediaItem("audio", (0.5 * np.sin(2 * np.pi * 500 * t)).astype(np.float32), rate=16000)


def _prompt(rig: Rig, media: PromptMedia, text: str) -> list[int]:
    """Token ids of a user message with one content part per item, then the text, expanded."""
    tok = rig.engine.tokenizer
    content = [*({"type": i.kind} for i in media.items), {"type": "text", "text": text}]
    rendered = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                       tokenize=False)
    return rig.processor.expand(tok(rendered, add_special_tokens=False)["input_ids"], media)


def _mixed_prompts(rig: Rig) -> list[tuple[list[int], PromptMedia]]:
    """Image, video (families that read it), audio and image+audio (omni), and text only."""
    kinds = rig.processor.family.kinds
    image = _image(rig.processor, 0)
    cases = [PromptMedia((image,))]
    if "video" in kinds:
        cases.append(PromptMedia((_video(rig.processor),)))
    if "audio" in kinds:
        cases += [PromptMedia((_audio(),)), PromptMedia((image, _audio()))]
    prompts = [(_prompt(rig, media, "what is it?"), media) for media in cases]
    tok = rig.engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True, tokenize=False)
    prompts.append((tok(text, add_special_tokens=False)["input_ids"], PromptMedia()))
    return prompts


def _samples(prompts: list[tuple[list[int], PromptMedia]], gens: list[Generation]) -> list[Sample]:
    """The samples as the trainer receives them: through the transfer queue's row codec."""
    samples = [
        Sample(prompt_ids=g.prompt_ids, response_ids=g.token_ids, rollout_log_probs=g.logprobs, weight_version=0,
               group_id=i, prompt_index=i, media=media)
        for i, (g, (_, media)) in enumerate(zip(gens, prompts))
    ]
    return [row_to_sample(sample_to_row(s)) for s in samples]


@pytest.fixture(scope="module")
def rollout(rig: Rig) -> tuple[list[tuple[list[int], PromptMedia]], list[Sample]]:
    prompts = _mixed_prompts(rig)
    prompts.insert(1, prompts[0])  # the image prompt twice, as in a GRPO group: prefilled once for both rows
    # One generate call: the engine left-pads prompts of different lengths and media into one batch.
    gens = rig.engine.generate([p for p, _ in prompts], SAMPLING, seed=1, media=[m for _, m in prompts])
    return prompts, _samples(prompts, gens)


def _max_diff(a: list[float] | torch.Tensor, b: list[float]) -> float:
    a = a.tolist() if isinstance(a, torch.Tensor) else a
    assert len(a) == len(b) and a, (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


def test_mixed_batch_matches_the_trainer(rig: Rig, rollout: tuple[list, list[Sample]]) -> None:
    prompts, samples = rollout
    media_counts = [len(s.media.items) if s.media else 0 for s in samples]
    assert media_counts[-1] == 0 and all(media_counts[:-1])  # the codec kept every item
    assert len({len(p) for p, _ in prompts}) > 1  # prompts differ in length: padding is exercised
    recomputed = rig.backend.compute_log_probs(samples)  # one right-padded micro-batch of all rows
    for s, lp in zip(samples, recomputed):
        assert _max_diff(lp, s.rollout_log_probs) < TOLERANCE, s.media


def test_micro_batches_of_queue_rows_match(rig: Rig, rollout: tuple[list, list[Sample]]) -> None:
    _, samples = rollout
    batch = pack_rows([sample_to_row(s) for s in samples], rig.backend.pad_id)
    assert batch.media is not None
    for start in range(0, len(samples), 2):
        micro = batch.slice(start, start + 2)
        with torch.no_grad():
            logp, _ = rig.backend._logprobs(rig.backend.model, micro)
        for row, s in enumerate(samples[start : start + 2]):
            p, r = len(s.prompt_ids), len(s.response_ids)
            assert _max_diff(logp[row, p - 1 : p - 1 + r], s.rollout_log_probs) < TOLERANCE, (start, row)


def test_forward_role_matches(rig: Rig, rollout: tuple[list, list[Sample]]) -> None:
    _, samples = rollout
    model = load_policy_model(rig.path).eval()  # what ForwardWorker loads
    values = response_log_probs(model, samples, rig.backend.pad_id, 1.0, "cpu", MediaProcessor(rig.path))
    for s, lp in zip(samples, values):
        assert _max_diff(lp, s.rollout_log_probs) < TOLERANCE


def test_the_model_reads_the_image(rig: Rig, rollout: tuple[list, list[Sample]]) -> None:
    _, samples = rollout
    first = samples[0]
    assert first.media is not None and [i.kind for i in first.media.items] == ["image"]
    other = _image(rig.processor, 1)
    assert other.data.shape == first.media.items[0].data.shape  # same placeholders, other pixels
    swapped = Sample(**{**first.__dict__, "media": PromptMedia((other,))})
    before, after = rig.backend.compute_log_probs([first, swapped])
    assert _max_diff(after, before) > 1e-3


def test_markup_is_never_sampled(rig: Rig) -> None:
    prompts = _mixed_prompts(rig)
    markup = set(rig.processor.markup_ids)
    assert markup  # image / video placeholders, vision (and audio) start / end
    # Unmasked, the random model gives markup a real share of the mass, so sampling would find it.
    ids, media = prompts[0]
    input_ids = torch.tensor([ids])
    mask = torch.ones_like(input_ids)
    kwargs = forward_kwargs(rig.engine.model, rig.processor, input_ids, mask, rig.processor.batch_media([media]))
    with torch.no_grad():
        logits = rig.engine.model(input_ids=input_ids, attention_mask=mask, **kwargs).logits[0, -1]
    assert float(torch.softmax(logits, -1)[sorted(markup)].sum()) > 0.01
    sampled = []
    for seed in range(4):
        gens = rig.engine.generate([p for p, _ in prompts], SamplingParams(max_new_tokens=12, temperature=1.0),
                                   seed=seed, media=[m for _, m in prompts])
        sampled += [t for g in gens for t in g.token_ids]
    assert len(sampled) > 40 and not markup & set(sampled)


def test_text_only_engine_refuses_media(tmp_path: Path) -> None:
    engine = NativeEngine(write_tiny_model(tmp_path / "text", seed=0))
    image = MediaItem("image", np.zeros((16, 16, 3), np.uint8))
    prompt = engine.tokenizer("1+2=", add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="text-only and cannot read images, video or audio"):
        engine.generate([prompt], SAMPLING, seed=0, media=[PromptMedia((image,))])
    with pytest.raises(ValueError, match="got 1 prompts but 2 media entries"):
        engine.generate([prompt], SAMPLING, seed=0, media=[None, None])
    # No media in the entries: a text prompt of a multimodal job is fine.
    [gen] = engine.generate([prompt], SAMPLING, seed=0, media=[PromptMedia()])
    assert gen.token_ids

