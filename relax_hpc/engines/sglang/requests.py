"""The JSON bodies `SGLangEngine` sends to an SGLang server and the reading of its replies.

Pure functions, no I/O: every body here is checked against SGLang's own request classes by
tests/engines/sglang_check_requests.py (run by the SGLang environment's python), so a change of
SGLang's API shows up as a failing test rather than as a 400 in a run. Written against SGLang
0.5.23 (`sglang/srt/managers/io_struct.py`, routes in `sglang/srt/entrypoints/http_server.py`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from relax_hpc.engines.base import Generation, SamplingParams
from relax_hpc.engines.http.client import (
    EngineHttpError,
    parse_generate_reply,
    sampling_payload,
)

__all__ = [
    "SUPPORTED_SGLANG_VERSIONS", "begin_weight_update_request", "check_expanded_prompts", "check_server_version",
    "collapse_placeholders", "continue_request", "cut_at_stop_strings",
    "destroy_weights_update_group_request", "end_weight_update_request", "generate_request",
    "init_weights_update_group_request", "media_fields", "parse_generate_response",
    "pause_request", "prompt_seed", "release_memory_request", "resume_memory_request",
    "update_weights_from_disk_request", "update_weights_from_distributed_request",
    "update_weights_from_tensor_request",
]

# The releases whose request classes and routes this module was checked against.
SUPPORTED_SGLANG_VERSIONS = ("0.5.23",)


def prompt_seed(seed: int, index: int) -> int:
    """The sampling seed of prompt `index` of a batch seeded `seed`: a hash, so that batches
    seeded s and s+1 share no per-prompt seed (s+index would), within SGLang's int64 range."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def generate_request(prompts: list[list[int]], params: SamplingParams, seed: int | None, *,
                     logit_bias: Mapping[int, float] | None = None, **fields: Any) -> dict[str, Any]:
    """`POST /generate` for a batch of token-id prompts: one sampling_params object per prompt
    (each its own seed when `seed` is given), log-probs returned. `logit_bias`: token id -> what
    SGLang adds to its logit before sampling and before the log-probs it returns (a multimodal
    model's media markup gets -1e30, as `MediaProcessor.mask_markup` does in the native engine and
    the trainer). `fields`: more top-level `GenerateReqInput` fields (e.g.
    `return_routed_experts=True`, or `media_fields`'s), sent as given.

    Stop strings are not sent: a server started with --skip-tokenizer-init (token ids in and out)
    refuses them ("stop=[...] is unavailable when skip_tokenizer_init=True"); the engine applies
    them to the reply with `cut_at_stop_strings`."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate_request needs at least one prompt, each of at least one token")
    per_prompt = []
    for i in range(len(prompts)):
        # sampling_payload maps our top_k 0 (no filter) to SGLang's -1.
        one = sampling_payload(params, None if seed is None else prompt_seed(seed, i))
        one.pop("stop", None)
        if logit_bias:  # SGLang's keys are token ids as strings
            one["logit_bias"] = {str(int(t)): float(b) for t, b in logit_bias.items()}
        per_prompt.append(one)
    return {
        "input_ids": [[int(t) for t in p] for p in prompts],
        "sampling_params": per_prompt,
        "return_logprob": True,
        **fields,
    }


def collapse_placeholders(prompt: Sequence[int], placeholders: Mapping[int, str],
                          counts: Mapping[str, int] | None = None) -> list[int]:
    """`prompt` with each run of one placeholder token cut to a single token: the unexpanded
    prompt, which an SGLang server expands again with its own processor. `placeholders`: token id
    -> media kind. `counts`: how many items of each kind the prompt carries; each run is one item
    (media markup separates neighbouring items), so a different number of runs is an error."""
    out: list[int] = []
    runs: dict[str, int] = {}
    for token in prompt:
        token = int(token)
        if token in placeholders and out and out[-1] == token:
            continue
        if token in placeholders:
            runs[placeholders[token]] = runs.get(placeholders[token], 0) + 1
        out.append(token)
    for kind, count in (counts or {}).items():
        if runs.get(kind, 0) != count:
            raise ValueError(
                f"the prompt has {runs.get(kind, 0)} run(s) of {kind} placeholder tokens but {count} {kind} item(s); "
                f"each {kind} must be its own run, between the chat template's {kind} start and end tokens")
    return out


def media_fields(urls: Sequence[Mapping[str, Sequence[str]] | None]) -> dict[str, Any]:
    """The `GenerateReqInput` media fields of a batch: `urls[i]` maps a kind ("image", "video",
    "audio") to prompt i's data URLs of that kind (None: a prompt without media). A field is sent
    only when some prompt has that kind, as one list per prompt (empty for the others: SGLang
    then processes no media of that kind for them). `return_prompt_token_ids` asks for the ids
    as the server expanded them, for `check_expanded_prompts`."""
    fields: dict[str, Any] = {}
    for kind in ("image", "video", "audio"):
        per_prompt = [list((u or {}).get(kind, ())) for u in urls]
        if any(per_prompt):
            fields[f"{kind}_data"] = per_prompt
    fields["return_prompt_token_ids"] = True
    return fields


def check_expanded_prompts(body: Any, prompts: list[list[int]], url: str = "the SGLang server") -> None:
    """Each reply's prompt ids, as the server's processor expanded the media placeholders
    (`prompt_token_ids`), must equal ours: the trainer recomputes log-probs on our ids, so
    sampling from other ones would train on the wrong prompt. Raises EngineHttpError naming the
    first position that differs."""
    items = body if isinstance(body, list) else [body]
    for i, (item, ours) in enumerate(zip(items, prompts)):
        theirs = item.get("prompt_token_ids") if isinstance(item, dict) else None
        if theirs is None and isinstance(item, dict) and isinstance(item.get("meta_info"), dict):
            theirs = item["meta_info"].get("prompt_token_ids")
        if not isinstance(theirs, list):
            raise EngineHttpError(f"SGLang server {url} sent no prompt_token_ids for prompt {i} although the "
                                  "request asked for them (return_prompt_token_ids)")
        theirs = [int(t) for t in theirs]
        if theirs == list(ours):
            continue
        at = next((k for k, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
        raise EngineHttpError(
            f"SGLang server {url} expanded the media placeholders of prompt {i} differently from relax-hpc: the "
            f"token ids first differ at position {at} (server {theirs[at:at + 1] or 'ends'}, relax-hpc "
            f"{list(ours[at:at + 1]) or 'ends'}; {len(theirs)} vs {len(ours)} tokens). Refusing to train on ids "
            "the server did not sample from: the server's processor config (preprocessor_config.json / "
            "processor_config.json: patch and merge size, min/max pixels, video fps, audio rate) must match the "
            "model directory relax-hpc reads ([model] path), so serve that very directory")


def _reported_version(item: Any) -> int | None:
    # SGLang reports a string: "default" until the first update, then what the updater sent.
    meta = item.get("meta_info") if isinstance(item, dict) else None
    value = meta.get("weight_version") if isinstance(meta, dict) else None
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


def parse_generate_response(
    body: Any, prompts: list[list[int]], version: int, url: str = "the SGLang server"
) -> list[Generation]:
    """Generations from a decoded `/generate` reply: token ids from `output_ids`, log-probs from
    `meta_info.output_token_logprobs` (SGLang's log_softmax(logits / temperature), our
    `Generation.logprobs`), finish reason "stop" or "length" (anything else, e.g. "abort", is an
    error). The weight version is the one the server reports when it is a number, else `version`
    (the server says "default" before its first update). Raises EngineHttpError naming `url`."""
    generations = parse_generate_reply(body, prompts, url)
    items = body if isinstance(body, list) else [body]
    for generation, item in zip(generations, items):
        reported = _reported_version(item)
        generation.weight_version = version if reported is None else reported
    return generations


def cut_at_stop_strings(generation: Generation, stop: tuple[str, ...], decode: Callable[[list[int]], str]) -> None:
    """End `generation` at the first token whose text completes one of `stop` (that token kept,
    finish reason "stop"), as NativeEngine stops. Sampling is autoregressive, so the kept prefix
    and its log-probs are what a server stopping there would have sent; only the tokens after it
    were generated in vain."""
    if not stop:
        return
    # Only the tail can newly complete a stop string: every token carries at least one byte and
    # a character at most 4, so 4 tokens per character of the longest stop string cover it.
    window = max(16, 4 * max(len(s) for s in stop))
    for end in range(1, len(generation.token_ids) + 1):
        tail = decode(generation.token_ids[max(0, end - window):end])
        if any(s in tail for s in stop):
            if end < len(generation.token_ids) or generation.finish_reason == "length":
                del generation.token_ids[end:], generation.logprobs[end:]
                generation.finish_reason = "stop"
            return


def check_server_version(info: Any, url: str) -> str:
    """The SGLang version in a `/server_info` reply; an error unless it is a supported one."""
    version = info.get("version") if isinstance(info, dict) else None
    if not isinstance(version, str):
        raise EngineHttpError(
            f"the server at {url}/server_info did not report an SGLang version (got {str(info)[:200]}); "
            f"is it an SGLang server? SGLangEngine supports SGLang {', '.join(SUPPORTED_SGLANG_VERSIONS)}"
        )
    if version not in SUPPORTED_SGLANG_VERSIONS:
        raise EngineHttpError(
            f"the server at {url} runs SGLang {version}; SGLangEngine supports SGLang "
            f"{', '.join(SUPPORTED_SGLANG_VERSIONS)} (SUPPORTED_SGLANG_VERSIONS in "
            "relax_hpc/engines/sglang/requests.py). Serve with a supported release (tools/setup-sglang-cpu "
            "installs 0.5.23), or check its request classes and add the version there"
        )
    return version


def pause_request() -> dict[str, Any]:
    """`POST /pause_generation`: "retract" puts running requests back in the queue (their KV
    cache may be flushed and is recomputed after `/continue_generation`); none is lost."""
    return {"mode": "retract"}


def continue_request() -> dict[str, Any]:
    """`POST /continue_generation`."""
    return {}


def begin_weight_update_request() -> dict[str, Any]:
    """`POST /begin_weight_update`: SGLang 0.5.23 refuses weight updates outside begin/end."""
    return {}


def end_weight_update_request() -> dict[str, Any]:
    """`POST /end_weight_update`."""
    return {}


def update_weights_from_disk_request(model_path: str, version: int) -> dict[str, Any]:
    """`POST /update_weights_from_disk`: load the safetensors files in `model_path` (HF names),
    set the weight version later replies report, and drop the prefix cache of the old weights."""
    return {"model_path": str(model_path), "weight_version": str(version), "flush_cache": True}


def release_memory_request() -> dict[str, Any]:
    """`POST /release_memory_occupation`: no tags means weights and KV cache."""
    return {}


def resume_memory_request() -> dict[str, Any]:
    """`POST /resume_memory_occupation`: no tags means weights and KV cache."""
    return {}


def init_weights_update_group_request(master_address: str, master_port: int, world_size: int,
                                      group_name: str, backend: str) -> dict[str, Any]:
    """`POST /init_weights_update_group`: the server's ranks join the group as ranks 1..world_size-1
    (rank_offset 1 plus its tensor-parallel rank); rank 0, the sender, hosts the store at
    `master_address:master_port`."""
    return {"master_address": master_address, "master_port": int(master_port), "rank_offset": 1,
            "world_size": int(world_size), "group_name": group_name, "backend": backend}


def destroy_weights_update_group_request(group_name: str) -> dict[str, Any]:
    """`POST /destroy_weights_update_group`."""
    return {"group_name": group_name}


def update_weights_from_distributed_request(names: list[str], dtypes: list[str], shapes: list[list[int]],
                                            group_name: str, version: int | None, last: bool) -> dict[str, Any]:
    """`POST /update_weights_from_distributed` for one bucket: the server receives these tensors,
    in this order, by broadcast from rank 0 of `group_name`. The weight version is set and the
    prefix cache (computed with the old weights) dropped only with the `last` bucket."""
    body: dict[str, Any] = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
                            "group_name": group_name, "flush_cache": bool(last)}
    if last and version is not None:
        body["weight_version"] = str(version)
    return body


def update_weights_from_tensor_request(payloads: list[str], version: int | None, last: bool) -> dict[str, Any]:
    """`POST /update_weights_from_tensor` for one bucket: `payloads` (one per tensor-parallel rank)
    are base64 pickles of the bucket's `[(name, tensor), ...]` whose storage is in shared memory
    (`sglang_weights.TensorWeightPush`). Version and cache flush with the `last` bucket only."""
    body: dict[str, Any] = {"serialized_named_tensors": list(payloads), "flush_cache": bool(last)}
    if last and version is not None:
        body["weight_version"] = str(version)
    return body
