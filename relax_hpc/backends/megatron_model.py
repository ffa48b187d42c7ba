"""Build a Megatron-core GPT model from a Hugging Face directory through megatron-bridge.

The order matters, and each step below is there because the alternative fails:

1. ``megatron_cpu.activate(device)`` (a no-op off CPU), then megatron's parallel state on the
   trainer's process group (``start_parallel_state``). The bridge would otherwise call
   ``torch.cuda.set_device`` and ``init_process_group("nccl")`` itself.
2. ``AutoBridge.from_hf_pretrained`` -> ``to_megatron_provider(load_weights=True)``; the provider
   gets the parallel sizes of ``[train.megatron]``, the dtype, recomputation, and on CPU (or
   wherever Transformer Engine is not installed) the local layer spec with every fusion off.
3. ``provide_distributed_model(wrap_with_ddp=False)`` builds this rank's pipeline stage and
   loads its shard of the HF weights. Megatron's ``DistributedDataParallel`` is then built
   directly (the bridge's own DDP wrap creates a ``torch.cuda.Stream``, which fails on CPU).

Gradients are summed over data-parallel ranks, never averaged (``calculate_per_token_loss``):
the loss of every micro-batch is already divided by the whole step's token (or sequence) count,
as in the torch backend. ``finalize_grads`` runs Megatron's ``finalize_model_grads`` (data-parallel
reduction, tied-embedding and sequence-parallel layer-norm reductions) without its own scaling.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from relax_hpc.backends import megatron_cpu
from relax_hpc.spec.schema import MegatronSpec

INSTALL_HINT = (
    "install it with `pip install 'relax-hpc[megatron]'` plus megatron-bridge 0.3.1 "
    "(`pip install --no-deps megatron-bridge==0.3.1 omegaconf einops`), or build the CPU "
    "environment with tools/setup-megatron-cpu and run relax-hpc with .venv-megatron/bin/relax-hpc"
)
FUSIONS = ("gradient_accumulation_fusion", "bias_activation_fusion", "bias_dropout_fusion",
           "masked_softmax_fusion", "apply_rope_fusion", "persist_layer_norm")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def has_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def start_parallel_state(spec: MegatronSpec, device: str, seed: int) -> list[str]:
    """Megatron's tensor/pipeline/context/expert groups over the trainer's world group.

    One process without a group gets a single-rank one (gloo on CPU, NCCL on CUDA). Returns
    the CPU routes in place (``megatron_cpu.activate``)."""
    if not dist.is_initialized():
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    routes = megatron_cpu.activate(device)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()  # a second backend in one process (tests)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=spec.tensor_parallel,
        pipeline_model_parallel_size=spec.pipeline_parallel,
        context_parallel_size=spec.context_parallel,
        expert_model_parallel_size=spec.expert_parallel,
    )
    model_parallel_cuda_manual_seed(seed)
    return routes


@dataclass
class BuiltModel:
    """One rank's model: ``model`` (DDP-wrapped when trained), its bridge and provider (config)."""

    bridge: Any
    provider: Any
    model: Any

    @property
    def module(self) -> Any:
        """The bare GPTModel (no DDP / Float16Module wrapper)."""
        from megatron.core.utils import unwrap_model

        return unwrap_model(self.model)


def make_provider(model_path: str, spec: MegatronSpec, *, dtype: str, device: str,
                  routing_replay: bool = False) -> tuple[Any, Any]:
    """(bridge, provider) for ``model_path`` with the sizes and switches of ``spec``."""
    try:
        from megatron.bridge import AutoBridge
        from megatron.bridge.models.gpt_provider import local_layer_spec
        from megatron.core.transformer.enums import AttnBackend
    except ImportError as error:
        raise RuntimeError(f'[train] backend = "megatron" cannot import megatron-bridge ({error}); '
                           f"{INSTALL_HINT}") from error
    if dtype not in DTYPES:
        raise ValueError(f"[model] dtype = {dtype!r}: the megatron backend takes {', '.join(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    bridge = AutoBridge.from_hf_pretrained(model_path, dtype=torch_dtype)
    provider = bridge.to_megatron_provider(load_weights=True)
    on_cpu = torch.device(device).type == "cpu"
    if on_cpu or not has_transformer_engine():
        provider.transformer_layer_spec = local_layer_spec
        provider.attention_backend = AttnBackend.local
        for fusion in FUSIONS:
            setattr(provider, fusion, False)
        # Mixture-of-experts layers without TE: one expert after another (no grouped GEMM), and the
        # allgather dispatcher (alltoall creates a torch.cuda.Stream when it is built).
        provider.moe_grouped_gemm = provider.moe_permute_fusion = False
        provider.moe_token_dispatcher_type = "allgather"
        _route_moe_gating_without_te()
    provider.tensor_model_parallel_size = spec.tensor_parallel
    provider.pipeline_model_parallel_size = spec.pipeline_parallel
    provider.context_parallel_size = spec.context_parallel
    provider.expert_model_parallel_size = spec.expert_parallel
    provider.sequence_parallel = spec.sequence_parallel
    provider.params_dtype = provider.pipeline_dtype = torch_dtype
    provider.autocast_dtype = torch_dtype
    provider.bf16, provider.fp16 = torch_dtype == torch.bfloat16, torch_dtype == torch.float16
    provider.use_cpu_initialization = on_cpu
    provider.calculate_per_token_loss = True  # gradients summed over ranks: see the module docstring
    provider.variable_seq_lengths = False  # every micro-batch of a call has one shape
    provider.batch_p2p_sync = not on_cpu  # its torch.cuda.synchronize() cannot run on CPU
    provider.attention_dropout = provider.hidden_dropout = 0.0  # recomputed log-probs must be exact
    if spec.recompute != "none":
        provider.recompute_granularity = spec.recompute
        if spec.recompute == "full":
            provider.recompute_method, provider.recompute_num_layers = "uniform", 1
    provider.moe_enable_routing_replay = routing_replay
    if provider.num_moe_experts and not provider.moe_grouped_gemm and spec.expert_parallel > 1:
        raise ValueError(
            f"[train.megatron] expert_parallel = {spec.expert_parallel}: without Transformer Engine's grouped-GEMM "
            "experts (as on CPU) megatron-bridge 0.3.1 does not convert split experts correctly (the model it "
            "builds at expert_parallel = 2 disagrees with the HF model, and its export names only grouped "
            "experts); set expert_parallel = 1 here, or run where Transformer Engine is installed")
    # The bridge turns initialization off (the HF weights overwrite it), but megatron-core marks
    # tensor-parallel parameters (``tensor_model_parallel``, ``partition_dim``) only while
    # initializing them; unmarked, every TP shard counts as a replica in gradient-norm clipping
    # and sequence-parallel reductions. So initialize (then load): a little time at start.
    provider.perform_initialization = True
    provider.finalize()
    return bridge, provider


def _route_moe_gating_without_te() -> None:
    """megatron-core 0.16.1's ``RouterGatingLinearFunction`` reads ``moe_utils.te_general_gemm``, a
    name defined only when Transformer Engine imports: without TE every MoE forward raises
    NameError. None selects its plain-torch matmul."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_model(bridge: Any, provider: Any, *, train: bool, distributed_optimizer: bool,
                prepare: Callable[[Any], None] | None = None) -> BuiltModel:
    """This rank's stage of the model with the HF weights; DDP-wrapped when ``train``, after
    ``prepare`` changed the bare model (the critic's value head: ``megatron_value``)."""
    cpu = bool(provider.use_cpu_initialization)
    stages = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=cpu)
    if len(stages) != 1:
        raise ValueError("virtual pipeline stages are not supported by the megatron backend")
    model = stages[0]
    hf_vocab = int(bridge.hf_pretrained.config.vocab_size)
    if int(provider.vocab_size) != hf_vocab:
        raise ValueError(f"Megatron's vocabulary ({provider.vocab_size}) differs from the HF model's "
                         f"({hf_vocab}); padded vocabularies would enter the softmax")
    if prepare is not None:
        prepare(model)
    if not train:
        model.eval()
        model.requires_grad_(False)
        return BuiltModel(bridge, provider, model)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, average_in_collective=False,
        use_distributed_optimizer=distributed_optimizer,
    )
    wrapped = DistributedDataParallel(config=provider, ddp_config=ddp_config, module=model)
    # Megatron's reductions without its per-token scaling (the loss is scaled already).
    provider.finalize_model_grads_func = lambda chunks, num_tokens=None, **kw: finalize_model_grads(
        chunks, None, **kw)
    provider.no_sync_func = wrapped.no_sync
    wrapped.train()
    return BuiltModel(bridge, provider, wrapped)
