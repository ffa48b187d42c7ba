"""Megatron on CPU vs Hugging Face on one model directory; run by the Megatron env's python.

    .venv-megatron/bin/python tests/backends/megatron_logits_check.py --model DIR --tp 2

Spawns ``--tp`` processes joined by a gloo group. Each one: ``megatron_cpu_stubs.install()``,
``relax_hpc.backends.megatron_cpu.activate("cpu")``, megatron's parallel state at TP=N, then
``AutoBridge.from_hf_pretrained`` -> ``to_megatron_provider(load_weights=True)`` with the local
layer spec, fp32 and every fusion off -> one forward with an explicit causal mask. Per-token
log-probs and entropies come from the vocab-parallel logits with
``vocab_parallel_logprobs_and_entropy`` (no gather); the logits are gathered only to compare
them. Rank 0 compares all three with the HF model, and ``export_hf_weights`` with the HF state
dict. Prints one JSON line with the numbers (tests/backends/test_megatron_cpu.py judges them);
exits non-zero only when a rank fails to run.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import torch.distributed as dist

INPUT_IDS = [[1, 5, 12, 7, 30, 9, 3, 44, 17, 2, 11, 26], [4, 4, 19, 33, 8, 0, 21, 6, 40, 13, 27, 2]]


def build_megatron(model_dir: str, tp: int) -> tuple[Any, Any, Any]:
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.gpt_provider import local_layer_spec
    from megatron.core.transformer.enums import AttnBackend

    bridge = AutoBridge.from_hf_pretrained(model_dir, dtype=torch.float32)
    provider = bridge.to_megatron_provider(load_weights=True)
    provider.transformer_layer_spec = local_layer_spec
    provider.attention_backend = AttnBackend.local
    provider.tensor_model_parallel_size = tp
    provider.pipeline_model_parallel_size = 1
    provider.params_dtype = provider.autocast_dtype = torch.float32
    provider.bf16 = provider.fp16 = False
    provider.use_cpu_initialization = True
    for fusion in ("gradient_accumulation_fusion", "bias_activation_fusion", "bias_dropout_fusion",
                   "masked_softmax_fusion", "apply_rope_fusion", "persist_layer_norm"):
        setattr(provider, fusion, False)
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    return bridge, provider, model[0]


def run_rank(rank: int, tp: int, port: int, model_dir: str, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(tp), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=tp)  # before the bridge tries NCCL
    import megatron_cpu_stubs

    megatron_cpu_stubs.install()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from relax_hpc.algos.vocab_parallel import vocab_parallel_logprobs_and_entropy
    from relax_hpc.backends import megatron_cpu

    routes = megatron_cpu.activate("cpu")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(0)
    bridge, provider, model = build_megatron(model_dir, tp)
    model.eval()
    ids = torch.tensor(INPUT_IDS)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    group = parallel_state.get_tensor_model_parallel_group()
    with torch.no_grad():
        mask = megatron_cpu.causal_mask(ids.shape[1])
        local = model(input_ids=ids, position_ids=positions, attention_mask=mask)
        logp, entropy = vocab_parallel_logprobs_and_entropy(
            local[:, :-1], ids[:, 1:], group=group, vocab_start=rank * local.shape[-1])
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local.contiguous(), group=group)  # contiguous: the gloo trap
    exported = dict(bridge.export_hf_weights([model], cpu=True))  # a collective over TP ranks
    if rank == 0:
        results.put(compare_with_hf(model_dir, ids, torch.cat(parts, -1), logp, entropy, exported)
                    | {"tp": tp, "routes": routes, "rotary_base": provider.rotary_base,
                       "bridge": type(bridge._model_bridge).__name__})
    dist.barrier()
    dist.destroy_process_group()


def compare_with_hf(model_dir: str, ids: torch.Tensor, logits: torch.Tensor, logp: torch.Tensor,
                    entropy: torch.Tensor, exported: dict[str, torch.Tensor]) -> dict[str, Any]:
    import megatron.bridge
    import megatron.core
    import transformers
    from transformers import AutoModelForCausalLM

    from relax_hpc.algos.logprobs import token_logprobs_and_entropy

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        ref_logp, ref_entropy = token_logprobs_and_entropy(ref[:, :-1], ids[:, 1:])
    # The HF state dict as saved: tied weights (lm_head = embed_tokens here) appear once.
    from safetensors.torch import load_file

    saved = set(load_file(os.path.join(model_dir, "model.safetensors")))
    state = {name: tensor for name, tensor in hf.state_dict().items() if name in saved}
    common = sorted(set(exported) & set(state))
    return {
        "hf_vocab": ref.shape[-1], "megatron_vocab": logits.shape[-1],
        "hf_rope_theta": getattr(hf.config, "rope_theta", None),
        "logits_max_abs_diff": (logits - ref).abs().max().item() if logits.shape == ref.shape else None,
        "logprob_max_abs_diff": (logp - ref_logp).abs().max().item(),
        "entropy_max_abs_diff": (entropy - ref_entropy).abs().max().item(),
        "export_missing": sorted(set(state) - set(exported)),
        "export_extra": sorted(set(exported) - set(state)),
        "export_not_equal": [k for k in common if not torch.equal(exported[k], state[k])],
        "export_tensors": len(common),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "megatron.core": megatron.core.__version__,
                     "megatron.bridge": megatron.bridge.__version__},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    from megatron_ranks import run_ranks

    results = run_ranks("megatron_logits_check", args.tp, run_rank,
                        lambda rank, port, results: (rank, args.tp, port, args.model, results))
    print(json.dumps(results.get()))


if __name__ == "__main__":
    main()
