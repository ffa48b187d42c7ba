"""Reward of the embedded tiny task: how much of "<answer><end of turn>" the response got right.

The response is compared token by token with the label's tokens followed by the end-of-turn
token; the reward is the length of the longest correct prefix over the target length. A right
digit that does not stop scores 0.5, a right digit that stops scores 1.0, a wrong first token
scores 0. The prefix credit gives the policy a signal before it has learnt to stop.
"""

from __future__ import annotations

from relax_hpc.data.sample import Sample
from relax_hpc.rewards.registry import inline_reward

END_OF_TURN = "<|im_end|>"


@inline_reward
def tiny_sum_reward(sample: Sample) -> dict[str, float]:
    target = list(str(sample.label)) + [END_OF_TURN]
    # response_text has special tokens removed; rebuild the stop marker from the finish reason.
    produced = list(sample.response_text)
    if sample.finish_reason == "stop":
        produced.append(END_OF_TURN)
    correct = 0
    for got, want in zip(produced, target):
        if got != want:
            break
        correct += 1
    exact = float(produced == target)
    return {"score": correct / len(target), "exact": exact}
