"""Images and audio through the agent paths, on a tiny Qwen2.5-Omni model and the native engine:
OpenAI content parts sent with the official SDK through the real proxy, and the image
observations of an environment, reach the engine with every turn; the exported samples carry
them; the trainer's recomputed log-probs match the engine's; and media that cannot be used get a
400 that names the part and says what to send."""

from __future__ import annotations

import asyncio
import base64
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image

from relax_hpc.agents.batcher import EngineBatcher
from relax_hpc.agents.media import offered_parts
from relax_hpc.agents.multiturn import GenerateArgs, generate_with_env, run_generate
from relax_hpc.agents.service import AgenticRollout
from relax_hpc.backends.torch_backend import TorchBackend
from relax_hpc.data.dataset import PromptRow, load_dataset
from relax_hpc.data.rows import row_to_sample, sample_to_row
from relax_hpc.data.sample import Sample
from relax_hpc.engines.base import Generation, SamplingParams
from relax_hpc.engines.native import NativeEngine
from relax_hpc.media.canonical import fit_image
from relax_hpc.media.encode import data_url, encode_audio_wav, encode_image_png
from relax_hpc.media.items import MediaItem, PromptMedia
from relax_hpc.media.processor import MediaProcessor
from relax_hpc.models.hf import load_tokenizer
from relax_hpc.models.tiny_mm import write_tiny_multimodal
from relax_hpc.spec.schema import AlgorithmSpec, DataSpec, RolloutSpec, TrainSpec
from agent_doubles import (ForwardedMessagesAgent, ImageEnv, OfferedMediaAgent, ScriptedEngine, observation_image,
                           tiny_tokenizer)

TOLERANCE = 1e-5  # float32 on CPU, as tests/media/test_media_parity.py
SINE = (0.5 * np.sin(2 * np.pi * 500 * np.arange(16000) / 16000)).astype(np.float32)  # 1 s at 16 kHz


@dataclass
class Omni:
    engine: NativeEngine
    backend: TorchBackend

    @property
    def processor(self) -> MediaProcessor:
        assert self.engine.media_processor is not None
        return self.engine.media_processor

    def rollout(self, cfg: RolloutSpec, engine: Any = None) -> AgenticRollout:
        params = SamplingParams(max_new_tokens=4, stop_token_ids=(self.engine.eos_id,))
        return AgenticRollout(cfg, engine or self.engine, self.engine.tokenizer, params, self.engine.eos_id, 512,
                              media_processor=self.processor)

    def fitted(self, pixels: np.ndarray) -> MediaItem:
        return MediaItem("image", fit_image(pixels, self.processor.geometry()))


@pytest.fixture(scope="module")
def omni(tmp_path_factory: pytest.TempPathFactory) -> Omni:
    path = write_tiny_multimodal(tmp_path_factory.mktemp("agents") / "omni", "qwen2_5_omni", seed=0)
    return Omni(NativeEngine(path), TorchBackend(path, TrainSpec(steps=1), AlgorithmSpec()))


def pixels(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (40, 56, 3), dtype=np.uint8)


def image_url(image: np.ndarray) -> str:
    return data_url(encode_image_png(image), "image/png")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def through_queue(samples: list[Sample]) -> list[Sample]:
    """The samples as the trainer receives them: through the transfer queue's row codec."""
    return [row_to_sample(sample_to_row(s)) for s in samples]


def trained_diff(recomputed: list[float], sample: Sample) -> float:
    """The largest difference on the tokens the sample trains (the model's own)."""
    return max(abs(recomputed[i] - sample.rollout_log_probs[i]) for i, m in enumerate(sample.mask()) if m)


def test_agent_images_and_audio_reach_the_engine_and_the_trainer(omni: Omni) -> None:
    images = [pixels(0), pixels(1)]
    row = PromptRow(0, [], "look", "x", {"images": [image_url(p) for p in images],
                                         "audio": b64(encode_audio_wav(SINE, 16000))})
    svc = omni.rollout(RolloutSpec(agent="agent_doubles:MediaChatAgent"))
    try:
        [[first, second]], _ = svc.generate_groups([row], 1, seed=5, first_group_id=1)
    finally:
        svc.close()
    shown = [omni.fitted(p) for p in images]
    # Turn 1 carried the image and the clip; turn 2 re-sent them with the second image.
    assert first.media == PromptMedia((shown[0], *first.media.of("audio")))
    assert second.media == PromptMedia((*shown, *first.media.of("audio")))
    [clip] = first.media.of("audio")
    assert clip.rate == 16000 and np.abs(clip.data - SINE).max() <= 1 / 32768  # the WAV's 16-bit steps
    placeholders = omni.processor.placeholders
    for s in (first, second):  # each placeholder expanded to its medium's token count
        assert s.prompt_ids.count(placeholders.image) == sum(map(omni.processor.token_count, s.media.of("image")))
        assert s.prompt_ids.count(placeholders.audio) == omni.processor.token_count(clip)
    samples = through_queue([first, second])
    for s, recomputed in zip(samples, omni.backend.compute_log_probs(samples)):
        assert trained_diff(recomputed, s) < TOLERANCE
    # Another image of the same size: the same tokens, other log-probs: the model reads the pixels.
    swapped = replace(samples[1], media=PromptMedia((shown[0], omni.fitted(pixels(2)), clip)))
    assert trained_diff(omni.backend.compute_log_probs([swapped])[0], samples[1]) > 1e-3


def test_media_the_proxy_cannot_use_get_400_naming_the_part(omni: Omni) -> None:
    svc = omni.rollout(RolloutSpec(agent="agent_doubles:ChatAgent"))
    try:
        assert svc.proxy is not None
        session = svc.proxy.sessions.open()
        client = openai.OpenAI(base_url=svc.proxy.base_url, api_key=session.api_key, max_retries=0)

        def refused(part: dict[str, Any], role: str = "user") -> str:
            messages = [{"role": role, "content": [{"type": "text", "text": "hi"}, part]}]
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="policy", messages=messages)  # type: ignore[arg-type]
            message = e.value.body["message"]  # type: ignore[index]
            assert message.startswith("messages[0].content[1]: "), message
            return message

        def image(url: str) -> dict[str, Any]:
            return {"type": "image_url", "image_url": {"url": url}}

        remote = refused(image("https://example.com/cat.png"))
        assert "https:// URL, which the proxy does not fetch" in remote and "data:image/png;base64" in remote
        assert "must be a data: URL" in refused(image("file:///etc/hostname"))
        assert "not valid base64" in refused(image("data:image/png;base64,@@not base64@@"))
        assert "corrupt image" in refused(image("data:image/png;base64," + b64(b"\x89PNG truncated")))
        assert "corrupt audio" in refused({"type": "input_audio", "input_audio": {"data": b64(b"RIFF?"),
                                                                                  "format": "wav"}})
        assert "not accepted in assistant messages" in refused(image(image_url(pixels(0))), role="assistant")
        assert session.completions == []
        # The same session still works; usage counts the image's expanded placeholders.
        ok = client.chat.completions.create(model="policy", messages=[
            {"role": "user", "content": [image(image_url(pixels(0))), {"type": "text", "text": "hi"}]}])
        [record] = session.completions
        assert ok.usage is not None and ok.usage.prompt_tokens == len(record.prompt_ids)
        assert record.media == PromptMedia((omni.fitted(pixels(0)),))
    finally:
        svc.close()


def test_models_that_cannot_read_a_kind_refuse_it(tmp_path: Any) -> None:
    tok = tiny_tokenizer()
    eos = int(tok.eos_token_id)
    params = SamplingParams(max_new_tokens=4, stop_token_ids=(eos,))
    vl = write_tiny_multimodal(tmp_path / "vl", "qwen2_5_vl")
    vl_tok = load_tokenizer(vl)
    cases = [
        (tok, None, {"type": "image_url", "image_url": {"url": image_url(pixels(0))}}, "the model reads text only"),
        (vl_tok, MediaProcessor(vl),
         {"type": "input_audio", "input_audio": {"data": b64(encode_audio_wav(SINE, 16000))}},
         "qwen2_5_vl does not read audio; it reads image, video"),
    ]
    for tokenizer, processor, part, needle in cases:
        engine = ScriptedEngine(tokenizer, ["ab"])
        svc = AgenticRollout(RolloutSpec(agent="agent_doubles:ChatAgent"), engine, tokenizer, params,
                             engine.eos_id, media_processor=processor)
        try:
            assert svc.proxy is not None
            session = svc.proxy.sessions.open()
            client = openai.OpenAI(base_url=svc.proxy.base_url, api_key=session.api_key, max_retries=0)
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="policy", messages=[{"role": "user", "content": [part]}])
            assert needle in e.value.body["message"]  # type: ignore[index]
            assert engine.produced == []
            # Text parts are served as before; a text model's records carry no media.
            client.chat.completions.create(model="policy", messages=[
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}])
            assert [r.media for r in session.completions] == [None if processor is None else PromptMedia()]
        finally:
            svc.close()
    # An environment that shows an image to a text model stops the episode with the reason.
    args = GenerateArgs(EngineBatcher(ScriptedEngine(tok, ["ab"])), tok, ImageEnv,
                        RolloutSpec(max_turns=3, max_total_tokens=200), eos)
    episode = Sample(prompt_ids=tok.encode("hi", add_special_tokens=False), response_ids=[], rollout_log_probs=[],
                     weight_version=0, group_id=1, prompt_index=0, label="7")
    with pytest.raises(ValueError, match="observation part 0 is media \\(image\\), but the model reads text only"):
        asyncio.run(run_generate(generate_with_env, args, [episode], params, seed=1))


class RecordingEngine:
    """The native engine, with each call's prompts and media kept."""

    def __init__(self, engine: NativeEngine) -> None:
        self.engine = engine
        self.calls: list[tuple[list[list[int]], list[PromptMedia | None] | None]] = []
        self.outputs: list[list[Generation]] = []  # each call's generations

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None,
                 media: list[PromptMedia | None] | None = None) -> list[Generation]:
        self.calls.append(([list(p) for p in prompts], media))
        self.outputs.append(self.engine.generate(prompts, params, seed, media=media))
        return self.outputs[-1]


def test_image_observations_reach_the_engine_and_the_trainer(omni: Omni) -> None:
    tok = omni.engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "look"}], add_generation_prompt=True, tokenize=False)
    row = PromptRow(0, tok.encode(text, add_special_tokens=False), "look", "7", {})
    engine = RecordingEngine(omni.engine)
    svc = omni.rollout(RolloutSpec(env="agent_doubles:ImageEnv", max_turns=3), engine)
    try:
        [[s]], _ = svc.generate_groups([row], 1, seed=3, first_group_id=1)
    finally:
        svc.close()
    # ImageEnv showed a numpy image after turn 1 and a PIL image after turn 2, then ended.
    shown = [omni.fitted(observation_image(7, turn)) for turn in (1, 2)]
    assert s.metadata["num_turns"] == 3 and s.media == PromptMedia(tuple(shown))
    image, per_image = omni.processor.placeholders.image, [omni.processor.token_count(i) for i in shown]
    assert len(engine.calls) == 3
    for k, ([prompt], media) in enumerate(engine.calls):  # turn k+1 saw the k images shown so far
        assert prompt.count(image) == sum(per_image[:k])
        assert (media[0].of("image") if media else ()) == tuple(shown[:k])  # type: ignore[union-attr]
    # The observations are in the response, masked; the prompt is the row's.
    assert s.prompt_ids == row.prompt_ids
    assert [t for t, m in zip(s.response_ids, s.mask()) if not m].count(image) == sum(per_image)
    [sample] = through_queue([s])
    assert trained_diff(omni.backend.compute_log_probs([sample])[0], sample) < TOLERANCE
    # The first image blanked: the turns after it get other log-probs: the model read it.
    blank = replace(sample, media=PromptMedia((MediaItem("image", np.zeros_like(shown[0].data)), shown[1])))
    assert trained_diff(omni.backend.compute_log_probs([blank])[0], sample) > 1e-3


def media_row(omni: Omni, tmp_path: Path) -> PromptRow:
    """A data set row with an image and an audio clip, read by the loader: the 50x37 image is
    resized to the patch grid and the 22.05 kHz clip resampled to 16 kHz, so both are changed by
    canonicalisation and a part that came back as anything else would differ."""
    Image.fromarray(pixels(3)[:50, :37]).save(tmp_path / "cat.png")
    clip = (0.4 * np.sin(2 * np.pi * 300 * np.arange(11025) / 22050)).astype(np.float32)
    (tmp_path / "clip.wav").write_bytes(encode_audio_wav(clip, 22050))
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": "look, listen", "answer": "x", "image": "cat.png",
                                                     "audio": "clip.wav"}) + "\n")
    [row], _ = load_dataset(DataSpec(path=str(tmp_path / "rows.jsonl"), prompt_key="prompt", label_key="answer",
                                     image_key="image", audio_key="audio"), omni.engine.tokenizer, omni.processor)
    return row


def test_a_rows_media_reach_the_agent_and_come_back_in_its_samples(omni: Omni, tmp_path: Path) -> None:
    row, text_row = media_row(omni, tmp_path), PromptRow(1, [], "no media here", "y", {})
    assert row.media is not None and [i.kind for i in row.media.items] == ["image", "audio"]
    image, clip = row.media.items
    assert image.data.shape[:2] != (50, 37) and clip.data.size != 11025  # both were canonicalised
    engine, OfferedMediaAgent.offered = RecordingEngine(omni.engine), []
    svc = omni.rollout(RolloutSpec(agent="agent_doubles:OfferedMediaAgent", agent_export_style="concat"), engine)
    try:
        [samples, text_samples], _ = svc.generate_groups([row, text_row], 1, seed=4, first_group_id=1)
    finally:
        svc.close()
    # The media row was offered an image part and an audio part, the text row nothing.
    [parts] = [p for p in OfferedMediaAgent.offered if p]
    assert [p["type"] for p in parts] == ["image_url", "input_audio"] and len(OfferedMediaAgent.offered) == 2
    assert parts[0]["image_url"]["url"].startswith("data:image/png;base64,")
    assert parts[1]["input_audio"]["format"] == "wav"
    # Every engine call of the media session saw exactly the row's pixels and samples.
    calls = sorted(((p, m, g) for c, o in zip(engine.calls, engine.outputs) for p, m, g in zip(*c, o)
                    if m), key=lambda call: len(call[0]))  # type: ignore[arg-type]
    assert len(calls) == 2 and all(m == row.media for _, m, _ in calls)
    placeholders = omni.processor.placeholders
    assert calls[0][0].count(placeholders.image) == omni.processor.token_count(image)
    assert calls[0][0].count(placeholders.audio) == omni.processor.token_count(clip)
    gens = [g for _, _, g in calls]
    for s in samples:
        assert s.media is not None and [i.kind for i in s.media.items] == ["image", "audio"]
        assert np.array_equal(s.media.items[0].data, image.data) and np.array_equal(s.media.items[1].data, clip.data)
        assert s.media == row.media and s.media.items[1].rate == clip.rate
        # The trained tokens are the model's replies, nothing of the prompt, media or chat turns between.
        mine = [gens.pop(0) for _ in s.metadata["completion_ids"]]
        assert [t for t, m in zip(s.response_ids, s.mask()) if m] == [t for g in mine for t in g.token_ids]
        assert [lp for lp, m in zip(s.rollout_log_probs, s.mask()) if m] == [lp for g in mine for lp in g.logprobs]
        assert all(lp == 0.0 for lp, m in zip(s.rollout_log_probs, s.mask()) if not m)
    assert gens == [] and samples[0].prompt_ids == calls[0][0]
    # Seeded: the second request extended the first, so the user turn between the replies is masked.
    assert len(samples) == 1 and 0 in samples[0].mask()
    [trained] = through_queue(samples[:1])
    assert trained.media == row.media
    assert trained_diff(omni.backend.compute_log_probs([trained])[0], trained) < TOLERANCE
    assert text_samples and all(s.media == PromptMedia() for s in text_samples)


def test_an_agent_forwarding_its_rows_messages_prompts_the_engine_exactly_as_the_loader_did(
        omni: Omni, tmp_path: Path) -> None:
    row, text_row = media_row(omni, tmp_path), PromptRow(1, [], "no media here", "y", {})
    engine, ForwardedMessagesAgent.messages = RecordingEngine(omni.engine), []
    svc = omni.rollout(RolloutSpec(agent="agent_doubles:ForwardedMessagesAgent"), engine)
    try:
        svc.generate_groups([row, text_row], 1, seed=4, first_group_id=1)
    finally:
        svc.close()
    # The row's own chat message, untemplated, its media placeholders now the offered parts; a
    # plain-text row is one user message of its text.
    media_messages, text_messages = ForwardedMessagesAgent.messages
    assert media_messages == [{"role": "user", "content": [*offered_parts(row.media),
                                                           {"type": "text", "text": "look, listen"}]}]
    assert text_messages == [{"role": "user", "content": "no media here"}]
    # Templated by the proxy, they are the loader's prompt token for token, with the row's media.
    [call] = [(p, m) for prompts, media in engine.calls for p, m in zip(prompts, media or [None] * len(prompts)) if m]
    assert call == (row.prompt_ids, row.media)


def test_a_malformed_part_sent_back_gets_400_naming_its_message_and_part(omni: Omni, tmp_path: Path) -> None:
    row = media_row(omni, tmp_path)
    svc = omni.rollout(RolloutSpec(agent="agent_doubles:ChatAgent"))
    try:
        assert svc.proxy is not None
        session = svc.proxy.sessions.open()
        client = openai.OpenAI(base_url=svc.proxy.base_url, api_key=session.api_key, max_retries=0)
        good = offered_parts(row.media)

        def refused(parts: list[dict[str, Any]]) -> str:
            messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes?"},
                        {"role": "user", "content": [{"type": "text", "text": "see"}, *parts]}]
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="policy", messages=messages)  # type: ignore[arg-type]
            return e.value.body["message"]  # type: ignore[index]

        no_comma = {"type": "image_url", "image_url": {"url": "data:image/png;base64"}}
        assert refused([no_comma, good[1]]).startswith("messages[2].content[1]: cannot use this image: malformed "
                                                       "data URL: no ','")
        bad_audio = {"type": "input_audio", "input_audio": {"data": "%%" + good[1]["input_audio"]["data"],
                                                            "format": "wav"}}
        message = refused([good[0], bad_audio])
        assert message.startswith("messages[2].content[2]: cannot use this audio: ") and "not valid base64" in message
        assert session.completions == []
        # The offered parts themselves are served, and recorded with the row's media.
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": good}])
        assert [r.media for r in session.completions] == [row.media]
    finally:
        svc.close()
