"""MegatronBackend vs Hugging Face and vs TorchBackend; run by the Megatron env's python.

    .venv-megatron/bin/python tests/backends/megatron_backend_check.py SCENARIO --model DIR \
        --ranks N [--tp N] [--pp N] [--ckpt DIR] [--out FILE]

Spawns ``--ranks`` processes joined by a gloo group, as trainer ranks are, builds the backend
through ``make_backend("megatron", ...)`` and runs one scenario; rank 0 prints one JSON line of
numbers (tests/backends/test_megatron_backend.py judges them); exits non-zero when a rank fails.
``SCENARIO`` may name several, comma-separated (``match,save``): the same ranks run them one
after the other, each on a backend built afresh (a Megatron rank takes about 10 s of imports on
2 cores, so the tests share launches), and the JSON line maps each scenario to its numbers.
A scenario may name its own layout after ``@`` (``match,save,match@pp2``: the same two ranks
then run the match scenario again as two pipeline stages, Megatron's groups rebuilt for it).

- ``match``: ``compute_log_probs`` vs HF's per-token log-probs on the same samples; then one
  optimizer step (GRPO, no clipping) on them: the gradients, exported to HF names through the
  bridge, vs TorchBackend's on the same batch and loss, and the step's stats.
- ``save``: one step on batch 1, checkpoint (step 1), then a second step on batch 2; writes the
  weights and AdamW moments (HF names) after step 1 and the step-2 stats to ``--out``.
- ``resume``: load the newest checkpoint from ``--ckpt`` (step s); writes the same as ``save``
  to ``--out`` (the weights and moments as loaded, the stats of the step on batch s + 1). With
  ``--save-next`` that step is checkpointed as step s + 1, and ``--out`` also holds, under
  ``next``, what a ``resume`` from it must find: the weights and moments after it and the stats
  of the step on batch s + 2. One such run checks one reshard and prepares the reverse one.
- ``replay`` (``--moe-model``, a tiny MoE): a bfloat16 native engine samples with its routing
  recorded; the float32 backend, built with routing replay, recomputes the log-probs of the
  rows (through the queue's row format) with the routes and without, then trains one step on
  them; rank 0 reports both disagreements with the engine and the step's stats.
- ``bf16``: a bfloat16 backend takes one step at lr 1e-6; reports how many elements of the
  float32 masters and of the bf16 parameters changed, then checkpoints (in a scratch directory)
  and resumes into a fresh backend (its masters and moments against the saver's), and exports it.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# Two groups of GRPO samples on the tiny model's vocabulary (ids < 48); responses of mixed length.
PROMPTS = [[4, 13, 5, 16], [3, 16], [7, 8, 9], [11, 12, 5, 6, 30]]
RESPONSES = [[6, 2], [3, 3, 2], [14, 2], [21, 22, 23, 2]]
ADVANTAGES = [1.0, -0.5, 0.5, -0.25]


def samples(shift: int = 0) -> list[Any]:
    from relax_hpc.data.sample import Sample

    return [Sample(p, [(t + shift) % 40 for t in r], [-0.7] * len(r), 0, group_id=i // 2,
                   prompt_index=i, advantage=a)
            for i, (p, r, a) in enumerate(zip(PROMPTS, RESPONSES, ADVANTAGES))]


def make(kind: str, model: str, tp: int, pp: int, routing_replay: bool = False, ep: int = 1,
         dtype: str = "float32", lr: float = 1e-2) -> Any:
    from relax_hpc.backends.base import make_backend
    from relax_hpc.spec.schema import AlgorithmSpec, MegatronSpec, TrainSpec

    optim = TrainSpec(steps=1, lr=lr, grad_clip=0.0, micro_batch_size=2, weight_decay=0.01)
    return make_backend(kind, model, optim, AlgorithmSpec(name="grpo"), dtype=dtype, device="cpu",
                        temperature=1.0, teacher_path=None, opd_coef=1.0, keep_reference=False,
                        strategy="ddp", megatron=MegatronSpec(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep),
                        routing_replay=routing_replay)


def hf_named(backend: Any, swap: str | None = None) -> dict[str, torch.Tensor]:
    """The model's tensors with HF names (collective); ``swap``: instead of the weights, the
    gradients ("main_grad") or an AdamW moment ("exp_avg", "exp_avg_sq"), put in the weights'
    place for the export: the bridge's conversion only permutes, splits and joins tensors."""
    params = [p for p in backend.built.module.parameters()]
    saved = [p.data for p in params]
    if swap is not None:
        state = backend.optimizer.optimizer.state
        for p in params:
            p.data = p.main_grad if swap == "main_grad" else state[backend.optimizer.master(p)][swap]
    try:
        return {n: t.clone() for n, t in backend.named_weights()}
    finally:
        for p, data in zip(params, saved):
            p.data = data


def split_scenario(scenario: str, args: argparse.Namespace) -> tuple[str, int, int]:
    """``match`` -> (match, --tp, --pp); ``match@pp2`` -> (match, 1, 2); ``match@tp2`` -> (match, 2, 1)."""
    name, _, layout = scenario.partition("@")
    if not layout:
        return name, args.tp, args.pp
    kind, size = layout[:2], layout[2:]
    if kind not in ("tp", "pp") or not size.isdigit():
        raise ValueError(f"scenario {scenario!r}: the layout after @ is tpN or ppN")
    return (name, int(size), 1) if kind == "tp" else (name, 1, int(size))


def scenario(name: str, args: argparse.Namespace, rank: int) -> dict[str, Any]:
    from relax_hpc.ckpt import CheckpointManager, ResumeState

    name, tp, pp = split_scenario(name, args)
    if name == "replay":
        return replay_scenario(args, tp, pp)
    if name == "bf16":
        return bf16_scenario(args, tp, pp)
    torch.manual_seed(0)  # each scenario of a launch starts as a launch of its own would
    backend = make("megatron", args.model, tp, pp, ep=args.ep)  # a second one rebuilds Megatron's groups
    result: dict[str, Any] = {"routes": backend.routes, "reads_rows": backend.reads_rows}
    if name == "match":
        result["logprobs"] = backend.compute_log_probs(samples())
        captured: dict[str, torch.Tensor] = {}
        step = backend.optimizer.step

        def capture_then_step() -> float:
            captured.update(hf_named(backend, "main_grad"))
            return step()

        backend.optimizer.step = capture_then_step
        result["stats"] = backend.train(samples() if backend.reads_rows else [])
        result["grads"] = captured
    elif name in ("save", "resume"):
        manager = CheckpointManager(Path(args.ckpt), keep_last=2)
        if name == "save":
            backend.train(samples() if backend.reads_rows else [])
            backend.save_checkpoint(manager, ResumeState(step=1, weight_version=1, data_cursor={},
                                                         samples_trained=4))
            step = 1
        else:
            state = backend.load_checkpoint(manager)
            result["resumed_step"] = step = None if state is None else state.step
            assert step is not None, f"no checkpoint in {args.ckpt}"
        result["tensors"] = moments_and_weights(backend)
        result["stats"] = backend.train(samples(shift=5 * step) if backend.reads_rows else [])
        if name == "resume" and args.save_next:
            backend.save_checkpoint(manager, ResumeState(step=step + 1, weight_version=step + 1, data_cursor={},
                                                         samples_trained=4 * (step + 1)))
            after = moments_and_weights(backend)
            result["next"] = {"tensors": after,
                              "stats": backend.train(samples(shift=5 * (step + 1)) if backend.reads_rows else [])}
    return result


def moments_and_weights(backend: Any) -> dict[str, dict[str, torch.Tensor]]:
    return {"weights": hf_named(backend), "exp_avg": hf_named(backend, "exp_avg"),
            "exp_avg_sq": hf_named(backend, "exp_avg_sq")}


def changed_fraction(after: list[torch.Tensor], before: list[torch.Tensor]) -> float:
    changed = sum(int((a.float() != b.float()).sum()) for a, b in zip(after, before))
    return changed / sum(a.numel() for a in after)


def memory_figures(backend: Any, model: str) -> dict[str, Any]:
    """The rank's memory record beside what it should count: its parameters' elements and the
    whole model's (the HF model's parameters, tied embeddings once)."""
    from transformers import AutoModelForCausalLM

    from relax_hpc.roles.memory import trainer_record

    params = backend.optimizer.params
    return {"record": trainer_record(backend, 0, {}).as_dict(),
            "local_elements": sum(p.numel() for p in params), "local_tensors": len(params),
            "model_elements": sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model).parameters())}


def bf16_scenario(args: argparse.Namespace, tp: int, pp: int) -> dict[str, Any]:
    """A bfloat16 model, one step at lr 1e-6: how much of the float32 masters and of the bf16
    parameters changed (this rank's shard), then a checkpoint resumed by a fresh backend (its
    masters against the saver's), and the export of the resumed model through the bridge."""
    from relax_hpc.ckpt import CheckpointManager, ResumeState

    torch.manual_seed(0)
    backend = make("megatron", args.model, tp, pp, dtype="bfloat16", lr=1e-6)
    optimizer = backend.optimizer
    params_before = [p.detach().clone() for p in optimizer.params]
    masters_before = [m.detach().clone() for m in optimizer.masters]
    stats = backend.train(samples() if backend.reads_rows else [])
    result: dict[str, Any] = {
        "param_dtypes": sorted({str(p.dtype) for p in optimizer.params}),
        "master_dtypes": sorted({str(m.dtype) for m in optimizer.masters}),
        "masters_changed": changed_fraction(optimizer.masters, masters_before),
        "params_changed": changed_fraction(optimizer.params, params_before),
        "master_max_step": max((m - b).abs().max().item() for m, b in zip(optimizer.masters, masters_before)),
        # The compute copy is the master rounded to bf16, so nothing else moved the parameters.
        "params_are_rounded_masters": all(torch.equal(p, m.to(p.dtype))
                                          for p, m in zip(optimizer.params, optimizer.masters)),
        "stats": stats,
        "memory": memory_figures(backend, args.model),
    }
    manager = CheckpointManager(Path(args.bf16_ckpt), keep_last=1)
    backend.save_checkpoint(manager, ResumeState(step=1, weight_version=1, data_cursor={}, samples_trained=4))
    resumed = make("megatron", args.model, tp, pp, dtype="bfloat16", lr=1e-6)
    result["resumed_step"] = resumed.load_checkpoint(manager).step
    result["resumed_masters_max_diff"] = max((a - b).abs().max().item()
                                             for a, b in zip(resumed.optimizer.masters, optimizer.masters))
    result["resumed_params_equal"] = all(torch.equal(a, b) for a, b in zip(resumed.optimizer.params, optimizer.params))
    state, saved = resumed.optimizer.optimizer.state, optimizer.optimizer.state
    result["resumed_moments_equal"] = all(
        torch.equal(state[a][k], saved[b][k]) for a, b in zip(resumed.optimizer.masters, optimizer.masters)
        for k in ("exp_avg", "exp_avg_sq"))
    exported = {n: t for n, t in resumed.named_weights()}  # collective; rank 0 gets the tensors
    result["export_names"] = len(exported)
    result["export_dtypes"] = sorted({str(t.dtype) for t in exported.values()})
    return result


def engine_samples(model: str) -> list[Any]:
    """Greedy bfloat16 generations of the tiny MoE with routing recorded, as the trainer gets them:
    through the queue's row format (sample_to_row / row_to_sample)."""
    from relax_hpc.data.rows import row_to_sample, sample_to_row
    from relax_hpc.data.sample import Sample
    from relax_hpc.engines.base import SamplingParams
    from relax_hpc.engines.native import NativeEngine

    engine = NativeEngine(model, dtype="bfloat16", device="cpu", record_routing=True)
    prompts = [[4, 13, 5, 16], [3, 16, 9], [7, 8, 9, 10, 11], [11, 12, 5, 6, 30], [20, 21], [33, 2, 17]]
    generations = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0, top_k=1), seed=0)
    rows = [sample_to_row(Sample(g.prompt_ids, g.token_ids, g.logprobs, 0, group_id=i // 2, prompt_index=i,
                                 advantage=1.0 if i % 2 else -1.0, routed_experts=g.routed_experts))
            for i, g in enumerate(generations)]
    return [row_to_sample(row) for row in rows]


def replay_scenario(args: argparse.Namespace, tp: int, pp: int) -> dict[str, Any]:
    import dataclasses

    torch.manual_seed(0)
    backend = make("megatron", args.moe_model, tp, pp, routing_replay=True)
    routed = engine_samples(args.moe_model)
    free = [dataclasses.replace(s, routed_experts=None) for s in routed]
    engine = [torch.tensor(s.rollout_log_probs) for s in routed]

    def disagreement(samples: list[Any]) -> tuple[float, float]:
        got = backend.compute_log_probs(samples)  # every rank, as the match scenario
        diffs = torch.cat([(torch.tensor(g) - e).abs() for g, e in zip(got, engine)])
        return diffs.mean().item(), diffs.max().item()

    (replay_mean, replay_max), (free_mean, free_max) = disagreement(routed), disagreement(free)
    stats = backend.train(routed if backend.reads_rows else [])
    try:
        dict(backend.named_weights())
        export = "exported"
    except RuntimeError as error:
        export = str(error)
    return {"export": export, "replay_mean": replay_mean, "replay_max": replay_max, "free_mean": free_mean, "free_max": free_max,
            "tokens": sum(len(s.response_ids) for s in routed), "stats": stats}


def compare_logprobs(model: str, got: list[list[float]]) -> dict[str, Any]:
    from relax_hpc.backends.batch import pack_samples
    from relax_hpc.models.hf import load_causal_lm

    hf = load_causal_lm(model, dtype="float32", device="cpu").eval()
    batch = pack_samples(samples(), 0)
    with torch.no_grad():
        from relax_hpc.algos.logprobs import token_logprobs_and_entropy

        logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        ref, _ = token_logprobs_and_entropy(logits[:, :-1], batch.targets)
    diff = 0.0
    for i, s in enumerate(samples()):
        p = len(s.prompt_ids)
        want = ref[i, p - 1 : p - 1 + len(s.response_ids)]
        diff = max(diff, (torch.tensor(got[i]) - want).abs().max().item())
    return {"logprob_max_abs_diff": diff, "tokens": sum(len(r) for r in got)}


def compare_grads(model: str, got: dict[str, torch.Tensor], stats: dict[str, float]) -> dict[str, Any]:
    torch_backend = make("torch", model, 1, 1)
    torch_stats = torch_backend.train(samples())
    want = {n: p.grad for n, p in torch_backend.model.named_parameters() if p.grad is not None}
    common = sorted(set(got) & set(want))
    diffs = {n: (got[n] - want[n]).abs().max().item() for n in common}
    return {
        "grad_names": len(common), "grad_missing": sorted(set(want) - set(got)),
        "grad_extra": sorted(set(got) - set(want)),
        "grad_max_abs_diff": max(diffs.values()),
        "grad_max_abs": max(want[n].abs().max().item() for n in common),
        "grad_norm_of_export": sum(g.double().pow(2).sum().item() for g in got.values()) ** 0.5,
        "stats": stats, "torch_stats": torch_stats,
    }


def run_rank(rank: int, args: argparse.Namespace, port: int, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.ranks > 1:
        dist.init_process_group("gloo", rank=rank, world_size=args.ranks)  # as the trainer role does
    import megatron_cpu_stubs

    megatron_cpu_stubs.install()  # in this env a .pth file does it at start; harmless twice
    results_by_name = {name: scenario(name, args, rank) for name in args.scenarios}
    if rank == 0:
        torch.save(results_by_name, args.result_file)
        results.put(True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main(argv: Iterator[str] | None = None) -> None:
    names = ("match", "save", "resume", "replay", "bf16")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", help=f"one of {', '.join(names)}, or several comma-separated")
    parser.add_argument("--model", required=True)
    parser.add_argument("--moe-model", help="the tiny MoE of the replay scenario")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--ckpt")
    parser.add_argument("--out")
    parser.add_argument("--save-next", action="store_true")
    args = parser.parse_args(None if argv is None else list(argv))
    args.scenarios = args.scenario.split(",")
    try:
        plain = [split_scenario(s, args)[0] for s in args.scenarios]
    except ValueError as error:
        parser.error(str(error))
    unknown = sorted(set(plain) - set(names))
    if unknown or len(set(args.scenarios)) != len(args.scenarios) or {"save", "resume"} <= set(plain):
        parser.error(f"scenario {args.scenario!r}: each of {', '.join(names)} at most once, not both save and resume")
    if "replay" in plain and not args.moe_model:
        parser.error("the replay scenario needs --moe-model")
    import tempfile

    with tempfile.TemporaryDirectory(prefix="megatron-check-") as scratch:
        args.result_file = os.path.join(scratch, "result.pt")
        args.bf16_ckpt = os.path.join(scratch, "bf16-checkpoints")
        from megatron_ranks import run_ranks

        run_ranks("megatron_backend_check", args.ranks, run_rank, lambda rank, port, results: (rank, args, port, results))
        results = torch.load(args.result_file, weights_only=False)
    # Compared here, without a process group: the torch backend would join the ranks' group.
    for scenario_name, result in results.items():
        name = split_scenario(scenario_name, args)[0]
        if name == "match":
            result.update(compare_logprobs(args.model, result.pop("logprobs")))
            result.update(compare_grads(args.model, result.pop("grads"), result.pop("stats")))
        elif name in ("save", "resume"):
            torch.save({"tensors": result.pop("tensors"), "stats": result["stats"], "next": result.pop("next", None)},
                       args.out)
    print(json.dumps(results[args.scenario] if len(results) == 1 else results))


if __name__ == "__main__":
    main()
