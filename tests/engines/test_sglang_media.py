"""Media through `SGLangEngine` (relax_hpc/engines/sglang/engine.py): unexpanded prompts and data URLs
out, the server's expansion checked on the way back, markup never sampled, refusals that name the
fix, and weights renamed to the checkpoint names SGLang's loaders read.

The first tests need no SGLang: the engine talks to a stand-in for the server's HTTP calls that
expands placeholders as SGLang's processor does (`MediaProcessor.expand` of the single
placeholders). The ones marked `sglang` start one real SGLang 0.5.23 server on CPU for a tiny
Qwen2.5-VL model (about 25 s, and about 35 s more for its first image request, on 2 cores):

    RELAX_TEST_SGLANG=1 .venv/bin/python -m pytest tests/engines/test_sglang_media.py -q

SGLang's Qwen2.5-VL reads image patch rows only 3*2*14*14 = 1176 wide (others are taken for
precomputed embeddings), so the tiny model is built with the real patch size 14
(`write_tiny_multimodal(..., patch_size=14)`; the other tiny models use 8).
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from side_env import SGLANG

from relax_hpc.engines.sglang import requests as requests
from relax_hpc.engines.base import SamplingParams
from relax_hpc.engines.http.client import EngineHttpError
from relax_hpc.engines.sglang.engine import SGLangEngine
from relax_hpc.engines.sglang.fleet import ManagedSGLangEngine, SGLangLaunch
from relax_hpc.engines.sglang.weights import checkpoint_named
from relax_hpc.media.items import MediaItem, PromptMedia
from relax_hpc.media.processor import MediaProcessor
from relax_hpc.models.hf import checkpoint_state_dict, load_policy_model, load_tokenizer
from relax_hpc.models.tiny_mm import mm_token_ids, write_tiny_multimodal
from relax_hpc.spec.schema import SGLangSpec

HERE = Path(__file__).resolve().parent
URL = "http://sglang-media-test:30000"
GREEDY = SamplingParams(max_new_tokens=4, temperature=1.0, top_k=1)


def _image(seed: int, side: int = 32) -> MediaItem:
    return MediaItem("image", np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8))


def _video(seed: int) -> MediaItem:
    frames = np.random.default_rng(seed).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    return MediaItem("video", frames, rate=2.0)


def _audio(seed: int) -> MediaItem:
    wave = 0.3 * np.sin(np.arange(16000) * (0.05 + 0.01 * seed)).astype(np.float32)
    return MediaItem("audio", wave, rate=16000.0)


def _prompt(model_dir: Path, media: PromptMedia | None, text: str) -> list[int]:
    """The chat-template prompt of `text` after `media`'s parts, placeholders expanded."""
    parts: list[dict[str, Any]] = [{"type": item.kind} for item in (media.items if media else ())]
    ids = load_tokenizer(model_dir).apply_chat_template(
        [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}], add_generation_prompt=True,
        tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return MediaProcessor(model_dir).expand(ids, media) if media else ids


def _decode_png(url: str) -> np.ndarray:
    assert url.startswith("data:image/png;base64,")
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))


class FakeServer:
    """The HTTP calls of an SGLang server: `/generate` expands the single placeholders of prompt i
    as SGLang's processor does (`MediaProcessor.expand` with `media[i]`), or with `expand` when
    given, and answers one token; each body is recorded."""

    def __init__(self, model_dir: Path, device: str | None, media: Sequence[PromptMedia | None],
                 expand: Any) -> None:
        self.model_dir, self.device, self.media, self.expand = model_dir, device, media, expand
        self.bodies: list[dict[str, Any]] = []

    def expanded(self, i: int, ids: list[int]) -> list[int]:
        if self.expand is not None:
            return self.expand(i, ids)
        media = self.media[i]
        return MediaProcessor(self.model_dir).expand(ids, media) if media else ids

    def __call__(self, method: str, path: str, body: Any = None, attempts: Any = None) -> Any:
        if path == "/server_info":
            return {"version": "0.5.23", **({"device": self.device} if self.device else {})}
        if path in ("/begin_weight_update", "/end_weight_update"):
            return {"success": True}
        self.bodies.append(body)
        if path == "/update_weights_from_disk":
            return {"success": True}
        assert path == "/generate", path
        return [{"output_ids": [3], "prompt_token_ids": self.expanded(i, ids),
                 "meta_info": {"id": f"r{i}", "finish_reason": {"type": "length"}, "weight_version": "default",
                               "output_token_logprobs": [[-0.5, 3, None]]}}
                for i, ids in enumerate(body["input_ids"])]


def _engine(model_dir: Path, monkeypatch: pytest.MonkeyPatch, media: Sequence[PromptMedia | None],
            device: str | None = "cpu", expand: Any = None, **kwargs: Any) -> tuple[SGLangEngine, FakeServer]:
    server = FakeServer(model_dir, device, media, expand)
    monkeypatch.setattr(SGLangEngine, "_call", lambda engine, *args, **kw: server(*args, **kw))
    return SGLangEngine(URL, model_dir, **kwargs), server


@pytest.fixture(scope="module")
def mm_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sglang-media-models")
    return {arch: write_tiny_multimodal(root / arch, arch) for arch in ("qwen2_5_vl", "qwen3_omni", "qwen2_5_omni")}


# --- request pieces: pure functions ---------------------------------------------------------------


def test_each_run_of_a_placeholder_collapses_to_one_token() -> None:
    # 8 image, 9 video, 7 audio; 5 / 6 media start / end. Two images, one video, one audio:
    prompt = [1, 5, 8, 8, 8, 8, 6, 5, 8, 8, 6, 2, 5, 9, 9, 9, 6, 5, 7, 7, 7, 7, 7, 6, 3]
    kinds = {8: "image", 9: "video", 7: "audio"}
    assert requests.collapse_placeholders(prompt, kinds, {"image": 2, "video": 1, "audio": 1}) == [
        1, 5, 8, 6, 5, 8, 6, 2, 5, 9, 6, 5, 7, 6, 3]
    assert requests.collapse_placeholders([1, 2, 3], kinds) == [1, 2, 3]  # a text prompt passes as it is
    # Two images with no markup between them are one run: which ids belong to which is unknowable.
    with pytest.raises(ValueError, match=r"1 run\(s\) of image placeholder tokens but 2 image item\(s\)"):
        requests.collapse_placeholders([1, 8, 8, 8, 8, 2], kinds, {"image": 2})


def test_media_fields_hold_one_list_per_prompt_for_the_kinds_present() -> None:
    fields = requests.media_fields([{"image": ["a"], "video": [], "audio": ["w"]}, None, {"image": ["b", "c"]}])
    assert fields == {"image_data": [["a"], [], ["b", "c"]], "audio_data": [["w"], [], []],
                      "return_prompt_token_ids": True}  # no video_data: no prompt has a video


def test_a_logit_bias_reaches_every_prompt_and_is_absent_otherwise() -> None:
    plain = requests.generate_request([[1, 2], [3]], GREEDY, seed=None)
    # The body of a text model is what it was before media existed, key for key.
    assert json.dumps(plain) == json.dumps({"input_ids": [[1, 2], [3]], "sampling_params": [
        {"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0, "top_k": 1}] * 2, "return_logprob": True})
    biased = requests.generate_request([[1, 2], [3]], GREEDY, seed=None, logit_bias={50: -1e30})
    assert [p["logit_bias"] for p in biased["sampling_params"]] == [{"50": -1e30}] * 2


# --- the engine against a stand-in server -----------------------------------------------------------


def test_image_prompts_go_unexpanded_with_png_urls_and_text_prompts_as_they_are(
        mm_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    model = mm_dirs["qwen2_5_vl"]
    one, two, three = _image(0), _image(1), _image(2)
    media = [PromptMedia((one,)), PromptMedia((two, three)), None]
    prompts = [_prompt(model, m, t) for m, t in zip(media, ("a?", "b?", "c?"))]
    engine, server = _engine(model, monkeypatch, media)
    gens = engine.generate(prompts, GREEDY, seed=1, media=media)
    body = server.bodies[-1]
    ids = mm_token_ids("qwen2_5_vl")
    image, start, end = ids["<|image_pad|>"], ids["<|vision_start|>"], ids["<|vision_end|>"]
    # Each image's 4 placeholders went as one, between its markup; the text prompt unchanged.
    assert [p.count(image) for p in prompts] == [4, 8, 0]
    assert [p.count(image) for p in body["input_ids"]] == [1, 2, 0]
    assert body["input_ids"][1].index(image) == body["input_ids"][1].index(start) + 1
    assert body["input_ids"][2] == prompts[2]
    assert set(body) == {"input_ids", "sampling_params", "return_logprob", "image_data", "return_prompt_token_ids"}
    assert [len(u) for u in body["image_data"]] == [1, 2, 0]
    for urls, m in zip(body["image_data"], media):  # lossless: the server decodes our very pixels
        assert all(np.array_equal(_decode_png(u), item.data) for u, item in zip(urls, m.items if m else ()))
    # Markup is never sampled, on every prompt of a multimodal model, media or not.
    assert all(p["logit_bias"] == {str(t): -1e30 for t in (start, end, image, ids["<|video_pad|>"])}
               for p in body["sampling_params"])
    assert [g.prompt_ids for g in gens] == prompts  # the expanded prompts, which the trainer reads
    # Text-only calls of a multimodal model carry no media fields, only the markup bias.
    server.media = [None]
    engine.generate([prompts[2]], GREEDY, media=[PromptMedia()])
    assert set(server.bodies[-1]) == {"input_ids", "sampling_params", "return_logprob"}


def test_image_video_and_audio_of_one_prompt_go_as_three_fields(
        mm_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    model = mm_dirs["qwen3_omni"]
    media = [PromptMedia((_image(0), _video(1), _audio(2))), PromptMedia((_audio(3),))]
    prompts = [_prompt(model, m, "what?") for m in media]
    engine, server = _engine(model, monkeypatch, media, device="cuda")
    gens = engine.generate(prompts, GREEDY, media=media)
    body = server.bodies[-1]
    ids = mm_token_ids("qwen3_omni")
    runs = {kind: [p.count(ids[f"<|{kind}_pad|>"]) for p in body["input_ids"]] for kind in ("image", "video", "audio")}
    assert runs == {"image": [1, 0], "video": [1, 0], "audio": [1, 1]}
    assert [p.count(ids["<|audio_pad|>"]) for p in prompts] == [13, 13]  # 1 s of audio: 13 tokens
    assert [len(u) for u in body["image_data"]] == [1, 0] and [len(u) for u in body["video_data"]] == [1, 0]
    assert [len(u) for u in body["audio_data"]] == [1, 1]
    assert body["video_data"][0][0].startswith("data:video/x-matroska;base64,")
    assert body["audio_data"][0][0].startswith("data:audio/wav;base64,")
    assert [g.prompt_ids for g in gens] == prompts


def test_a_server_that_expands_differently_is_refused_naming_the_first_difference(
        mm_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    model = mm_dirs["qwen2_5_vl"]
    media = [PromptMedia((_image(0),))]
    prompt = _prompt(model, media[0], "a?")
    image = mm_token_ids("qwen2_5_vl")["<|image_pad|>"]
    at = prompt.index(image) + 3  # a server whose processor makes 3 tokens of the image, not 4

    def short(i: int, ids: list[int]) -> list[int]:
        return prompt[:at] + prompt[at + 1:]

    engine, _ = _engine(model, monkeypatch, media, expand=short)
    with pytest.raises(EngineHttpError, match=rf"first differ at position {at} .*processor config") as error:
        engine.generate([prompt], GREEDY, media=media)
    assert URL in str(error.value) and f"{len(prompt) - 1} vs {len(prompt)} tokens" in str(error.value)


def test_what_the_server_cannot_take_is_refused_with_the_fix(
        mm_dirs: dict[str, Path], tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    video = [PromptMedia((_video(0),))]
    omni_prompt = _prompt(mm_dirs["qwen3_omni"], video[0], "v?")
    engine, server = _engine(mm_dirs["qwen3_omni"], monkeypatch, video, device="cpu")
    with pytest.raises(ValueError, match=r'runs on CPU, where it cannot decode video .*engine = "native"'):
        engine.generate([omni_prompt], GREEDY, media=video)
    assert not server.bodies  # nothing was sent
    on_gpu, server = _engine(mm_dirs["qwen3_omni"], monkeypatch, video, device="cuda")
    on_gpu.generate([omni_prompt], GREEDY, media=video)
    assert len(server.bodies[-1]["video_data"][0]) == 1
    images = [PromptMedia((_image(0),))]
    qwen25_omni, _ = _engine(mm_dirs["qwen2_5_omni"], monkeypatch, images)
    with pytest.raises(ValueError, match=r'does not serve qwen2_5_omni models .*engine = "native"'):
        qwen25_omni.generate([_prompt(mm_dirs["qwen2_5_omni"], images[0], "i?")], GREEDY, media=images)
    text, _ = _engine(tiny_model_dir, monkeypatch, images)
    with pytest.raises(ValueError, match="need a multimodal model"):
        text.generate([[1, 2]], GREEDY, media=images)


def test_a_server_env_without_torchaudio_is_named_with_the_fix(
        mm_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    # What SGLang 0.5.23 answers to audio when its env has no torchaudio, as HttpEngine reports it
    # after its retries (SGLangEngine._call then adds which server it was).
    answer = ("engine at http://x/generate failed after 3 attempt(s) (last error: HTTP 500: "
              "No module named 'torchaudio'); is the server up and reachable from here? timeout_s = 600")
    audio = [PromptMedia((_audio(0),))]
    model = mm_dirs["qwen3_omni"]
    engine, server = _engine(model, monkeypatch, audio)

    def failing(method: str, path: str, body: Any = None, attempts: Any = None) -> Any:
        if path == "/generate":
            raise EngineHttpError(answer)
        return server(method, path, body, attempts)

    monkeypatch.setattr(SGLangEngine, "_call", lambda engine, *args, **kw: failing(*args, **kw))
    with pytest.raises(EngineHttpError, match=r"cannot read this batch's media: its environment has no torchaudio "
                                              r".*re-run tools/setup-sglang-cpu") as error:
        engine.generate([_prompt(model, audio[0], "a?")], GREEDY, media=audio)
    assert URL in str(error.value) and error.value.__cause__ is not None
    with pytest.raises(EngineHttpError) as plain:  # a text request's 500 is reported as it came
        engine.generate([[1, 2]], GREEDY)
    assert str(plain.value) == answer


def test_a_managed_engine_refuses_before_looking_for_a_dead_server(
        mm_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    video = [PromptMedia((_video(0),))]
    client, server = _engine(mm_dirs["qwen3_omni"], monkeypatch, video, device="cpu")
    managed = ManagedSGLangEngine(0, SGLangLaunch(interpreter="p", model_path=str(mm_dirs["qwen3_omni"]), device="cpu",
                                                  log_dir=str(tmp_path), api_key=None, update_mode="disk",
                                                  sglang=SGLangSpec()))
    managed._client = client  # as start() leaves it, without a process
    with pytest.raises(ValueError, match="cannot decode video"):
        managed.generate([_prompt(mm_dirs["qwen3_omni"], video[0], "v?")], GREEDY, media=video)
    assert managed.restarts == 0 and not server.bodies


# --- weight names -----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch, model_type", [("qwen2_5_vl", "qwen2_5_vl"), ("qwen3_vl", "qwen3_vl"),
                                              ("qwen3_omni", "qwen3_omni_moe")])
def test_trainer_weights_get_their_checkpoint_names_and_layout(arch: str, model_type: str, tmp_path: Path) -> None:
    model = load_policy_model(write_tiny_multimodal(tmp_path / arch, arch))
    ours = dict(checkpoint_named(model.state_dict().items(), model_type))
    want = checkpoint_state_dict(model)  # what save_pretrained writes and SGLang loads at start
    assert sorted(ours) == sorted(want)
    assert all(torch.equal(ours[name], want[name]) for name in want)
    assert dict(checkpoint_named(ours.items(), model_type)).keys() == ours.keys()  # checkpoint names pass


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_omni"])
def test_a_disk_update_of_a_multimodal_model_writes_checkpoint_names(
        arch: str, mm_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model_dir = mm_dirs[arch]
    engine, server = _engine(model_dir, monkeypatch, [], weights_dir=tmp_path / "w")
    model = load_policy_model(model_dir)
    engine.update_weights(model.state_dict().items(), version=1)
    written = load_file(str(Path(server.bodies[-1]["model_path"]) / "model.safetensors"))
    want = checkpoint_state_dict(model)
    assert sorted(written) == sorted(want) and all(torch.equal(written[n], want[n]) for n in want)


# --- against SGLang itself ----------------------------------------------------------------------------

# Registers the CPU kernels SGLang's model files look up at import (never called on this path), for
# SGLang's Qwen-VL processor to import with the sgl_kernel stand-in (see the module docstring).
LOGPROB_TOL = 1e-4  # float32 SGLang vs our HF forward, as the text tests; observed below 1e-6 here


@pytest.fixture(scope="module")
def sglang_python() -> Path:
    return SGLANG.python_or_skip()


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen2.5-VL with the real patch size 14 (see the module docstring)."""
    return write_tiny_multimodal(tmp_path_factory.mktemp("sglang-vl") / "qwen2_5_vl", "qwen2_5_vl", patch_size=14)


@pytest.fixture(scope="module")
def vl_engine(sglang_python: Path, vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangEngine]:
    from relax_hpc.engines.sglang.server import SGLangServer

    root = tmp_path_factory.mktemp("sglang-vl-server")
    with SGLangServer(sglang_python, vl_dir, log_path=root / "server.log", start_timeout_s=400,
                      env={"HF_HUB_OFFLINE": "1"}) as server:
        yield SGLangEngine(server.url, vl_dir, timeout_s=300, weights_dir=root / "weights")


@pytest.fixture(scope="module")
def backend(vl_dir: Path) -> Any:
    from relax_hpc.spec.schema import AlgorithmSpec, TrainSpec
    from relax_hpc.backends.torch_backend import TorchBackend

    return TorchBackend(vl_dir, TrainSpec(steps=1), AlgorithmSpec())


def _trainer_logprobs(backend: Any, gens: list, media: Sequence[PromptMedia | None]) -> list[list[float]]:
    from relax_hpc.data.sample import Sample

    samples = [Sample(prompt_ids=g.prompt_ids, response_ids=g.token_ids, rollout_log_probs=g.logprobs,
                      weight_version=g.weight_version, group_id=i, prompt_index=i, media=m or PromptMedia())
               for i, (g, m) in enumerate(zip(gens, media))]
    return backend.compute_log_probs(samples)


def _gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b, strict=True))


SAMPLED = SamplingParams(max_new_tokens=8, temperature=1.0)


@pytest.mark.slow
@pytest.mark.sglang
def test_a_real_server_expands_images_as_we_do_and_its_logprobs_are_the_trainers(
        vl_engine: SGLangEngine, vl_dir: Path, backend: Any) -> None:
    media = [PromptMedia((_image(0, 56),)), PromptMedia((_image(1, 56), _image(2, 56))), None]
    prompts = [_prompt(vl_dir, m, t) for m, t in zip(media, ("colour?", "same?", "hello"))]
    gens = vl_engine.generate(prompts, SAMPLED, seed=0, media=media)  # raises if the expansions differ
    # (a) a 56x56 image is a 4x4 patch grid, 4 tokens after the 2x2 merge
    image = mm_token_ids("qwen2_5_vl")["<|image_pad|>"]
    assert [g.prompt_ids for g in gens] == prompts and [p.count(image) for p in prompts] == [4, 8, 0]
    assert all(len(g.token_ids) > 0 for g in gens)
    # (b) the trainer's recomputed log-probs, with the same media, are the server's
    gap = _gap(_trainer_logprobs(backend, gens, media), [g.logprobs for g in gens])
    print(f"server vs trainer log-probs: max abs difference {gap:.2e}")
    assert gap < LOGPROB_TOL
    # (c) the image matters: another image, same text, gives other log-probs, which the trainer
    # reproduces with that image and not with the first one
    other = [PromptMedia((_image(7, 56),))]
    again = vl_engine.generate(prompts[:1], GREEDY, media=other)
    same_text = _trainer_logprobs(backend, again, other)
    first_image = _trainer_logprobs(backend, again, media[:1])
    changed = _gap(first_image, same_text)
    print(f"another image changes the log-probs by up to {changed:.2e}")
    assert _gap(same_text, [g.logprobs for g in again]) < LOGPROB_TOL < changed / 100


def _perturb(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))


@pytest.mark.slow
@pytest.mark.sglang
def test_a_real_server_runs_the_trainers_new_weights_after_an_update(
        vl_engine: SGLangEngine, vl_dir: Path, backend: Any) -> None:
    # Last of the server tests: it changes the served weights. The trainer's names are
    # transformers 5's (model.language_model.*, model.visual.*), which SGLang's loader does not know.
    # One image at every version: SGLang's cache of encoder outputs, which no update clears, would
    # serve the image as the old vision tower saw it (SGLangServer turns that cache off).
    from relax_hpc.engines.sglang.fleet import tied_names
    from relax_hpc.engines.sglang.weights import DistributedWeightPush

    assert any(name.startswith("model.language_model.") for name, _ in backend.named_weights())
    media = [PromptMedia((_image(3, 56),)), None]
    prompts = [_prompt(vl_dir, m, t) for m, t in zip(media, ("colour?", "hello"))]
    push = DistributedWeightPush("127.0.0.1", 0, 2, "gloo", 1 << 16, skip=tied_names(str(vl_dir)))
    over_group = SGLangEngine(vl_engine.base_url, vl_dir, timeout_s=300, weight_push=push)
    try:
        for version, engine in ((1, vl_engine), (2, over_group)):  # through disk, then a gloo group
            _perturb(backend.model, seed=version)
            engine.update_weights(backend.named_weights(), version=version)
            gens = engine.generate(prompts, SAMPLED, media=media)
            assert all(g.weight_version == version for g in gens)
            gap = _gap(_trainer_logprobs(backend, gens, media), [g.logprobs for g in gens])
            print(f"after update {version}, server vs trainer log-probs: max abs difference {gap:.2e}")
            assert gap < LOGPROB_TOL
    finally:
        push.close(over_group)
