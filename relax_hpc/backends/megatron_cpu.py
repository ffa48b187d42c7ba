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
4. **``torch.zeros(..., device="cuda")`` in the forward-backward schedules.** Every schedule in
   ``pipeline_parallel/schedules.py`` (no pipelining, 1F1B, interleaved) counts the step's tokens
   in ``total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")``. The module's
   ``torch`` name is replaced by a view of torch whose ``zeros`` builds ``device="cuda"``
   tensors on the CPU; every other attribute is torch's own.
5. **``weight.data.cuda()`` for tied embeddings under pipeline parallelism.**
   ``LanguageModule.setup_embeddings_and_output_layer`` moves the shared word-embedding /
   output weight to CUDA before all-reducing it over the first and last stages. It is wrapped so
   that, during that call only, ``Tensor.cuda()`` returns the tensor itself.
6. **``torch.cuda.synchronize()`` in dist_checkpointing's writer.**
   ``FileSystemWriterAsync.preload_tensors(buckets, non_blocking=True)`` copies tensors to host
   memory and then synchronizes CUDA. On CPU the copy is already synchronous, so it is called with
   ``non_blocking=False``, which skips the synchronize.

Not routed here, the caller's job: pass an explicit causal ``attention_mask`` (``causal_mask``)
because ``get_default_causal_mask`` builds one with ``device="cuda"`` when the mask is None;
start the gloo process group and ``parallel_state.initialize_model_parallel`` yourself, before
the bridge would do it with NCCL. Call ``activate`` before ``model_parallel_cuda_manual_seed``.
For pipeline parallelism set ``batch_p2p_sync=False`` (``p2p_communication.py`` calls
``torch.cuda.synchronize()`` after each batched send/receive otherwise) and keep
``variable_seq_lengths=False`` (its shape exchange synchronizes unconditionally): give every
micro-batch of a call the same shape. Megatron's optimizer (``get_megatron_optimizer``) builds
``device='cuda'`` tensors and checks ``torch.cuda.FloatTensor`` types; on CPU train with a
``torch.optim`` optimizer over the model's parameters instead (``backends/megatron_optim.py``).

megatron is imported inside ``activate`` only, so ``relax_hpc`` imports without it.
Tests: tests/backends/test_megatron_cpu.py (needs tools/setup-megatron-cpu's environment).
"""

from __future__ import annotations

import contextlib
import importlib.util
import types
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
        _route_schedule_zeros()
        _ACTIVATED.append("pipeline_parallel.schedules: torch.zeros(device='cuda') -> cpu")
        _route_tied_embedding_cuda()
        _ACTIVATED.append("LanguageModule.setup_embeddings_and_output_layer: Tensor.cuda() -> itself")
        _route_checkpoint_preload()
        _ACTIVATED.append("FileSystemWriterAsync.preload_tensors: non_blocking=False")
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


class _TorchWithCpuZeros(types.ModuleType):
    """torch, except that ``zeros(..., device="cuda")`` builds the tensor on the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*size: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return torch.zeros(*size, device=device, **kwargs)


def _route_schedule_zeros() -> None:
    from megatron.core.pipeline_parallel import schedules

    if not isinstance(schedules.torch, _TorchWithCpuZeros):
        schedules.torch = _TorchWithCpuZeros("torch")  # type: ignore[assignment]


def _route_tied_embedding_cuda() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer
    if getattr(original, "_relax_cpu", False):
        return

    def setup_embeddings_and_output_layer(self: Any) -> None:
        tensor_cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor  # type: ignore[method-assign]
        try:
            original(self)
        finally:
            torch.Tensor.cuda = tensor_cuda  # type: ignore[method-assign]

    setup_embeddings_and_output_layer._relax_cpu = True  # type: ignore[attr-defined]
    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


def _route_checkpoint_preload() -> None:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    original = FileSystemWriterAsync.preload_tensors
    if getattr(original, "_relax_cpu", False):
        return

    def preload_tensors(write_buckets: Any, non_blocking: bool = True) -> Any:
        return original(write_buckets, non_blocking=False)

    preload_tensors._relax_cpu = True  # type: ignore[attr-defined]
    FileSystemWriterAsync.preload_tensors = staticmethod(preload_tensors)  # type: ignore[method-assign]


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
