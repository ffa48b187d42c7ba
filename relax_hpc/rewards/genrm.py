"""`genrm`: an LLM judge that reads the question, the response and the reference and says 1 or 0.

The judge is any object with the rollout engine's `generate(prompts, SamplingParams)` (a native
engine on its own GPUs, the SGLang adapter, or a fake in tests) plus its tokenizer. The prompt
comes from `[reward] genrm_prompt` with the placeholders {question}, {answer} and {label}; other
braces in the template are left alone. The score is the first standalone 0 or 1 of the judge's
reply; a reply without one scores 0 and is counted as `genrm_unparsed`.
"""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Any

from relax_hpc.data.sample import Sample
from relax_hpc.engines.base import Generator, SamplingParams

DEFAULT_GENRM_PROMPT = (
    "You are grading an answer. Question:\n{question}\n\nReference answer:\n{label}\n\n"
    "Candidate answer:\n{answer}\n\nReply with 1 if the candidate answer is correct, else 0."
)
PLACEHOLDERS = ("{question}", "{answer}", "{label}")
# The judge reads only the tail of very long responses; the verdict is at the end of a solution.
MAX_JUDGED_CHARS = 8000

_VERDICT = re.compile(r"(?<!\d)(?<!\d\.)([01])(?!\d|\.\d)")


def parse_verdict(reply: str) -> float | None:
    """The first standalone 0 or 1 in the reply (not part of 10, 0.5, ...), or None."""
    found = _VERDICT.search(reply)
    return float(found.group(1)) if found else None


def render_prompt(template: str, sample: Sample) -> str:
    answer = sample.response_text[-MAX_JUDGED_CHARS:]
    values = {"{question}": sample.prompt_text, "{answer}": answer, "{label}": "" if sample.label is None else str(sample.label)}
    out = template
    for key, value in values.items():
        out = out.replace(key, value)
    return out


class GenRMJudge:
    """An async reward function backed by a generation engine."""

    def __init__(
        self,
        engine: Generator,
        tokenizer: Any,
        prompt_template: str = DEFAULT_GENRM_PROMPT,
        sampling: SamplingParams | None = None,
        use_chat_template: bool = True,
    ) -> None:
        if "{answer}" not in prompt_template:
            raise ValueError(
                "[reward] genrm_prompt must contain the {answer} placeholder (and usually {question} "
                "and {label}); the judge would not see the response otherwise"
            )
        self.engine, self.tokenizer, self.template = engine, tokenizer, prompt_template
        eos = getattr(tokenizer, "eos_token_id", None)
        self.sampling = sampling or SamplingParams(
            max_new_tokens=8, temperature=1e-3, stop_token_ids=(eos,) if isinstance(eos, int) else ()
        )
        self.use_chat_template = use_chat_template and getattr(tokenizer, "chat_template", None) is not None
        # Engines are not required to be thread-safe; one judge call at a time per engine.
        self._lock = threading.Lock()

    def prompt_ids(self, sample: Sample) -> list[int]:
        text = render_prompt(self.template, sample)
        if self.use_chat_template:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def judge(self, sample: Sample) -> dict[str, float]:
        ids = self.prompt_ids(sample)
        with self._lock:
            generation = self.engine.generate([ids], self.sampling)[0]
        reply = generation.text or self.tokenizer.decode(generation.token_ids, skip_special_tokens=True)
        verdict = parse_verdict(reply)
        return {"score": verdict or 0.0, "genrm_unparsed": float(verdict is None)}

    async def __call__(self, sample: Sample) -> dict[str, float]:
        return await asyncio.to_thread(self.judge, sample)
