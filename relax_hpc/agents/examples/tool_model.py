"""The task of the tool-calling examples that train on CPU (sdk_agent.py, langchain_agent.py):
each prompt asks what is in a box, and only the `lookup` tool says (the row's label, one digit);
the agent must call it, then answer its result. Their model is the tiny Qwen3 with a tool format
(relax_hpc/models/tiny_tools.py), which `[model] tiny_arch = "qwen3_tools"` with
`build_tiny_if_missing = true` writes when the run starts; to write it by hand:

    python -m relax_hpc.agents.examples.tool_model runs/models/tiny-qwen3-tools
"""

from __future__ import annotations

import sys
from pathlib import Path

from relax_hpc.models.tiny_tools import TOOL_CALL, write_tool_model

__all__ = ["ANSWER_REWARD", "CALL_REWARD", "NEAR_MISS_REWARD", "TOOL_CALL", "box_reward", "dataset_rows",
           "write_tool_model"]

CALL_REWARD, ANSWER_REWARD = 0.3, 0.7
NEAR_MISS_REWARD = 0.1  # a call the model did not end its turn after (cut at max_new_tokens)


def box_reward(called: bool, answer: str | None, label: str) -> float:
    """0.3 for calling `lookup`, 0.7 more for then answering exactly the box's digit; nothing
    without the call (the prompt does not say the digit: a right answer without it is a guess)."""
    if not called:
        return 0.0
    return CALL_REWARD + (ANSWER_REWARD if (answer or "").strip() == label else 0.0)


def dataset_rows() -> list[dict[str, str]]:
    """Twenty boxes, each holding a digit that only the `lookup` tool tells."""
    digits = "73195840626081739452"
    return [{"prompt": f"what is in box {chr(ord('a') + k)}?", "label": d} for k, d in enumerate(digits)]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m relax_hpc.agents.examples.tool_model MODEL_DIR")
    print(write_tool_model(Path(sys.argv[1])))
