"""TorchBackend on the tiny model: a train step changes every parameter in the direction of the
advantage, mini- and micro-batches behave, and the KL reference stays frozen."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from relax_hpc.backends.batch import pack_rows
from relax_hpc.backends.torch_backend import TorchBackend
from relax_hpc.data.rows import sample_to_row
from relax_hpc.data.sample import Sample
from relax_hpc.spec.schema import AlgorithmSpec, TrainSpec

# Response token ids of the tiny char-level vocabulary (digits are 3..12, "+" 13, "=" 16, EOS 2).
SEQS = [
    ([4, 13, 5, 16], [6, 2]),  # "1+2=" -> "3" EOS
    ([5, 5, 13, 7, 16], [4, 9, 2]),
    ([8, 13, 8, 16], [11]),
    ([3, 16], [3, 3, 3, 2]),
]


def _samples(backend: TorchBackend, advantages: list[float]) -> list[Sample]:
    samples = [
        Sample(p, r, [0.0] * len(r), 0, group_id=i, prompt_index=i, advantage=a)
        for i, ((p, r), a) in enumerate(zip(SEQS, advantages))
    ]
    for s, lp in zip(samples, backend.compute_log_probs(samples)):
        s.rollout_log_probs = lp  # on-policy: the engine's log-probs equal the trainer's
    return samples


def _backend(path: Path, **optim: object) -> TorchBackend:
    loss = optim.pop("loss", AlgorithmSpec())
    return TorchBackend(path, TrainSpec(steps=1, **{"lr": 1e-3, **optim}), loss)  # type: ignore[arg-type]


def _step_counts(backend: TorchBackend) -> set[int]:
    return {int(state["step"]) for state in backend.optimizer.state.values()}


def test_train_changes_every_parameter_and_reports_finite_stats(tiny_model_dir: Path) -> None:
    backend = _backend(tiny_model_dir, micro_batch_size=2)
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    stats = backend.train(_samples(backend, [1.0, -1.0, 0.5, -0.5]))
    unchanged = [n for n, p in backend.model.named_parameters() if torch.equal(p, before[n])]
    assert unchanged == []
    for key in ("grad_norm", "loss/policy", "loss/total", "clip_frac", "ratio_mean", "entropy"):
        assert math.isfinite(stats[key]), key
    assert stats["grad_norm"] > 0
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # first step is on-policy
    assert stats["clip_frac"] == 0.0
    assert _step_counts(backend) == {1}


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_advantage_sign_moves_the_log_prob(tiny_model_dir: Path, sign: float) -> None:
    backend = _backend(tiny_model_dir)
    (sample,) = _samples(backend, [sign])[:1]
    before = sum(backend.compute_log_probs([sample])[0])
    backend.train([sample])
    after = sum(backend.compute_log_probs([sample])[0])
    assert (after - before) * sign > 1e-3, (before, after)


@pytest.mark.parametrize(("mini_batches", "micro", "steps"), [(1, 4, 1), (1, 1, 1), (2, 4, 2), (2, 1, 2)])
def test_optimizer_steps_per_train_call(
    tiny_model_dir: Path, mini_batches: int, micro: int, steps: int
) -> None:
    backend = _backend(tiny_model_dir, mini_batches=mini_batches, micro_batch_size=micro)
    samples = _samples(backend, [1.0, -1.0, 0.5, -0.5])
    backend.train(samples)
    assert _step_counts(backend) == {steps}
    backend.train(samples)
    assert _step_counts(backend) == {2 * steps}


def test_micro_batches_accumulate_to_the_full_batch_gradient(tiny_model_dir: Path) -> None:
    grads = []
    for micro in (4, 1):
        backend = _backend(tiny_model_dir, micro_batch_size=micro, grad_clip=0.0)
        backend.train(_samples(backend, [1.0, -1.0, 0.5, -0.5]))
        grads.append({n: p.grad.clone() for n, p in backend.model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-7, msg=name)


def test_streamed_row_micro_batches_step_like_one_pass_over_the_samples(tiny_model_dir: Path) -> None:
    # The trainer's streaming path: rows packed per micro-batch (each padded to its own length)
    # must give the optimizer step that `train` takes on the whole batch of samples.
    whole = _backend(tiny_model_dir, micro_batch_size=4, grad_clip=0.0)
    samples = _samples(whole, [1.0, -1.0, 0.5, -0.5])
    rows = [sample_to_row(s) for s in samples]
    stats_whole = whole.train(samples)
    streamed = _backend(tiny_model_dir, micro_batch_size=4, grad_clip=0.0)
    stats_streamed = streamed.train_stream(
        pack_rows(part, streamed.pad_id) for part in (rows[:1], rows[1:3], rows[3:]))
    # Gradients, not parameters: Adam's first step is about lr * sign(grad), which turns float
    # noise on near-zero gradients into lr-sized differences.
    for (name, p), q in zip(whole.model.named_parameters(), streamed.model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-7, msg=name)
    assert stats_streamed.keys() == stats_whole.keys()
    for key, value in stats_whole.items():
        assert stats_streamed[key] == pytest.approx(value, rel=1e-4, abs=1e-7), key


def test_streamed_rows_use_the_forward_roles_log_probs(tiny_model_dir: Path) -> None:
    backend = _backend(tiny_model_dir)
    assert backend.reference is None  # kl_coef = 0: only a Reference role's field gives a KL
    rows = [sample_to_row(s) for s in _samples(backend, [1.0, -1.0, 0.5, -0.5])]
    for row in rows:  # rollout_log_probs are the current policy's (see _samples)
        row["log_probs"] = row["rollout_log_probs"] - 0.1
        row["ref_log_probs"] = row["rollout_log_probs"].clone()
    stats = backend.train_stream([pack_rows(rows, backend.pad_id)])
    # ratio = exp(logp - old) = exp(0.1) on every token; the policy equals the reference: KL 0.
    assert stats["ratio_mean"] == pytest.approx(math.exp(0.1), rel=1e-4)
    assert stats["loss/kl"] == pytest.approx(0.0, abs=1e-5)


def test_kl_reference_is_frozen(tiny_model_dir: Path) -> None:
    backend = _backend(tiny_model_dir, loss=AlgorithmSpec(kl_coef=0.1))
    samples = _samples(backend, [1.0, -1.0, 0.5, -0.5])
    ref_before = backend.compute_log_probs(samples, reference=True)
    policy_before = backend.compute_log_probs(samples)
    assert ref_before == policy_before  # the reference starts as a copy of the policy
    stats = backend.train(samples)
    assert stats["loss/kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the step
    assert backend.compute_log_probs(samples, reference=True) == ref_before
    assert backend.compute_log_probs(samples) != policy_before
    stats = backend.train(samples)
    assert stats["loss/kl"] > 0  # the policy has moved away from the frozen reference


def test_no_forward_of_the_trainer_builds_a_kv_cache(tiny_model_dir: Path) -> None:
    # An HF model builds a cache of every layer's keys and values unless told not to: memory a
    # training or log-prob forward never reads (held to the forward's end with no_grad).
    from relax_hpc.roles.forward import response_log_probs

    backend = _backend(tiny_model_dir, micro_batch_size=2, loss=AlgorithmSpec(kl_coef=0.1))
    caches: list[object] = []
    for model in (backend.model, backend.reference):
        assert model is not None
        model.register_forward_hook(lambda module, args, out: caches.append(getattr(out, "cache", "no field")))
    samples = _samples(backend, [1.0, -1.0, 0.5, -0.5])
    backend.compute_log_probs(samples, reference=True)
    backend.train(samples)
    response_log_probs(backend.model, samples, backend.pad_id, 1.0, "cpu")  # the forward roles' forward
    assert len(caches) >= 4 and caches == [None] * len(caches)


def test_no_reference_without_kl(tiny_model_dir: Path) -> None:
    backend = _backend(tiny_model_dir)
    assert backend.reference is None
    with pytest.raises(RuntimeError, match="kl_coef > 0"):
        backend.compute_log_probs(_samples(backend, [0.0] * 4), reference=True)


def test_attention_dropout_is_off_in_training(tiny_model_dir: Path, tmp_path: Path) -> None:
    # A checkpoint that ships attention dropout must still give deterministic log-probs, or the
    # recomputed log-probs would not match the rollout engine's.
    path = tmp_path / "dropout-model"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["attention_dropout"] = 0.5
    (path / "config.json").write_text(json.dumps(config))
    backend = _backend(path)
    samples = _samples(backend, [1.0] * 4)
    assert backend.model.training
    assert backend.compute_log_probs(samples) == backend.compute_log_probs(samples)


def test_named_weights_cover_the_state_dict(tiny_model_dir: Path) -> None:
    backend = _backend(tiny_model_dir)
    names = [n for n, _ in backend.named_weights()]
    assert names == list(backend.model.state_dict())
    assert all(not t.requires_grad for _, t in backend.named_weights())


@pytest.mark.parametrize(("mini_batches", "forwards"), [(1, 2), (2, 4)])
def test_one_optimizer_step_needs_no_separate_old_log_prob_forward(
        tiny_model_dir: Path, mini_batches: int, forwards: int) -> None:
    # 4 samples in micro-batches of 2: one step takes 2 forwards (with grad); two mini-batches
    # also need the old log-probs of the step's start, from 2 more forwards without grad.
    backend = _backend(tiny_model_dir, micro_batch_size=2, mini_batches=mini_batches)
    samples = _samples(backend, [1.0, -1.0, 0.5, -0.5])
    calls = []
    handle = backend.model.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    try:
        stats = backend.train(samples)
    finally:
        handle.remove()
    assert len(calls) == forwards
    assert calls.count(True) == 2  # the training passes: two micro-batches of 2 in either case
    if mini_batches == 1:
        assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # on-policy: old == current
