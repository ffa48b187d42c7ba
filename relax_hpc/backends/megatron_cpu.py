"""Run megatron-core (and megatron-bridge's weight conversion) on a CPU-only torch over gloo.

megatron-core 0.16.1 assumes CUDA in a few calls that its CPU-capable code paths (the local layer
spec, ``use_cpu_initialization=True``, fusions off) still reach. ``activate(device)`` routes
exactly these, and does nothing unless ``device`` is a CPU device, so a GPU run never sees them:

1. **The model-parallel RNG tracker.** ``tensor_parallel.random.CudaRNGStatesTracker.add`` calls
   ``torch.cuda.get_rng_state()``, which raises on a CPU-only torch; ``model_parallel_cuda_manual_seed``
   reaches it, and ``DotProductAttention.forward`` forks the tracker. ``CpuRNGStatesTracker`` keeps
   the same named states on the CPU generator and is installed as the tracker before seeding.
   (``torch.cuda.manual_seed`` in that function is a lazy no-op on CPU torch.)
2. **``torch.cuda.current_device()`` used as a device** for new tensors: rotary ``inv_freq``
   (``rotary_pos_embedding.py``), the attention memory buffer (``core/utils.py``
   ``GlobalMemoryBuffer``), and bridge's TP>1 weight load (``param_mapping.py``); about 20 more
   sites in megatron-core. It raises on CPU torch; routed to answer ``"cpu"``, globally, only
   when ``torch.cuda.is_available()`` is False, because per-site patches would miss some.
3. **gloo scatter of non-contiguous tensors** (a correctness bug, not a CUDA call): in torch
   2.13 ``dist.scatter`` over gloo sends the wrong bytes for non-contiguous inputs, with no
   error. megatron-bridge's ``MegatronParamMapping.scatter_to_tp_ranks`` scatters column slices
   of HF weights, so at TP=2 the logits were off by 0.69. It is wrapped to make the splits
   contiguous first (only when megatron-bridge is installed; then call
   ``megatron_cpu_stubs.install()`` before ``activate``).

Not routed here, the caller's job: pass an explicit causal ``attention_mask`` (``causal_mask``)
because ``get_default_causal_mask`` builds one with ``device="cuda"`` when the mask is None;
start the gloo process group and ``parallel_state.initialize_model_parallel`` yourself, before
the bridge would do it with NCCL. Call ``activate`` before ``model_parallel_cuda_manual_seed``.

megatron is imported inside ``activate`` only, so ``relax_hpc`` imports without it.
Tests: tests/backends/test_megatron_cpu.py (needs tools/setup-megatron-cpu's environment).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["activate", "causal_mask"]

_ACTIVATED: list[str] = []


def activate(device: torch.device | str) -> list[str]:
    """Route megatron's CUDA-only calls to CPU when ``device`` is a CPU device; else do nothing.

    Idempotent. Returns one line per route now in place (empty for a non-CPU device)."""
    if torch.device(device).type != "cpu":
        return []
    if not _ACTIVATED:
        _install_cpu_rng_tracker()
        _ACTIVATED.append("tensor_parallel.random: CpuRNGStatesTracker is the RNG tracker")
        if not torch.cuda.is_available():
            torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
            _ACTIVATED.append("torch.cuda.current_device() -> 'cpu'")
        if _make_bridge_scatter_contiguous():
            _ACTIVATED.append("MegatronParamMapping.scatter_to_tp_ranks: contiguous splits")
    return list(_ACTIVATED)


def causal_mask(seq_len: int) -> torch.Tensor:
    """Megatron's causal mask convention, ``True`` = masked, ``[1, 1, s, s]`` on CPU."""
    return torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool), diagonal=1)


def _cpu_current_device() -> str:
    return "cpu"


def _install_cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):  # type: ignore[misc]
        """``CudaRNGStatesTracker`` with the named states kept on the CPU generator."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise RuntimeError(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise RuntimeError(f"rng state {name} already exists")
            outer = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise RuntimeError(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _make_bridge_scatter_contiguous() -> bool:
    if importlib.util.find_spec("megatron.bridge") is None:
        return False  # megatron-core alone: no bridge weight loading to fix
    # With the bridge installed, import errors propagate (e.g. megatron_cpu_stubs.install() not
    # called first) rather than leaving the TP>1 weight load silently wrong.
    from megatron.bridge.models.conversion.param_mapping import MegatronParamMapping

    original = MegatronParamMapping.scatter_to_tp_ranks
    if getattr(original, "_relax_contiguous_splits", False):
        return True

    def scatter_to_tp_ranks(self: Any, splits: Any, *args: Any, **kwargs: Any) -> Any:
        if splits:
            splits = [split.contiguous() for split in splits]
        return original(self, splits, *args, **kwargs)

    scatter_to_tp_ranks._relax_contiguous_splits = True  # type: ignore[attr-defined]
    MegatronParamMapping.scatter_to_tp_ranks = scatter_to_tp_ranks
    return True
