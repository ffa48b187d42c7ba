"""Check request bodies against SGLang's own request classes. Run by the SGLang environment's python:

    .venv-sglang/bin/python tests/engines/sglang_check_requests.py requests.json

requests.json: {"generate": [body, ...], "structs": [[class name in io_struct, body], ...]}.
A /generate body must construct `GenerateReqInput` and pass its `normalize_batch_and_arguments`,
and each of its sampling_params must construct SGLang's `SamplingParams` and pass `verify` and
`normalize` (what the tokenizer manager does); media fields (one list of URLs per prompt) must
reach each prompt's own request (`request[i]`, as the tokenizer manager splits a batch) intact,
a prompt's empty list counting as no media of that kind. A control body must name only fields of its
`msgspec.Struct` and validate as the HTTP server parses it (pydantic through the struct's
`__get_pydantic_core_schema__`, which ignores unknown keys, hence the field check); the result
must then survive the msgpack round trip the server uses to reach its scheduler; a base64 string
sent for a `Base64Bytes` field must parse to its bytes. (`msgspec.convert`
from a dict does not apply: these structs are `array_like`.) Prints one line per body and exits 1
if any failed. Used by tests/engines/test_sglang_engine.py.
"""

from __future__ import annotations

import base64
import json
import sys
import traceback
from typing import Any

VOCAB_SIZE = 1 << 20  # large enough for any token id the tests send


def check_generate(body: dict[str, Any]) -> None:
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.multimodal.mm_utils import has_valid_data
    from sglang.srt.sampling.sampling_params import SamplingParams

    request = GenerateReqInput(**body)
    request.normalize_batch_and_arguments()
    for key in ("image_data", "video_data", "audio_data"):
        for i, sent in enumerate(body.get(key) or []):
            got = getattr(request[i], key)
            if (got or []) != sent or has_valid_data(got) != bool(sent):
                raise ValueError(f"{key} of prompt {i} reached its request as {got!r}, sent {sent!r}")
    params = body.get("sampling_params") or {}
    for one in params if isinstance(params, list) else [params]:
        sampling = SamplingParams(**one)
        sampling.verify(VOCAB_SIZE)
        sampling.normalize(None)


def same(parsed: Any, sent: Any) -> bool:
    """Whether the parsed field holds what was sent (base64 text parses to its bytes)."""
    if isinstance(parsed, list) and isinstance(sent, list):
        return len(parsed) == len(sent) and all(same(p, s) for p, s in zip(parsed, sent))
    if isinstance(parsed, bytes) and isinstance(sent, str):
        return parsed == base64.b64decode(sent, validate=True)
    return bool(parsed == sent)


def check_struct(name: str, body: dict[str, Any]) -> None:
    import msgspec
    import pydantic
    from sglang.srt.managers import io_struct

    cls = getattr(io_struct, name)
    fields = {f.name for f in msgspec.structs.fields(cls)}
    unknown = sorted(set(body) - fields)
    if unknown:
        raise ValueError(f"{name} has no field(s) {unknown}; its fields: {sorted(fields)}")
    parsed = pydantic.TypeAdapter(cls).validate_python(body)
    assert isinstance(parsed, cls), type(parsed)
    for key, value in body.items():
        if not same(getattr(parsed, key), value):
            raise ValueError(f"{name}.{key} parsed as {getattr(parsed, key)!r}, sent {value!r}")
    msgspec.msgpack.decode(msgspec.msgpack.encode(parsed), type=cls)


def main(path: str) -> int:
    with open(path) as f:
        bodies = json.load(f)
    failed = 0
    checks = [("GenerateReqInput", body, check_generate) for body in bodies.get("generate", [])]
    checks += [(name, body, lambda b, n=name: check_struct(n, b)) for name, body in bodies.get("structs", [])]
    for name, body, check in checks:
        try:
            check(body)
            print(f"ok {name} {json.dumps(body)[:120]}")
        except Exception:
            failed += 1
            print(f"FAILED {name} {json.dumps(body)[:300]}\n{traceback.format_exc()}")
    print(f"{len(checks) - failed} of {len(checks)} bodies valid")
    return 1 if failed or not checks else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
