"""float32 master weights under `[model] dtype = "bfloat16"` (one process, CPU).

The same batches train the tiny model three ways for 3 AdamW steps at lr 1e-6:

* `fp32`: dtype float32 (float32 weights and compute);
* `bf16`: dtype bfloat16: float32 parameters and AdamW state, bfloat16 compute (autocast);
* `plain bf16`: the bf16 backend with its parameters cast back to bfloat16 and AdamW rebuilt on
  them, which is what dtype bfloat16 trained before master weights.

An AdamW step moves each weight by about lr; half a bfloat16 ulp of a weight of size 0.02 is
about 6e-5, so plain bfloat16 parameters round most steps away while float32 masters keep them.
Then: the weights leave for the engines in bfloat16 (what an engine loaded in it holds), the
checkpoint holds the float32 masters (resume restores them exactly) and the HF export casts them
to the dtype it writes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relax_hpc.backends.torch_backend import TorchBackend
from relax_hpc.ckpt import CheckpointManager, ResumeState
from relax_hpc.data.sample import Sample
from relax_hpc.models.hf import load_policy_model
from relax_hpc.models.tiny import vocab_size
from relax_hpc.spec.schema import AlgorithmSpec, TrainSpec

LR = 1e-6
STEPS = 3


def _backend(model_dir: Path, dtype: str) -> TorchBackend:
    optim = TrainSpec(steps=1, lr=LR, weight_decay=0.0, grad_clip=0.0, micro_batch_size=4)
    return TorchBackend(model_dir, optim, AlgorithmSpec(name="grpo", kl_coef=0.0), dtype=dtype)


def _samples(step: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(200 + step)
    samples = []
    for i in range(8):
        prompt = torch.randint(3, vocab_size(), (2 + i % 3,), generator=gen).tolist()
        response = torch.randint(3, vocab_size(), (3 + i % 4,), generator=gen).tolist()
        samples.append(Sample(prompt, response, [0.0] * len(response), 0, group_id=i // 4, prompt_index=i // 4,
                              advantage=float(torch.randn(1, generator=gen))))
    return samples


def _plain_bf16(model_dir: Path) -> TorchBackend:
    """bfloat16 parameters stepped by AdamW directly: training before float32 masters."""
    backend = _backend(model_dir, "bfloat16")
    backend.model.to(torch.bfloat16)
    backend._autocast = False  # the parameters are already in the compute dtype
    backend.optimizer = torch.optim.AdamW(backend.model.parameters(), lr=LR, weight_decay=0.0)
    return backend


def _train(backend: TorchBackend) -> dict:
    """Train STEPS steps; the parameters before and after (float32 copies), and the dtype the
    first attention projection computed in."""
    seen: list[torch.dtype] = []
    q_proj = backend.model.model.layers[0].self_attn.q_proj
    hook = q_proj.register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    before = {n: p.detach().float().clone() for n, p in backend.model.named_parameters()}
    for step in range(STEPS):
        backend.train(_samples(step))
    hook.remove()
    after = {n: p.detach().float().clone() for n, p in backend.model.named_parameters()}
    return {"before": before, "after": after, "compute": set(seen),
            "params": {p.dtype for p in backend.model.parameters()}}


def _changed_fraction(run: dict) -> float:
    changed = sum(int((run["after"][n] != run["before"][n]).sum()) for n in run["before"])
    return changed / sum(t.numel() for t in run["before"].values())


def _mean_move(run: dict) -> float:
    moved = sum(float((run["after"][n] - run["before"][n]).abs().sum()) for n in run["before"])
    return moved / sum(t.numel() for t in run["before"].values())


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path) -> dict:
    out = {}
    for name, build in (("fp32", lambda: _backend(tiny_model_dir, "float32")),
                        ("bf16", lambda: _backend(tiny_model_dir, "bfloat16")),
                        ("plain", lambda: _plain_bf16(tiny_model_dir))):
        torch.manual_seed(0)
        backend = build()
        out[name] = _train(backend) | {"backend": backend}
    return out


def test_bf16_compute_with_float32_masters_learns_at_lr_1e6_like_fp32(runs: dict) -> None:
    fp32, bf16, plain = runs["fp32"], runs["bf16"], runs["plain"]
    assert fp32["params"] == bf16["params"] == {torch.float32} and plain["params"] == {torch.bfloat16}
    assert fp32["compute"] == {torch.float32}
    assert bf16["compute"] == plain["compute"] == {torch.bfloat16}
    # Every weight moves with float32 masters, by about what float32 training moves it ...
    assert _changed_fraction(fp32) > 0.99 and _changed_fraction(bf16) > 0.99
    assert 0.8 < _mean_move(bf16) / _mean_move(fp32) < 1.25
    # ... while plain bfloat16 parameters round most of the same updates away.
    assert _changed_fraction(plain) < 0.1
    assert _mean_move(plain) < 0.1 * _mean_move(fp32)


def test_weights_leave_in_the_engines_dtype(runs: dict, tiny_model_dir: Path) -> None:
    backend = runs["bf16"]["backend"]
    engine = load_policy_model(tiny_model_dir, dtype="bfloat16").state_dict()  # what an engine holds
    sent = dict(backend.named_weights())
    assert sent.keys() == engine.keys()
    for name, tensor in sent.items():
        assert (tensor.dtype, tensor.shape) == (engine[name].dtype, engine[name].shape), name
    masters = runs["bf16"]["after"]
    assert all(torch.equal(sent[n], masters[n].to(torch.bfloat16)) for n in masters)
    # float32 training sends its own tensors, as before: no copy.
    fp32 = runs["fp32"]["backend"]
    live = dict(fp32.model.state_dict())
    assert all(t.data_ptr() == live[n].data_ptr() for n, t in fp32.named_weights())


def test_checkpoint_holds_the_masters_and_export_casts_them(runs: dict, tiny_model_dir: Path,
                                                              tmp_path: Path) -> None:
    from relax_hpc.ckpt.export import export_hf
    from relax_hpc.models.hf import load_causal_lm

    backend, masters = runs["bf16"]["backend"], runs["bf16"]["after"]
    # The masters carry what bfloat16 cannot hold: a checkpoint of bfloat16 values would lose it.
    assert any(not torch.equal(t, t.to(torch.bfloat16).float()) for t in masters.values())
    state = ResumeState(step=STEPS, weight_version=STEPS, data_cursor={}, samples_trained=8 * STEPS)
    path = backend.save_checkpoint(CheckpointManager(tmp_path / "ckpt"), state)
    fresh = _backend(tiny_model_dir, "bfloat16")
    assert fresh.load_checkpoint(CheckpointManager(tmp_path / "ckpt")) is not None
    assert all(torch.equal(p, masters[n]) for n, p in fresh.model.named_parameters())
    assert all(v.dtype == torch.float32 for s in fresh.optimizer.state.values() for k, v in s.items() if k != "step")
    # Export writes the dtype model_dir declares (float32 for the tiny model), or the one asked for.
    declared = load_causal_lm(export_hf(path, tiny_model_dir, tmp_path / "hf32")).state_dict()
    assert all(torch.equal(declared[n], masters[n]) for n in masters)
    halved = load_causal_lm(export_hf(path, tiny_model_dir, tmp_path / "hf16", dtype=torch.bfloat16),
                            dtype="bfloat16").state_dict()
    assert all(torch.equal(halved[n], masters[n].to(torch.bfloat16)) for n in masters)
