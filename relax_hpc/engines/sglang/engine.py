"""`SGLangEngine`: the `RolloutEngine` over an SGLang server's HTTP API.

SGLang pins its own torch and transformers, so it runs in its own environment (built by
tools/setup-sglang-cpu, started by `SGLangServer` in sglang/server.py) and this adapter only
speaks HTTP; no sglang import here. Token ids go in and come out (serve with
`--skip-tokenizer-init`); the tokenizer for the text is loaded from `model_path` here.

    with SGLangServer(python, model_path, device="cpu", log_path=log) as server:
        engine = SGLangEngine(server.url, model_path, weights_dir=run_dir / "sglang-weights")
        gens = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8), seed=0)
        engine.update_weights(model.named_parameters(), version=1)

Weight updates go by `weight_push` when one is given (sglang/weights.py: a torch.distributed
group whose rank 0 is this process), else through disk: the tensors are written as safetensors
to `weights_dir/v<version>` (a temp dir, then a rename) and the server loads them with
`/update_weights_from_disk`, so `weights_dir` must be a path the server can read. Either way the
update runs inside `/begin_weight_update` ... `/end_weight_update` (0.5.23 refuses it outside).
The request bodies are built in sglang/requests.py and checked against SGLang's own classes by
the tests. Servers started, restarted and stopped for a job: sglang/fleet.py.

Media (a multimodal model, docs/multimodal.md): a prompt arrives with its placeholders expanded
and its canonical media (`PromptMedia`). SGLang expands placeholders itself with its own HF
processor, so each run of one placeholder goes as a single token, the media as data URLs
(lossless PNG / WAV / Matroska, `relax_hpc.media.encode`), and the reply's expanded ids must
equal ours (`check_expanded_prompts`) or the call fails. Media markup tokens get a -1e30 logit
bias on every prompt of a multimodal model, as the native engine and the trainer mask them.
Refused, with the fix in the message: a family SGLang 0.5.23 does not serve (Qwen2.5-Omni), and
video on a CPU server (SGLang decodes video with torchcodec or decord; neither runs there). A
server whose environment lacks a media package (torchaudio for audio) answers HTTP 500; the error
then names the package and how to add it.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from relax_hpc.engines.sglang import requests as requests
from relax_hpc.engines.base import Generation, SamplingParams
from relax_hpc.engines.call_gate import CallGate
from relax_hpc.engines.disk_weights import write_safetensors_dir
from relax_hpc.engines.http.client import EngineHttpError, HttpEngine
from relax_hpc.engines.sglang.weights import WeightPush, checkpoint_named
from relax_hpc.media.items import MEDIA_ORDER, MediaItem, PromptMedia
from relax_hpc.media.processor import MARKUP_FLOOR, media_processor_for
from relax_hpc.models.hf import load_tokenizer

__all__ = ["SGLangEngine"]


class SGLangEngine:
    """A `RolloutEngine` whose model runs in an SGLang server at `base_url`."""

    def __init__(
        self,
        base_url: str,
        model_path: str | Path,
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        retries: int = 2,
        weights_dir: str | Path | None = None,
        weight_push: WeightPush | None = None,
        request_fields: dict[str, Any] | None = None,
    ) -> None:
        """`model_path`: the served model's directory (for its tokenizer). `api_key`: the server's
        `--api-key`, if any. `weights_dir`: where `update_weights` writes when there is no
        `weight_push` (default: a temp dir, fine only when the server runs on this host).
        `request_fields`: more top-level fields of every `/generate` request."""
        # HttpEngine carries the transport: bearer token, no redirects, retries, errors naming the URL.
        self._http = HttpEngine(base_url, token=api_key, timeout_s=timeout_s, retries=retries)
        self.base_url = self._http.base_url
        self.model_path = Path(model_path)
        self.tokenizer = load_tokenizer(self.model_path)
        self.eos_id = int(self.tokenizer.eos_token_id)
        self.weight_push = weight_push
        self.request_fields = dict(request_fields or {})
        self._weights_dir = Path(weights_dir) if weights_dir is not None else None
        info = self._server_info()
        self.server_version = requests.check_server_version(info, self.base_url)
        # Where the server runs ("cpu", "cuda", ...), as it says; None when it does not say.
        self.server_device: str | None = info.get("device") if isinstance(info.get("device"), str) else None
        # A multimodal model's placeholder and markup token ids; None for a text model.
        self.media_processor = media_processor_for(self.model_path)
        self._version = 0
        self._gate = CallGate()

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def weights_dir(self) -> Path:
        """Where disk updates are written (a temp dir made on first use unless given)."""
        if self._weights_dir is None:
            self._weights_dir = Path(tempfile.mkdtemp(prefix="relax-sglang-weights-"))
        return self._weights_dir

    def post(self, path: str, body: Any) -> Any:
        """One POST to the server, not retried (control requests change state)."""
        return self._call("POST", path, body, attempts=1)

    def _server_info(self) -> Any:
        """GET /server_info (0.5.23's name; /get_server_info is its deprecated alias)."""
        try:
            return self._call("GET", "/server_info")
        except EngineHttpError as e:
            if "HTTP 404" not in str(e):
                raise
            return self._call("GET", "/get_server_info")

    def _call(self, method: str, path: str, body: Any = None, attempts: int | None = None) -> Any:
        # One place for the transport, so that every error says which server and what to do.
        try:
            return self._http.send(method, path, body, attempts=attempts)
        except EngineHttpError as e:
            raise type(e)(
                f"{e}. SGLang server {self.base_url}: check that it is running (its log), that "
                "the URL and --api-key match, and that it serves the model at "
                f"{self.model_path}") from e

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None,
        media: Sequence[Any] | None = None,
    ) -> list[Generation]:
        """`seed` goes to SGLang as one `sampling_seed` per prompt, which SGLang 0.5.23 honours only
        on a server started with --enable-deterministic-inference (attention backends fa3, fa4,
        triton, ...; not torch_native, so not on CPU): elsewhere sampling is not reproducible.
        `media[i]`: prompt i's images / videos / audios, its placeholders already expanded in
        `prompts[i]` (see the module docstring; `admit_media` says what is refused)."""
        admitted = self.admit_media(prompts, media)
        if not prompts:
            return []
        with self._gate.admit():
            return self._generate(prompts, params, seed, admitted)

    def admit_media(self, prompts: list[list[int]], media: Sequence[PromptMedia | None] | None,
                    ) -> Sequence[PromptMedia | None] | None:
        """`media` when some prompt has any and this server can take them, None when none has;
        a ValueError naming the fix when the model or the server cannot take them."""
        if media is None or not any(media):
            return None
        if len(media) != len(prompts):
            raise ValueError(f"generate got {len(prompts)} prompts but {len(media)} media entries")
        processor = self.media_processor
        if processor is None:
            raise ValueError(f"prompts with images, video or audio need a multimodal model; {self.model_path} is "
                             "text-only: point [model] path at a multimodal model or unset the [data] media keys")
        if not processor.family.sglang:
            raise ValueError(
                f"SGLang {self.server_version} does not serve {processor.family.model_type} models (no model file "
                f'for it in SGLang); set [rollout] engine = "native" for {self.model_path} (docs/multimodal.md)')
        if self.server_device == "cpu" and any(m is not None and m.of("video") for m in media):
            raise ValueError(
                f"the SGLang server {self.base_url} runs on CPU, where it cannot decode video (SGLang needs "
                'torchcodec or decord, which the CPU environment lacks); serve on a GPU, set [rollout] engine = '
                '"native", or drop the video column ([data] video_key)')
        return media

    def _generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None,
                  media: Sequence[PromptMedia | None] | None = None) -> list[Generation]:
        # Stop on the tokenizer's EOS as NativeEngine does (SGLang's own comes from the model config).
        stops = params.stop_token_ids if self.eos_id in params.stop_token_ids else (*params.stop_token_ids, self.eos_id)
        sent, fields = (prompts, self.request_fields) if media is None else self._media_request(prompts, media)
        bias = None if self.media_processor is None else dict.fromkeys(self.media_processor.markup_ids, MARKUP_FLOOR)
        body = requests.generate_request(sent, dataclasses.replace(params, stop_token_ids=stops), seed,
                                         logit_bias=bias, **fields)
        try:
            reply = self._call("POST", "/generate", body)
        except EngineHttpError as e:
            missing = self._missing_media_package(e) if media is not None else None
            if missing is None:
                raise
            raise missing from e
        generations = requests.parse_generate_response(reply, prompts, self._version, self.base_url)
        if media is not None:  # the ids we train on are the ones the server sampled from
            requests.check_expanded_prompts(reply, prompts, self.base_url)
        if self.request_fields.get("return_routed_experts"):
            self._attach_routes(generations, reply)
        for g in generations:
            requests.cut_at_stop_strings(g, params.stop, self._decode)
            if g.routed_experts is not None:  # a cut response feeds fewer tokens
                g.routed_experts = g.routed_experts[: len(g.prompt_ids) + len(g.token_ids) - 1]
            shown = g.token_ids[:-1] if g.finish_reason == "stop" and g.token_ids and g.token_ids[-1] in stops \
                else g.token_ids
            g.text = self._decode(shown)
        return generations

    def _media_request(self, prompts: list[list[int]], media: Sequence[PromptMedia | None],
                       ) -> tuple[list[list[int]], dict[str, Any]]:
        """The unexpanded prompts and the request's media fields (each item encoded once per call:
        the samples of a group share their prompt's media)."""
        assert self.media_processor is not None
        ids = self.media_processor.placeholders
        placeholders = {t: kind for kind in MEDIA_ORDER if (t := getattr(ids, kind)) is not None}
        urls: dict[str, str] = {}

        def url(item: MediaItem) -> str:
            if item.digest not in urls:
                from relax_hpc.media.encode import item_data_url

                urls[item.digest] = item_data_url(item)
            return urls[item.digest]

        sent: list[list[int]] = []
        per_prompt: list[dict[str, list[str]] | None] = []
        for i, (prompt, m) in enumerate(zip(prompts, media)):
            if not m:
                sent.append(prompt)
                per_prompt.append(None)
                continue
            counts: dict[str, int] = {kind: len(m.of(kind)) for kind in MEDIA_ORDER}
            try:
                sent.append(requests.collapse_placeholders(prompt, placeholders, counts))
            except ValueError as e:
                raise ValueError(f"prompt {i} of the batch: {e}") from e
            per_prompt.append({kind: [url(item) for item in m.of(kind)] for kind in MEDIA_ORDER})
        return sent, {**self.request_fields, **requests.media_fields(per_prompt)}

    def _missing_media_package(self, error: EngineHttpError) -> EngineHttpError | None:
        """A media request's error that says the server's environment lacks a package (SGLang
        answers HTTP 500 "No module named 'torchaudio'" to every request with audio), with the fix;
        None for any other error. `relax-hpc validate` refuses this where it can see the env."""
        found = re.search(r"No module named '([\w.]+)'", str(error))
        if found is None:
            return None
        package = found.group(1).split(".")[0]
        fix = ("re-run tools/setup-sglang-cpu on that environment (it adds torchaudio)" if package == "torchaudio"
               else f"install {package} into that environment")
        return EngineHttpError(
            f"SGLang server {self.base_url} cannot read this batch's media: its environment has no {package} "
            f"(the server answered: {found.group(0)}); {fix}, or set [rollout] engine = \"native\"")

    def _attach_routes(self, generations: list[Generation], reply: Any) -> None:
        """Routing replay: each reply's `meta_info.routed_experts` as `Generation.routed_experts`."""
        from relax_hpc.engines.routed_experts import decode_sglang_routes, moe_routing_shape

        layers, top_k, experts = moe_routing_shape(self.model_path)
        for g, item in zip(generations, reply if isinstance(reply, list) else [reply]):
            value = (item.get("meta_info") or {}).get("routed_experts") if isinstance(item, dict) else None
            if not isinstance(value, str):
                raise EngineHttpError(
                    f"SGLang server {self.base_url} sent no meta_info.routed_experts although the request asked "
                    "for them: start it with --enable-return-routed-experts (the rollout role does so with "
                    "[algorithm] routing_replay = true)")
            g.routed_experts = decode_sglang_routes(value, layers, top_k, experts,
                                                    len(g.prompt_ids) + len(g.token_ids) - 1)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def pause(self) -> None:
        """Wait for this client's generate calls in flight, hold new ones until `resume`, and
        pause the server's scheduler (other clients' requests are retracted, not lost)."""
        self._gate.pause()
        self._call("POST", "/pause_generation", requests.pause_request())

    def resume(self) -> None:
        self._call("POST", "/continue_generation", requests.continue_request())
        self._gate.resume()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace the served weights (HF names) with `version`, which later generations report:
        through `weight_push`, or else written to `weights_dir/v<version>` and loaded from there
        (older version directories are deleted afterwards). A multimodal model's names go in its
        checkpoint's form (`checkpoint_named`), the one SGLang's loaders read."""
        if self.media_processor is not None:
            named_tensors = checkpoint_named(named_tensors, self.media_processor.family.model_type)
        if self.weight_push is not None:
            named = list(named_tensors)
            self.post("/begin_weight_update", requests.begin_weight_update_request())
            try:
                self.weight_push.push(self, named, version)
            finally:
                self.post("/end_weight_update", requests.end_weight_update_request())
            self._version = version
            return
        target = write_safetensors_dir(named_tensors, self.weights_dir, version)
        self._call("POST", "/begin_weight_update", requests.begin_weight_update_request(), attempts=1)
        try:
            reply = self._call("POST", "/update_weights_from_disk",
                               requests.update_weights_from_disk_request(str(target), version), attempts=1)
        finally:
            self._call("POST", "/end_weight_update", requests.end_weight_update_request(), attempts=1)
        if isinstance(reply, dict) and reply.get("success") is False:
            raise EngineHttpError(f"SGLang server {self.base_url} did not load {target}: {reply.get('message')}")
        self._version = version
        for old in self.weights_dir.glob("v*"):
            if old != target and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)

    def release_memory(self) -> int:
        """Have the server release its weights and KV cache (`/release_memory_occupation`).
        Returns 0: SGLang does not report how many bytes it freed."""
        self._call("POST", "/release_memory_occupation", requests.release_memory_request(), attempts=1)
        return 0

    def resume_memory(self) -> None:
        """Take the weights and KV cache back (`/resume_memory_occupation`); the weights hold
        whatever SGLang restores, so a colocated step installs new ones with `update_weights`."""
        self._call("POST", "/resume_memory_occupation", requests.resume_memory_request(), attempts=1)
