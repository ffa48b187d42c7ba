"""Test doubles for native tool calls: a tokenizer directory whose chat template renders tools
the way Qwen3's does (reduced: no reasoning blocks), and an agent that calls a tool through the
OpenAI SDK and answers with its result. The tiny model's tokenizer knows too few characters for
JSON, so this one is character level over all of `string.printable`."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

from relax_hpc.models.tiny import IM_END, IM_START, PAD_TOKEN

# Qwen3's template, reduced to system / user / assistant (with tool calls) / tool turns.
QWEN3_TOOL_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == "user" or (message.role == "system" and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role + '\n' + message.content }}
{%- if message.tool_calls %}
{%- for tool_call in message.tool_calls %}
{%- if (loop.first and message.content) or (not loop.first) %}{{- '\n' }}{%- endif %}
{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- elif message.role == "tool" %}
{%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' }}{{- message.content }}{{- '\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
""".strip()

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# What a Qwen3 model writes to call it, as the template renders the call back.
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n</tool_call>'


def write_tool_tokenizer(directory: Path) -> Path:
    """A Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json) with the template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = [PAD_TOKEN, IM_START, IM_END]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tok.to_str())
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": IM_END, "pad_token": PAD_TOKEN,
        "unk_token": PAD_TOKEN, "chat_template": QWEN3_TOOL_TEMPLATE}))
    return directory


def load_tool_tokenizer(directory: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(write_tool_tokenizer(directory)))


def weather(arguments: dict[str, Any]) -> str:
    return "18C" if arguments.get("city") == "paris" else "unknown city"


class ToolAgent:
    """Inline agent: asks, runs each tool call it gets, sends the results back, reads the answer.
    The reward is 1 when the final answer is "sunny"."""

    async def run(self, data: dict, **kw: Any) -> float:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=kw["base_url"], api_key=kw["api_key"], http_client=kw["http_client"])
        msgs: list[Any] = list(data["messages"])
        first = await client.chat.completions.create(model="policy", messages=msgs, tools=[WEATHER_TOOL])
        message = first.choices[0].message
        if not message.tool_calls:
            return 0.0
        msgs.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            msgs.append({"role": "tool", "tool_call_id": call.id,
                         "content": weather(json.loads(call.function.arguments))})
        final = await client.chat.completions.create(model="policy", messages=msgs, tools=[WEATHER_TOOL])
        return 1.0 if final.choices[0].message.content == "sunny" else 0.0
