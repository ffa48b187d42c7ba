"""Megatron routing replay (R3) on CPU vs the engine's recorded routing; run by the Megatron env's python.

    .venv-megatron/bin/python tests/backends/megatron_replay_check.py --model DIR --engine FILE [--engine FILE2]
        [--tp N] [--ep N]

Each FILE (torch.save) holds an engine's samples: ``tokens``, ``prompt_length``, ``logprobs`` (of
the response tokens) and ``routes`` (``[tokens - 1, layers, k]``). Spawns ``tp * ep`` gloo
processes; each builds the tiny MoE in fp32 through megatron-bridge with
``moe_enable_routing_replay`` (SequentialMLP experts, the allgather dispatcher, no fusions), then
runs each file's samples as one right-padded micro-batch twice: with free routing and inside
`relax_hpc.backends.megatron_replay.replayed_routing`. A hook on every ``TopKRouter`` keeps the
routing map it produced. Rank 0 prints one JSON line: per file and mode, the mean / max
|trainer - engine| log-prob over the response tokens and how many (token, layer) expert sets
differ from the engine's; tests/backends/test_megatron_routing_replay.py judges them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from typing import Any

import torch
import torch.distributed as dist


def build_moe(model_dir: str, tp: int, ep: int) -> Any:
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.gpt_provider import local_layer_spec
    from megatron.core.transformer.enums import AttnBackend

    bridge = AutoBridge.from_hf_pretrained(model_dir, dtype=torch.float32)
    provider = bridge.to_megatron_provider(load_weights=True)
    provider.transformer_layer_spec = local_layer_spec
    provider.attention_backend = AttnBackend.local
    provider.tensor_model_parallel_size = tp
    provider.pipeline_model_parallel_size = 1
    provider.expert_model_parallel_size = ep
    provider.params_dtype = provider.autocast_dtype = torch.float32
    provider.bf16 = provider.fp16 = False
    provider.use_cpu_initialization = True
    for fusion in ("gradient_accumulation_fusion", "bias_activation_fusion", "bias_dropout_fusion",
                   "masked_softmax_fusion", "apply_rope_fusion", "persist_layer_norm", "moe_permute_fusion",
                   "moe_grouped_gemm"):  # grouped GEMM needs TE or grouped_gemm: SequentialMLP instead
        setattr(provider, fusion, False)
    provider.moe_token_dispatcher_type = "allgather"  # alltoall makes a torch.cuda.Stream at build
    provider.moe_enable_routing_replay = True
    provider.finalize()
    return provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)[0]


def run_rank(rank: int, tp: int, ep: int, port: int, model_dir: str, engine_files: list[str],
             results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(tp * ep), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=tp * ep)  # before the bridge tries NCCL
    import megatron_cpu_stubs

    megatron_cpu_stubs.install()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from relax_hpc.backends import megatron_cpu

    megatron_cpu.activate("cpu")
    route_moe_gating_without_te()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(0)
    model = build_moe(model_dir, tp, ep)
    model.eval()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    runs = []
    for engine_file in engine_files:
        samples = torch.load(engine_file, weights_only=True)
        runs.append({"engine": engine_file, "free": forward(model, samples, tp_rank, replay=False),
                     "replay": forward(model, samples, tp_rank, replay=True), "samples": len(samples),
                     "response_tokens": sum(len(s["logprobs"]) for s in samples)})
    if rank == 0:
        results.put({"tp": tp, "ep": ep, "routers": len(model_routers(model)), "runs": runs})
    dist.barrier()
    dist.destroy_process_group()


def route_moe_gating_without_te() -> None:
    """megatron-core 0.16.1's ``RouterGatingLinearFunction`` reads ``te_general_gemm``, a name its
    module defines only when Transformer Engine imports: without TE every MoE forward raises
    NameError. None selects its plain-torch matmul. (A CPU route that belongs with
    relax_hpc.backends.megatron_cpu.activate; kept here until it is there.)"""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def model_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def forward(model: Any, samples: list[dict[str, Any]], tp_rank: int, replay: bool) -> dict[str, Any]:
    from megatron.core import parallel_state

    from relax_hpc.algos.vocab_parallel import vocab_parallel_logprobs_and_entropy
    from relax_hpc.backends import megatron_cpu
    from relax_hpc.backends.megatron_replay import pack_routes, replayed_routing

    lengths = [len(s["tokens"]) for s in samples]
    width = max(lengths)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : lengths[i]] = torch.tensor(s["tokens"])
    packed = pack_routes([s["routes"] for s in samples], lengths, width)  # [B, S, layers, k]
    maps: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, i, out: maps.append(out[1].detach()))
             for r in model_routers(model)]
    positions = torch.arange(width).expand_as(ids)
    replaying = replayed_routing(model, packed) if replay else contextlib.nullcontext()
    with torch.no_grad(), replaying:
        local = model(input_ids=ids, position_ids=positions, attention_mask=megatron_cpu.causal_mask(width))
        logp, _ = vocab_parallel_logprobs_and_entropy(
            local[:, :-1], ids[:, 1:], group=parallel_state.get_tensor_model_parallel_group(),
            vocab_start=tp_rank * local.shape[-1])
    for hook in hooks:
        hook.remove()
    diffs = []
    for i, s in enumerate(samples):
        p = s["prompt_length"]
        diffs.append((logp[i, p - 1: lengths[i] - 1] - torch.tensor(s["logprobs"])).abs())
    diff = torch.cat(diffs)
    return {"mean_abs_diff": diff.mean().item(), "max_abs_diff": diff.max().item(),
            "route_mismatches": route_mismatches(maps, packed, lengths), "routes_compared": routes_compared(
                packed, lengths)}


def route_mismatches(maps: list[torch.Tensor], packed: torch.Tensor, lengths: list[int]) -> int:
    """(token, layer) pairs, over recorded positions, whose routing map is not the engine's set."""
    batch, seq = packed.shape[:2]
    recorded = torch.arange(seq)[None, :] < (torch.tensor(lengths)[:, None] - 1)  # [B, S]
    count = 0
    for layer, routing_map in enumerate(maps):
        chosen = routing_map.reshape(seq, batch, -1).transpose(0, 1)  # Megatron's [S, B] -> [B, S]
        engine = torch.zeros_like(chosen).scatter_(-1, packed[:, :, layer], True)
        count += int(((chosen != engine).any(-1) & recorded).sum())
    return count


def routes_compared(packed: torch.Tensor, lengths: list[int]) -> int:
    return sum(n - 1 for n in lengths) * packed.shape[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--engine", required=True, action="append", help="repeat for several files")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    args = parser.parse_args()
    from megatron_ranks import run_ranks

    results = run_ranks("megatron_replay_check", args.tp * args.ep, run_rank,
                        lambda rank, port, results: (rank, args.tp, args.ep, port, args.model, args.engine, results))
    print(json.dumps(results.get()))


if __name__ == "__main__":
    main()
