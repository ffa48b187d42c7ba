"""`SGLangEngine`: the `RolloutEngine` over an SGLang server's HTTP API.

SGLang pins its own torch and transformers, so it runs in its own environment (built by
tools/setup-sglang-cpu, started by `SGLangServer` in sglang_server.py) and this adapter only
speaks HTTP; no sglang import here. Token ids go in and come out (serve with
`--skip-tokenizer-init`); the tokenizer for the text is loaded from `model_path` here.

    with SGLangServer(python, model_path, device="cpu", log_path=log) as server:
        engine = SGLangEngine(server.url, model_path, weights_dir=run_dir / "sglang-weights")
        gens = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8), seed=0)
        engine.update_weights(model.named_parameters(), version=1)

Weight updates go by `weight_push` when one is given (sglang_weights.py: a torch.distributed
group whose rank 0 is this process), else through disk: the tensors are written as safetensors
to `weights_dir/v<version>` (a temp dir, then a rename) and the server loads them with
`/update_weights_from_disk`, so `weights_dir` must be a path the server can read. Either way the
update runs inside `/begin_weight_update` ... `/end_weight_update` (0.5.23 refuses it outside).
The request bodies are built in sglang_requests.py and checked against SGLang's own classes by
the tests. Servers started, restarted and stopped for a job: sglang_fleet.py.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Sequence

import torch

from relax_hpc.engines import sglang_requests as requests
from relax_hpc.engines.base import Generation, SamplingParams
from relax_hpc.engines.call_gate import CallGate
from relax_hpc.engines.http_client import EngineHttpError, HttpEngine
from relax_hpc.engines.sglang_weights import WeightPush
from relax_hpc.models.hf import load_tokenizer

__all__ = ["SGLangEngine"]


def refuse_media(media: Sequence[Any] | None) -> None:
    """Prompts with images, video or audio do not reach an SGLang server from relax-hpc yet."""
    if media is not None and any(media):
        raise ValueError(
            "the SGLang engine does not pass images, video or audio to its servers yet; "
            'set [rollout] engine = "native" for a multimodal data set (docs/multimodal.md)'
        )


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
        self.server_version = requests.check_server_version(self._server_info(), self.base_url)
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
        `media`: refused when any prompt has some (see `refuse_media`)."""
        refuse_media(media)
        if not prompts:
            return []
        with self._gate.admit():
            return self._generate(prompts, params, seed)

    def _generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None) -> list[Generation]:
        # Stop on the tokenizer's EOS as NativeEngine does (SGLang's own comes from the model config).
        stops = params.stop_token_ids if self.eos_id in params.stop_token_ids else (*params.stop_token_ids, self.eos_id)
        body = requests.generate_request(prompts, dataclasses.replace(params, stop_token_ids=stops), seed,
                                         **self.request_fields)
        reply = self._call("POST", "/generate", body)
        generations = requests.parse_generate_response(reply, prompts, self._version, self.base_url)
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
        (older version directories are deleted afterwards)."""
        if self.weight_push is not None:
            named = list(named_tensors)
            self.post("/begin_weight_update", requests.begin_weight_update_request())
            try:
                self.weight_push.push(self, named, version)
            finally:
                self.post("/end_weight_update", requests.end_weight_update_request())
            self._version = version
            return
        target = self._write_weights(named_tensors, version)
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

    def _write_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> Path:
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, tensor in named_tensors:
            t = tensor.detach().to("cpu").contiguous()
            # safetensors refuses tensors that share storage (tied embeddings): copy the second one.
            if t.data_ptr() in seen:
                t = t.clone()
            seen.add(t.data_ptr())
            tensors[name] = t
        if not tensors:
            raise ValueError("update_weights got no tensors")
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        target = self.weights_dir / f"v{version}"
        staging = Path(tempfile.mkdtemp(prefix=f".tmp-v{version}-", dir=self.weights_dir))
        try:
            save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return target

    def release_memory(self) -> int:
        """Have the server release its weights and KV cache (`/release_memory_occupation`).
        Returns 0: SGLang does not report how many bytes it freed."""
        self._call("POST", "/release_memory_occupation", requests.release_memory_request(), attempts=1)
        return 0

    def resume_memory(self) -> None:
        """Take the weights and KV cache back (`/resume_memory_occupation`); the weights hold
        whatever SGLang restores, so a colocated step installs new ones with `update_weights`."""
        self._call("POST", "/resume_memory_occupation", requests.resume_memory_request(), attempts=1)
