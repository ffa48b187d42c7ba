"""The tiny Qwen3 model with a tool format (`[model] tiny_arch = "qwen3_tools"`), the model of the
tool-calling examples that train on CPU (relax_hpc/agents/examples/sdk_agent.py, langchain_agent.py).

Its chat template is the tiny model's (`<|im_start|>role:content<|im_end|>`) with Qwen3's tool
format: the request's tools are listed in a system turn (names only: the model has 256
positions), an assistant's tool calls are written as Qwen3 writes them,

    <tool_call>
    {"name": "lookup", "arguments": {}}
    </tool_call>

and tool results come back as `tool` turns. The tokenizer is the tiny model's character-level one
with one token more: the whole call of `lookup` without arguments. A randomly initialised model
writes it about once in 50 tokens, as the calculator's one-letter call ("c"), so a short run
learns to call the tool; the proxy parses it as any Qwen3 tool call, and the template writes it
back as the same single token.

The weights are random but for one habit every chat model brings from its post-training: it ends
its turn right after a tool call (Qwen3 writes `<|im_end|>` after `</tool_call>`). A random model
would end it there once in 50 too, so a reply of two tokens would be call + end once in 2500,
too rare for a short run to learn from, and a client that drops a reply cut at the token limit
(the OpenAI Agents SDK raises on it) would never see the tool run. `end_turn_after_call` fits
that one habit before the model is saved: a few steps of Adam on random contexts that raise
P(end of turn | call) while a KL term keeps every other next-token distribution close to the
random model's (seed 1, replies to the examples' prompts: P(end right after the call) 0.014
-> 0.94; as the first token, P(call) 0.015 -> 0.018 and P(end) 0.023 -> 0.024).

    write_tool_model(Path("runs/models/tiny-qwen3-tools"), seed=1)
"""

from __future__ import annotations

from pathlib import Path

import torch

from relax_hpc.models.tiny import (
    ALPHABET,
    IM_END,
    IM_START,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    TinyModelSize,
    refuse_existing,
    save_model_dir,
)

__all__ = ["TOOL_CALL", "TOOL_NAME", "TOOL_TEMPLATE", "end_turn_after_call", "tool_tokenizer_json", "write_tool_model"]

TOOL_NAME = "lookup"
TOOL_CALL = '<tool_call>\n{"name": "' + TOOL_NAME + '", "arguments": {}}\n</tool_call>'

TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system:tools:{% for t in tools %}{{ (t.function or t).name }},{% endfor %}"
    "<|im_end|>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant:{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}{%- set f = c.function or c %}"
    '<tool_call>\n{"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>"
    "{%- else %}<|im_start|>{{ m.role }}:{{ m.content }}<|im_end|>{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant:{% endif %}"
)


def tool_tokenizer_json() -> str:
    """The tiny model's character-level tokenizer.json with the `lookup` call as one more token."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in ALPHABET:
        vocab[ch] = len(vocab)
    vocab[TOOL_CALL] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.add_tokens([AddedToken(TOOL_CALL, normalized=False, special=False)])  # decoded as text: the proxy parses it
    return tok.to_str()


def write_tool_model(out_dir: Path, seed: int = 0, size: TinyModelSize = TinyModelSize()) -> Path:
    """A randomly initialised tiny Qwen3 with the tool template at `out_dir` (write, then rename);
    refuses an existing directory, as write_tiny_model does."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from relax_hpc.models.hf import quiet_transformers

    quiet_transformers()
    out_dir = refuse_existing(out_dir)
    ids = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    config = Qwen3Config(
        vocab_size=len(SPECIAL_TOKENS) + len(ALPHABET) + 1, hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size, num_hidden_layers=size.num_hidden_layers,
        num_attention_heads=size.num_attention_heads, num_key_value_heads=size.num_key_value_heads,
        head_dim=size.head_dim, max_position_embeddings=size.max_position_embeddings, tie_word_embeddings=True,
        pad_token_id=ids[PAD_TOKEN], bos_token_id=ids[IM_START], eos_token_id=ids[IM_END],
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    end_turn_after_call(model, call_id=config.vocab_size - 1, end_id=ids[IM_END], seed=seed)
    return save_model_dir(model, out_dir, size.max_position_embeddings,
                          tokenizer_json=tool_tokenizer_json(), tokenizer_config_extra={"chat_template": TOOL_TEMPLATE})


def end_turn_after_call(model: torch.nn.Module, call_id: int, end_id: int, seed: int, steps: int = 40,
                        lr: float = 3e-3, keep_weight: float = 10.0) -> None:
    """Teach a random `model` in place to end its turn (`end_id`) right after the call token
    (`call_id`), and nothing else: the loss is -log P(end | call) at the calls of 64 random
    contexts of 32 tokens (no padding; each ends with a call, others fall where they fall) plus
    `keep_weight` x the KL divergence from the untouched model's next-token distribution at every
    other position."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, call_id + 1, (64, 32), generator=g)  # every token but the pad
    ids[:, -1] = call_id
    after_call = ids == call_id
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # too small to split: on 2 busy cores, 2 threads took 17 s, one 2 s
    try:
        with torch.no_grad():
            ref = model(ids).logits.log_softmax(-1)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        for _ in range(steps):
            logp = model(ids).logits.log_softmax(-1)
            end = -logp[after_call][:, end_id].mean()
            keep = (ref.exp() * (ref - logp)).sum(-1)[~after_call].mean()
            opt.zero_grad()
            (end + keep_weight * keep).backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
