"""`strategy = "fsdp2"` on the tiny Qwen3-VL and Qwen3-Omni models over 2 gloo ranks (CPU).

One spawned pair of ranks trains each model in float32 for 3 steps on rows that carry images
(and audio for omni), then recomputes log-probs, and the tests compare it with one process
trained on the same rows (the two ranks' shares together):

* step 0: both ranks' rows carry media;
* step 1: rank 1's rows are text only (the model never calls its towers there);
* step 2: rank 0 has two micro-batches, rank 1 one text row, so rank 1 runs an empty padding
  pass (no media, with backward) while rank 0 runs its towers;
* then `compute_log_probs` on 3 rows against 1 (no backward: rank 1 runs an empty pass while
  rank 0's second micro-batch has media).

Each must give the single process's losses, gradient norms, gradients (every parameter's, at
every step) and log-probs within 1e-5; every parameter (the towers' included) must have moved,
and each rank must hold about half of the parameters. Before the towers were units of their
own, fsdp2 refused these models ("has no model.layers"); with them but without the every-pass
gather of `shard_model`, the ranks' collectives mismatch at the first media-free step (gloo
aborts: "Received data size doesn't match expected size").

The same pair then takes one step of each model with dtype bfloat16 (FSDP2 mixed precision
over gloo, rank 1 media-free). The spawned ranks take several seconds: marked slow.
"""

from __future__ import annotations

import functools
import os
import socket
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from relax_hpc.backends.torch_backend import TorchBackend
from relax_hpc.data.rows import row_to_sample, sample_to_row
from relax_hpc.data.sample import Sample
from relax_hpc.media.canonical import fit_image
from relax_hpc.media.items import MediaItem, PromptMedia
from relax_hpc.media.processor import MediaProcessor
from relax_hpc.models.hf import load_policy_model, load_tokenizer
from relax_hpc.models.tiny import vocab_size
from relax_hpc.models.tiny_mm import write_tiny_multimodal
from relax_hpc.spec.schema import AlgorithmSpec, TrainSpec

pytestmark = pytest.mark.slow

ARCHS = ("qwen3_vl", "qwen3_omni")
TOLERANCE = 1e-5
MICRO = 2
# Per step, each rank's rows by kind: "image", "audio" (omni; image on VL), "both", "text".
STEPS = (
    (("image", "text"), ("audio", "both")),
    (("both", "image"), ("text", "text")),
    (("image", "audio", "text", "both"), ("text",)),
)
LOGPROB_ROWS = (("text", "text", "both"), ("image",))


def _media(processor: MediaProcessor, kind: str, seed: int) -> PromptMedia:
    rng = np.random.default_rng(seed)
    image = MediaItem("image", fit_image(rng.integers(0, 256, (32, 48, 3), dtype=np.uint8), processor.geometry()))
    t = np.arange(8000) / 16000
    audio = MediaItem("audio", (0.5 * np.sin(2 * np.pi * (250 + 50 * seed) * t)).astype(np.float32), rate=16000)
    hears = "audio" in processor.family.kinds
    items = {"text": (), "image": (image,), "audio": (audio,) if hears else (image,),
             "both": (image, audio) if hears else (image, image)}[kind]
    return PromptMedia(items)


@functools.cache
def _tools(model_dir: Path) -> tuple:
    return load_tokenizer(model_dir), MediaProcessor(model_dir)


def _rows(model_dir: Path, kinds: tuple[str, ...], seed: int) -> list[Sample]:
    """Samples as the trainer receives them (through the queue's row codec), prompt expanded."""
    tokenizer, processor = _tools(model_dir)
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i, kind in enumerate(kinds):
        media = _media(processor, kind, seed + i)
        content = [*({"type": item.kind} for item in media.items), {"type": "text", "text": f"q{i}?"}]
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
        prompt = processor.expand(tokenizer(text, add_special_tokens=False)["input_ids"], media)
        response = torch.randint(3, vocab_size(), (2 + (3 * i + seed) % 5,), generator=gen).tolist()
        sample = Sample(prompt, response, [0.0] * len(response), 0, group_id=i, prompt_index=i,
                        advantage=float(torch.randn(1, generator=gen)), media=media if media.items else None)
        samples.append(row_to_sample(sample_to_row(sample)))
    return samples


def _backend(model_dir: Path, strategy: str) -> TorchBackend:
    optim = TrainSpec(steps=1, lr=1e-2, grad_clip=1e9, micro_batch_size=MICRO)
    return TorchBackend(model_dir, optim, AlgorithmSpec(name="grpo", kl_coef=0.0), strategy=strategy)


def _run(backend: TorchBackend, model_dir: Path, rank: int | None) -> dict:
    """Train the steps and recompute log-probs; rank None: one process with every rank's rows."""
    def share(per_rank: tuple[tuple[str, ...], ...], seed: int) -> list[Sample]:
        rows = [_rows(model_dir, kinds, seed + 10 * r) for r, kinds in enumerate(per_rank)]
        return [s for part in rows for s in part] if rank is None else rows[rank]

    grads: list[dict[str, torch.Tensor]] = []
    backend.optimizer.register_step_pre_hook(lambda *_: grads.append(_full_grads(backend)))
    stats = [backend.train(share(kinds, 100 * step)) for step, kinds in enumerate(STEPS)]
    return {
        "stats": [{k: s[k] for k in ("loss/total", "grad_norm")} for s in stats],
        "grads": grads,
        "logprobs": backend.compute_log_probs(share(LOGPROB_ROWS, 900)),
        "weights": {n: t.clone() for n, t in backend.named_weights()},  # collective when sharded
    }


def _full_grads(backend: TorchBackend) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient before the optimizer step (collective when sharded: the
    ranks step together)."""
    grads = {}
    for name, param in backend.model.named_parameters():
        grad = param.grad
        grads[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad.clone()
    return grads


def _first_tensor(output: object) -> torch.Tensor:
    """A module output's main tensor: itself, a causal LM's logits, or an HF output's first field."""
    if isinstance(output, torch.Tensor):
        return output
    return getattr(output, "logits", None) if hasattr(output, "logits") else output[0]  # type: ignore[index]


def _bf16_step(model_dir: Path, rank: int) -> dict:
    """One step with dtype bfloat16 at lr 1e-6 (rank 1's rows media-free): what the float32
    master shards, the modules' outputs and the weights sent to engines are."""
    optim = TrainSpec(steps=1, lr=1e-6, weight_decay=0.0, grad_clip=0.0, micro_batch_size=MICRO)
    backend = TorchBackend(model_dir, optim, AlgorithmSpec(name="grpo", kl_coef=0.0), dtype="bfloat16",
                           strategy="fsdp2")
    seen: dict[str, set] = {}
    base = backend.model.model
    modules = {"vision": base.visual, "layer": base.language_model.layers[0], "root": backend.model}
    if hasattr(base, "audio_tower"):
        modules["audio"] = base.audio_tower
    for name, module in modules.items():
        module.register_forward_hook(
            lambda m, args, output, name=name: seen.setdefault(name, set()).add(_first_tensor(output).dtype))
    before = {n: p.to_local().detach().clone() for n, p in backend.model.named_parameters()}
    backend.train(_rows(model_dir, STEPS[1][rank], 300 + 10 * rank))
    after = {n: p.to_local().detach() for n, p in backend.model.named_parameters()}
    changed = sum(int((after[n] != before[n]).sum()) for n in before)
    sent = {n: (t.dtype, tuple(t.shape)) for n, t in backend.named_weights()}  # collective
    return {"seen": seen, "masters": {t.dtype for t in after.values()},
            "changed": changed / sum(t.numel() for t in before.values()), "sent": sent}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_worker(rank: int, port: int, dirs: dict[str, str], out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    try:
        results = {}
        for arch, model_dir in dirs.items():
            torch.manual_seed(0)
            backend = _backend(Path(model_dir), "fsdp2")
            local = {n: p.to_local().numel() for n, p in backend.model.named_parameters()}
            full = {n: p.numel() for n, p in backend.model.named_parameters()}
            results[arch] = _run(backend, Path(model_dir), rank) | {
                "kinds": {type(p).__name__ for p in backend.model.parameters()},
                "local": sum(local.values()), "full": sum(full.values()),
            }
        results["bf16"] = {arch: _bf16_step(Path(model_dir), rank) for arch, model_dir in dirs.items()}
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mm-fsdp2")
    return {arch: write_tiny_multimodal(root / arch, arch, seed=0) for arch in ARCHS}


@pytest.fixture(scope="module")
def runs(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    out = tmp_path_factory.mktemp("mm-fsdp2-out")
    mp.spawn(_rank_worker, args=(_free_port(), {a: str(p) for a, p in model_dirs.items()}, str(out)),
             nprocs=2, join=True)
    sharded = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    single = {}
    for arch, model_dir in model_dirs.items():
        torch.manual_seed(0)
        single[arch] = _run(_backend(model_dir, "fsdp2"), model_dir, None)  # one process: not sharded
    return {"rank0": sharded[0], "rank1": sharded[1]}, single


def _max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys() and len(want) > 0
    return max(float((got[n] - want[n]).abs().max()) for n in want)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ARCHS)
def test_fsdp2_trains_multimodal_like_one_process(runs: tuple[dict, dict], arch: str,
                                                  model_dirs: dict[str, Path]) -> None:
    ranks, single = runs
    got, want = ranks["rank0"][arch], single[arch]
    assert len(got["grads"]) == len(want["grads"]) == len(STEPS)
    for step, (g, w) in enumerate(zip(got["stats"], want["stats"])):
        for key in w:
            assert g[key] == pytest.approx(w[key], abs=TOLERANCE), (step, key)
        assert _max_diff(got["grads"][step], want["grads"][step]) <= TOLERANCE, step
    # AdamW divides by the root of the second moment, so an element whose gradient sits at the
    # 1e-6 noise of summation order moves by up to lr (1e-2) in either direction: the weights are
    # held equal where each step's gradient is well above that noise (>= 1e-4; 40% of the VL's
    # elements, more of the omni's), and a gradient missing on a rank moves those by about lr.
    # (a weight with no gradient of its own, e.g. a tied head, is held equal everywhere)
    firm = {n: torch.stack([w[n].abs() >= 1e-4 for w in want["grads"]]).all(0) if n in want["grads"][0]
            else torch.ones_like(want["weights"][n], dtype=torch.bool) for n in want["weights"]}
    assert sum(int(m.sum()) for m in firm.values()) >= 0.3 * sum(m.numel() for m in firm.values())
    gaps = [(got["weights"][n] - want["weights"][n])[firm[n]].abs() for n in firm]
    assert max(float(g.max()) for g in gaps if g.numel()) <= 10 * TOLERANCE
    # The log-probs of each rank's rows: rank 0's three, then rank 1's one.
    flat_got = [x for r in ("rank0", "rank1") for row in ranks[r][arch]["logprobs"] for x in row]
    flat_want = [x for row in want["logprobs"] for x in row]
    assert len(flat_got) == len(flat_want) and max(abs(a - b) for a, b in zip(flat_got, flat_want)) <= TOLERANCE
    # Training reached every parameter, the vision (and audio) tower's included.
    initial = dict(load_policy_model(model_dirs[arch]).state_dict())
    unchanged = [n for n in initial if torch.equal(got["weights"][n], initial[n])]
    assert not unchanged, unchanged[:5]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ARCHS)
def test_fsdp2_shards_the_towers_and_the_language_model(runs: tuple[dict, dict], arch: str) -> None:
    ranks, _ = runs
    for rank in ("rank0", "rank1"):
        result = ranks[rank][arch]
        assert result["kinds"] == {"DTensor"}
        assert 0.4 <= result["local"] / result["full"] <= 0.6, (rank, result["local"], result["full"])
    assert ranks["rank0"][arch]["local"] + ranks["rank1"][arch]["local"] >= ranks["rank0"][arch]["full"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ARCHS)
def test_fsdp2_bf16_computes_in_bf16_and_steps_float32_masters(runs: tuple[dict, dict], arch: str,
                                                                model_dirs: dict[str, Path]) -> None:
    """FSDP2's mixed precision over gloo: bfloat16 compute (the towers' and the layers'), logits
    in float32, float32 master shards that an lr 1e-6 step moves, bfloat16 weights to engines."""
    ranks, _ = runs
    engine = load_policy_model(model_dirs[arch], dtype="bfloat16").state_dict()  # what an engine holds
    towers = {"vision": {torch.bfloat16}} | ({"audio": {torch.bfloat16}} if arch == "qwen3_omni" else {})
    computed = {"layer": {torch.bfloat16}, "root": {torch.float32}}
    assert ranks["rank0"]["bf16"][arch]["seen"] == computed | towers
    assert ranks["rank1"]["bf16"][arch]["seen"] == computed  # media-free rows: the model never calls a tower
    for rank in ("rank0", "rank1"):
        result = ranks[rank]["bf16"][arch]
        assert result["masters"] == {torch.float32}
        assert result["changed"] > 0.9, result["changed"]  # bfloat16 shards would keep most (~2% move)
    assert ranks["rank0"]["bf16"][arch]["sent"] == {n: (t.dtype, tuple(t.shape)) for n, t in engine.items()}
    assert ranks["rank1"]["bf16"][arch]["sent"] == {}
