"""The ActorFwd and Reference roles: forward passes that add per-token log-probs to queued rows.

Both read each step's rows from the transfer queue as rollout writes them, run one forward pass
per micro-batch and write a field back onto the same rows, so the trainer finds them ready and
never runs these forwards on its own critical path:

- ActorFwd writes `log_probs`: the policy's log-probs under the weights the trainer starts the
  step with (start_version + step - start_step, i.e. version == step unless resumed otherwise),
  the "old" policy of the PPO ratio. It receives every weight update like a rollout engine and
  waits for a complete update of that version before it starts a step (the trainer broadcasts
  it while it trains the step before, so it may still be on the wire).
- Reference writes `ref_log_probs`: the frozen initial model's log-probs, for the KL loss.

Rows are acked only after their field is written: a killed worker restarted under the same
consumer id gets exactly the rows it had not finished, so none is lost or computed twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Literal

import torch

from relax_hpc.algos import token_logprobs_and_entropy
from relax_hpc.backends.batch import pack_samples
from relax_hpc.data.rows import MEDIA_FIELDS, media_from_fields
from relax_hpc.data.sample import Sample
from relax_hpc.media.processor import media_processor_for
from relax_hpc.models.hf import load_policy_model, load_tokenizer
from relax_hpc.roles.heartbeat import Heartbeats
from relax_hpc.roles.step_loop import StepLoopWorker
from relax_hpc.spec.schema import ModelSpec, RolloutSpec, TrainSpec
from relax_hpc.transfer.queue import partition_name
from relax_hpc.weights.base import required_weight_version
from relax_hpc.weights.endpoints import WeightInbox, WeightReceiverEndpoint
from relax_hpc.weights.flat import bind_module, copy_into_module

ForwardKind = Literal["actor_fwd", "reference"]
OUTPUT_FIELD: dict[str, str] = {"actor_fwd": "log_probs", "reference": "ref_log_probs"}
INPUT_FIELDS = ("tokens", "prompt_length")


@dataclass(frozen=True)
class ForwardConfig:
    """An ActorFwd or Reference role: the spec tables it reads ([model] path and dtype, [train]
    micro_batch_size, [rollout] temperature) and where it runs."""

    kind: ForwardKind
    model: ModelSpec
    train: TrainSpec
    rollout: RolloutSpec
    device: str = "cpu"  # resolved (cpu, cuda:N)
    num_threads: int = 0  # torch's intra-op threads; 0: torch's own choice
    timeout_s: float = 3600.0  # the longest wait for the weights of a step


def response_log_probs(model: torch.nn.Module, samples: list[Sample], pad_id: int,
                       temperature: float, device: str, media_processor: Any = None) -> list[torch.Tensor]:
    """Per-sample log-probs of the response tokens under `model` (float32, one tensor per sample).
    `media_processor`: a multimodal model's (relax_hpc.media.processor), which builds the
    media tensors and M-RoPE positions from the samples' media."""
    batch = pack_samples(samples, pad_id).to(torch.device(device))
    extra: dict[str, Any] = {}
    if media_processor is not None:
        from relax_hpc.media.positions import rows_forward_kwargs

        extra = rows_forward_kwargs(model, media_processor, batch.input_ids, batch.attention_mask, batch.media)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False,
                       **extra).logits
        if media_processor is not None:
            logits = media_processor.mask_markup(logits)
        logp, _ = token_logprobs_and_entropy(logits[:, :-1], batch.targets, temperature)
    out = []
    for i, s in enumerate(samples):
        p = len(s.prompt_ids)
        out.append(logp[i, p - 1 : p - 1 + len(s.response_ids)].float().cpu().contiguous())
    return out


class ForwardWorker(StepLoopWorker, WeightReceiverEndpoint, Heartbeats):
    """One ActorFwd or Reference worker; `start` runs its loop over steps in a background thread."""

    def __init__(self, cfg: ForwardConfig) -> None:
        super().__init__(cfg.kind)
        if cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        self.cfg = cfg
        self.model = load_policy_model(cfg.model.path, dtype=cfg.model.dtype, device=cfg.device).eval()
        self.media_processor = media_processor_for(cfg.model.path)
        # A multimodal model reads each row's media too.
        self.input_fields = INPUT_FIELDS if self.media_processor is None else (*INPUT_FIELDS, *MEDIA_FIELDS)
        tok = load_tokenizer(cfg.model.path)
        self.pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        self._version = 0
        self._inbox = WeightInbox()

    # -- weights (ActorFwd only; the reference model never changes) -----------------------------

    def weight_version(self) -> int:
        return self._version

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Take a complete update; applied before the next step that needs it."""
        self.stage_weights(list(named_tensors))
        self.commit_weights(version)

    def stage_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        if self.cfg.kind == "reference":
            raise RuntimeError("the Reference role keeps the initial weights; it takes no updates")
        self._inbox.stage(bucket)

    def commit_weights(self, version: int) -> None:
        if self.cfg.kind == "reference":
            raise RuntimeError("the Reference role keeps the initial weights; it takes no updates")
        self._inbox.commit(version)
        if self._thread is None:  # no loop running: apply now
            self._apply_pending()

    def weights_failed(self, message: str) -> None:
        self._inbox.fail(message)

    def weight_inbox(self) -> WeightInbox:
        return self._inbox

    def _apply_pending(self) -> None:
        version = self._inbox.install(lambda flat, _v: bind_module(self.model, flat),
                                      lambda named, _v: copy_into_module(self.model, named, self.cfg.kind))
        if version is not None:
            self._version = version

    def _wait_for_version(self, version: int) -> bool:
        """Apply a complete update of at least `version` (waiting for it); False when asked to stop."""
        if not self._inbox.wait_for(version, self._version, self._stop, self.cfg.timeout_s, self.cfg.kind):
            return False
        self._apply_pending()
        return True

    # -- the loop (StepLoopWorker runs it) ------------------------------------------------------

    def _ready_for(self, step: int, start_step: int, start_version: int) -> bool:
        if self.cfg.kind != "actor_fwd":
            return True
        # The weights the trainer starts this step with: staleness 0 by definition.
        return self._wait_for_version(required_weight_version(step, start_step, start_version, max_staleness=0))

    def _process(self, queue: Any, step: int) -> bool:
        """Add this role's field to every row of one step; False when asked to stop."""
        partition, field = partition_name(step), OUTPUT_FIELD[self.cfg.kind]
        ended = False
        while not ended and not self._stop.is_set():
            # The next micro-batch is fetched while this one runs; each is acked once written
            # (a worker killed before that has its unacked rows redone by its restart).
            try:
                for batch in queue.stream(partition, self.cfg.kind, self.input_fields, self.cfg.train.micro_batch_size,
                                          timeout=1.0):
                    if batch.rows:
                        samples = [_sample_of(row) for row in batch.rows]
                        values = response_log_probs(self.model, samples, self.pad_id, self.cfg.rollout.temperature,
                                                    self.cfg.device, self.media_processor)
                        queue.write(partition, batch.indices, [{field: v} for v in values])
                        self.rows_done += len(batch.indices)
                    ended = batch.end
                    if self._stop.is_set() and not ended:
                        break
            except TimeoutError:
                continue  # nothing came for a second: look at the stop flag, then ask again
        return ended


def _sample_of(row: dict[str, Any]) -> Sample:
    tokens = row["tokens"].tolist()
    p = int(row["prompt_length"])
    return Sample(prompt_ids=tokens[:p], response_ids=tokens[p:], rollout_log_probs=[0.0] * (len(tokens) - p),
                  weight_version=-1, group_id=-1, prompt_index=-1, media=media_from_fields(row))
