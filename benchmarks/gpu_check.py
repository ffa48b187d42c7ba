"""The one-GPU acceptance check: the trainer's CUDA paths, measured, on a single GPU node.

    python benchmarks/gpu_check.py [--hidden 1024 --layers 12] [--batch 32 --response-len 448] [--out FILE]

Two parts, each printed as it ends and written together as JSON to `--out`:

1. **Training step on CUDA** (`TorchBackend.train`, GRPO loss) on a Qwen3-shaped model built here
   (`--hidden`, `--layers`), in three precisions from the same weights and the same batch:
   * `fp32`: float32 weights and compute (the reference);
   * `bf16`: `dtype = "bfloat16"` with `ddp`: float32 master weights and AdamW state, bfloat16
     compute under autocast;
   * `fsdp2-mp`: `dtype = "bfloat16"` with `strategy = "fsdp2"` on one rank: float32 master
     weights and optimizer state, bfloat16 compute, float32 gradient reduction (FSDP2's
     `MixedPrecisionPolicy`).
   For each: the median step time over `--steps` steps after one warm-up, tokens per second,
   the peak of allocated device memory, the first step's loss, and the share of weight elements
   that one AdamW step at lr 1e-6 changed in the parameters (bf16 weights would round most such
   updates away).
2. **Weight channel over NCCL**, a sender and a receiver process on the same GPU, two versions
   exact to the byte (tests/weights/weights_harness.py). NCCL refuses two ranks of one
   communicator on one device on some versions; the error is then recorded as the result.

Needs a CUDA device. The last line is the summary, e.g.
``gpu check: fsdp2-mp step 0.91x of fp32 time, 1.00 of elements changed at lr 1e-6 (bf16: 1.00)``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "weights"))

import torch
import torch.distributed as dist

from relax_hpc.backends.torch_backend import TorchBackend
from relax_hpc.data.sample import Sample
from relax_hpc.models.tiny import TinyModelSize, vocab_size, write_tiny_model
from relax_hpc.spec.schema import AlgorithmSpec, TrainSpec

LR = 1e-6
MODES = {  # name: (model dtype, strategy)
    "fp32": ("float32", "ddp"),
    "bf16": ("bfloat16", "ddp"),
    "fsdp2-mp": ("bfloat16", "fsdp2"),
}


def make_samples(batch: int, prompt_len: int, response_len: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(7)
    samples = []
    for i in range(batch):
        prompt = torch.randint(3, vocab_size(), (prompt_len,), generator=gen).tolist()
        response = torch.randint(3, vocab_size(), (response_len,), generator=gen).tolist()
        advantage = float(torch.randn(1, generator=gen))
        samples.append(Sample(prompt, response, [0.0] * response_len, 0, group_id=i // 4,
                              prompt_index=i // 4, advantage=advantage))
    return samples


def weights_on_cpu(backend: TorchBackend) -> dict[str, torch.Tensor]:
    """The trained parameters themselves (the float32 masters; `named_weights` would round them to
    the engines' dtype)."""
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().clone()
            for name, p in backend.model.named_parameters()}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure_mode(mode: str, model_dir: Path, samples: list[Sample], steps: int, micro: int,
                 device: str) -> dict[str, Any]:
    dtype, strategy = MODES[mode]
    cuda = device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    backend = TorchBackend(model_dir, TrainSpec(steps=1, lr=LR, grad_clip=1.0, micro_batch_size=micro),
                           AlgorithmSpec(name="grpo", kl_coef=0.0), dtype=dtype, device=device,
                           strategy=strategy)
    before = weights_on_cpu(backend)
    sync(device)
    first = backend.train(samples)  # the warm-up step, from the shared starting weights
    sync(device)
    after = weights_on_cpu(backend)
    changed = sum(int((after[k] != before[k]).sum()) for k in before)
    total = sum(t.numel() for t in before.values())
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        backend.train(samples)
        sync(device)
        times.append(time.perf_counter() - start)
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    step_s = statistics.median(times)
    result = {
        "mode": mode, "model_dtype": dtype, "strategy": strategy, "sharded": backend.sharded,
        "param_dtype": str(next(backend.model.parameters()).dtype),
        "step_s": step_s, "tokens_per_s": tokens / step_s,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "first_loss": float(first.get("loss/total", float("nan"))),
        "changed_fraction_at_lr_1e-6": changed / total,
        "parameters": total,
    }
    del backend
    if cuda:
        torch.cuda.empty_cache()
    return result


def train_part(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    size = TinyModelSize(hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 128), head_dim=64,
                         max_position_embeddings=2048)
    model_dir = write_tiny_model(work / "model", seed=0, size=size)
    samples = make_samples(args.batch, args.prompt_len, args.response_len)
    # FSDP2 needs a process group, even of one rank.
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{work / 'pg'}", rank=0,
                            world_size=1, device_id=torch.device("cuda:0") if cuda else None)
    results = {}
    for mode in MODES:
        results[mode] = measure_mode(mode, model_dir, samples, args.steps, args.micro_batch, args.device)
        print(json.dumps(results[mode]), flush=True)
    dist.destroy_process_group()
    return results


def channel_part() -> dict[str, Any]:
    import os

    from weights_harness import make_weights, run_channel, tensor_bytes

    from relax_hpc.auth import JobSecret, write_job_secret

    if "RELAX_HPC_SECRET_FILE" not in os.environ:  # the channel's store is sealed with the job secret
        os.environ["RELAX_HPC_SECRET_FILE"] = str(
            write_job_secret(Path(tempfile.mkdtemp(prefix="relax-gpu-check-secret-")), JobSecret.generate()))

    plan = [{"version": 1, "seed": 11, "bucket_bytes": 512 << 20, "direct_bytes": 4 << 20},
            {"version": 2, "seed": 22, "bucket_bytes": 4096, "direct_bytes": 1024}]
    start = time.perf_counter()
    try:
        sent, per_rank = run_channel({1: len(plan)}, n=1, plan=plan, timeout_s=60.0, device="cuda:0",
                                     receiver_device="cuda:0")
    except Exception:  # noqa: BLE001 - recorded as the result
        return {"ok": False, "error": traceback.format_exc(limit=3)}
    exact = [kind == "version" and got["weights"] == {n: tensor_bytes(t) for n, t in make_weights(step["seed"])}
             for step, (kind, got) in zip(plan, per_rank[1])]
    return {"ok": sent == [("sent", 1), ("sent", 2)] and exact == [True, True], "sent": repr(sent)[:400],
            "exact": exact, "received": repr(per_rank[1])[:400] if not all(exact) else "",
            "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=448)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--skip-channel", action="store_true")
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: a smoke run of the script itself (no figures worth keeping)")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("no CUDA device is visible: run this on a GPU node (or --device cpu for a smoke run)")
    report: dict[str, Any] = {"torch": torch.__version__, "args": vars(args) | {"out": str(args.out)}}
    if cuda:
        report |= {"gpu": torch.cuda.get_device_name(0), "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    if not args.skip_train:
        with tempfile.TemporaryDirectory(prefix="relax-gpu-check-") as tmp:
            report["train"] = train_part(args, Path(tmp))
    if cuda and not args.skip_channel:
        report["nccl_channel_one_gpu"] = channel_part()
        print(json.dumps(report["nccl_channel_one_gpu"]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    train = report.get("train")
    if train:
        print(f"gpu check: fsdp2-mp step {train['fsdp2-mp']['step_s'] / train['fp32']['step_s']:.2f}x of fp32 time, "
              f"{train['fsdp2-mp']['changed_fraction_at_lr_1e-6']:.2f} of elements changed at lr 1e-6 "
              f"(bf16: {train['bf16']['changed_fraction_at_lr_1e-6']:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
