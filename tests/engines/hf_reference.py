"""What the HF model itself says, for comparing an engine's tokens and log-probs against it."""

from __future__ import annotations

import torch


def hf_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int,
              eos_id: int | None = None) -> tuple[list[int], list[float]]:
    """Greedy decoding by a full forward over the whole sequence at each step (no KV cache),
    stopping after `eos_id` when given."""
    seq, tokens, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(new_tokens):
            step = torch.log_softmax(model(torch.tensor([seq])).logits[0, -1].float(), dim=-1)
            token = int(step.argmax())
            tokens.append(token)
            logprobs.append(float(step[token]))
            seq.append(token)
            if token == eos_id:
                break
    return tokens, logprobs
