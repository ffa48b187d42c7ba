"""The training backend interface: what the trainer role drives, whatever trains the model.

Implementations: `TorchBackend` (HF model, AdamW, ddp or fsdp2 over torch.distributed),
`MegatronBackend` (megatron-core with tensor / pipeline / expert parallelism, built through
megatron-bridge; backends/megatron.py) and the in-memory twin `backends/memory.py:
RecordingBackend` (records calls, for tests). `make_backend` builds the one `[train] backend`
names, inside the trainer rank's own process. The types every backend shares live here too:
`OptimSettings` (what a backend reads of [train]) and `StepStats` (one optimizer step's stats, summed
over micro-batches and ranks).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Protocol, Sequence

import torch

from relax_hpc.algos.losses import STEP_SUM_STATS
from relax_hpc.backends.batch import TrainBatch
from relax_hpc.data.sample import Sample

if TYPE_CHECKING:  # annotations only: importing this module must not load torch's DCP (drivers, forward roles)
    from relax_hpc.algos import LossSettings
    from relax_hpc.backends.parallel import Strategy
    from relax_hpc.ckpt import CheckpointManager, ResumeState
    from relax_hpc.spec.schema import MegatronSpec

BACKENDS: tuple[str, ...] = ("torch", "megatron")


class OptimSettings(Protocol):
    """What a backend reads of [train] for its optimizer and batches: a TrainSpec is one."""

    @property
    def lr(self) -> float: ...

    @property
    def weight_decay(self) -> float: ...

    @property
    def adam_betas(self) -> Sequence[float]: ...

    @property
    def grad_clip(self) -> float: ...  # 0 disables clipping

    @property
    def micro_batch_size(self) -> int: ...

    @property
    def mini_batches(self) -> int: ...  # optimizer steps per rollout batch


def adam_betas(optim: OptimSettings) -> tuple[float, float]:
    """[train] adam_betas (a list of two, as TOML has it) as the optimizer takes them."""
    return optim.adam_betas[0], optim.adam_betas[1]


class StepStats:
    """Stats of one optimizer step, summed over its micro-batches and then over ranks.

    The aggregates (`STEP_SUM_STATS`: loss/policy, loss/kl, entropy, loss/total) are computed
    with the step's denominator, so their sum is the whole step's value (after `rescale`, when
    the micro-batches used a provisional denominator). The other stats are token means; each is
    weighted by its micro-batch's trained tokens, which gives the step's token mean.
    """

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.tokens = 0.0

    def add(self, stats: dict[str, float], mask: torch.Tensor) -> None:
        tokens = float(mask.to(torch.bool).sum().item())
        self.tokens += tokens
        for key, value in stats.items():
            weight = 1.0 if key in STEP_SUM_STATS else tokens
            self.sums[key] = self.sums.get(key, 0.0) + value * weight

    def reduce(self, sum_over_ranks: Callable[[list[float]], list[float]],
               rescale: float = 1.0, names: Iterable[str] | None = None) -> dict[str, float]:
        """The step's stats, the aggregates multiplied by this rank's `rescale` first.

        `sum_over_ranks` is a collective, so every rank must call this with the same `names`
        (every rank's stat names: a rank that got no rows has none of its own).
        """
        keys = sorted(self.sums if names is None else names)
        local = [self.sums.get(k, 0.0) * rescale if k in STEP_SUM_STATS else self.sums.get(k, 0.0)
                 for k in keys]
        *sums, tokens = sum_over_ranks([*local, self.tokens])
        return {
            k: v if k in STEP_SUM_STATS else (v / tokens if tokens > 0 else 0.0)
            for k, v in zip(keys, sums)
        }


class TrainBackend(Protocol):
    """One trainer rank's model and optimizer.

    A step is `train` (samples), `train_batch` (packed rows) or `train_stream` (packed
    micro-batches as they arrive); every rank calls it once per step, and its gradient is the
    whole step's (all micro-batches, all ranks). `named_weights` yields whole tensors with HF
    names for the weight channel and export (under sharding every rank must take part).
    `offload` moves the optimizer state off the device while engines share it (colocation) and
    returns the bytes it freed there; `onload` brings it back before the next step.
    `reads_rows` False: this rank trains on rows a peer reads from the queue and shares with
    it (Megatron's tensor / pipeline peers), so the trainer role leaves the queue alone.
    """

    pad_id: int
    sharded: bool
    reads_rows: bool

    def train(self, samples: list[Sample]) -> dict[str, float]: ...

    def train_batch(self, batch: TrainBatch | None) -> dict[str, float]: ...

    def train_stream(self, micro_batches: Iterable[TrainBatch]) -> dict[str, float]: ...

    def compute_log_probs(self, samples: list[Sample], reference: bool = False) -> list[list[float]]: ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def save_checkpoint(self, manager: CheckpointManager, state: ResumeState) -> Path: ...

    def load_checkpoint(self, manager: CheckpointManager) -> ResumeState | None: ...

    def offload(self) -> int: ...

    def onload(self) -> None: ...


def require_backend(backend: str) -> None:
    """ValueError saying what to do when this interpreter cannot run `[train] backend = backend`."""
    if backend not in BACKENDS:
        raise ValueError(f"train.backend = {backend!r}: allowed values are {', '.join(BACKENDS)}")
    if backend == "megatron":
        missing = [name for name in ("megatron.core", "megatron.bridge") if _find_spec(name) is None]
        if missing:
            raise ValueError(
                f'train.backend = "megatron" needs {" and ".join(missing)}, which {sys.executable} '
                "cannot import. Install them with `pip install 'relax-hpc[megatron]'` and "
                "`pip install --no-deps megatron-bridge==0.3.1 omegaconf einops`, or on CPU build "
                "the environment with tools/setup-megatron-cpu and run .venv-megatron/bin/relax-hpc "
                '(docs/backends.md); or set [train] backend = "torch"'
            )


def _find_spec(name: str) -> object | None:
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:  # the parent package is missing
        return None


def make_backend(
    backend: str, model_path: str, optim: OptimSettings, loss: LossSettings, *, dtype: str, device: str,
    temperature: float, teacher_path: str | None, opd_coef: float, keep_reference: bool, strategy: Strategy,
    megatron: MegatronSpec | None = None, seed: int = 0, routing_replay: bool = False,
) -> TrainBackend:
    """The backend `[train] backend` names; ValueError naming the allowed values otherwise.

    `megatron` ([train.megatron]), `seed` and `routing_replay` are the Megatron backend's."""
    require_backend(backend)
    if backend == "megatron":
        from relax_hpc.backends.megatron import MegatronBackend
        from relax_hpc.spec.schema import MegatronSpec

        return MegatronBackend(model_path, optim, loss, megatron=megatron or MegatronSpec(), dtype=dtype,
                               device=device, temperature=temperature, teacher_path=teacher_path,
                               opd_coef=opd_coef, keep_reference=keep_reference, seed=seed,
                               routing_replay=routing_replay)
    from relax_hpc.backends.torch_backend import TorchBackend

    return TorchBackend(model_path, optim, loss, dtype=dtype, device=device, temperature=temperature,
                        teacher_path=teacher_path, opd_coef=opd_coef, keep_reference=keep_reference,
                        strategy=strategy)
