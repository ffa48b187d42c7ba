"""DistributedWeightSync end to end between two Ray actors (a trainer-like sender, an engine-like
receiver) over gloo on a local Ray cluster."""

from __future__ import annotations

import os
from typing import Any, Iterator

import pytest

os.environ["RAY_AUTH_MODE"] = "disabled"  # Ray 2.60 would otherwise require a token

import ray  # noqa: E402


def _actor_classes() -> tuple[Any, Any]:
    # Defined inside a function so Ray ships them by value (the test folder is not on the workers' path).
    import torch
    from weights_harness import make_weights

    from relax_hpc.weights.endpoints import WeightReceiverEndpoint, WeightSenderEndpoint

    class Trainer(WeightSenderEndpoint):
        def __init__(self) -> None:
            self.seed = 0

        def set_seed(self, seed: int) -> None:
            self.seed = seed

        def export_weights(self) -> list[tuple[str, torch.Tensor]]:
            if self.seed < 0:
                raise ValueError(f"export failed for seed {self.seed}")
            return [(n, t.clone()) for n, t in make_weights(self.seed)]

    class Engine(WeightReceiverEndpoint):
        def __init__(self) -> None:
            self.weights: dict[str, torch.Tensor] = {}
            self.version = 0
            self.versions_seen: list[int] = []
            self.failures: list[str] = []

        def weight_version(self) -> int:
            return self.version

        def update_weights(self, named: Any, version: int) -> None:
            for name, t in named:
                self.weights[name] = t.clone()
            self.version = version
            self.versions_seen.append(version)

        def weights_failed(self, message: str) -> None:
            self.failures.append(message)

        def failed(self) -> list[str]:
            return self.failures

        def snapshot(self) -> tuple[int, list[int], dict[str, bytes]]:
            from weights_harness import tensor_bytes

            return self.version, self.versions_seen, {n: tensor_bytes(t)[2] for n, t in self.weights.items()}

    return Trainer, Engine


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    here = os.path.dirname(os.path.abspath(__file__))
    ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False,
        runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": here}},
    )
    yield
    ray.shutdown()


@pytest.mark.slow
def test_distributed_weight_sync_between_ray_actors(ray_cluster: None) -> None:
    from weights_harness import make_weights, tensor_bytes

    from relax_hpc.weights.ray_sync import DistributedWeightSync

    trainer_cls, engine_cls = _actor_classes()
    trainer = ray.remote(trainer_cls).options(num_cpus=0).remote()
    engine = ray.remote(engine_cls).options(num_cpus=0).remote()
    sync = DistributedWeightSync(
        trainer, [engine], host="127.0.0.1", bucket_bytes=1024, timeout_s=30, labels=["rollout 0"]
    )
    try:
        for version, seed in [(1, 101), (2, 202)]:
            ray.get(trainer.set_seed.remote(seed))
            pending = sync.start(version)
            ray.get(trainer.set_seed.remote(999))  # the snapshot was taken at start: this must not leak
            pending.wait()
            got_version, seen, weights = ray.get(engine.snapshot.remote())
            assert got_version == version
            expected = {n: tensor_bytes(t)[2] for n, t in make_weights(seed)}
            assert weights == expected, f"version {version} differs"
        # Buckets are applied under the old version; the new one is set only by the final call,
        # so the engine's version history reads 0..0 1 | 1..1 2 (many 1 KiB buckets each time).
        assert seen == sorted(seen) and seen[-1] == 2 and seen.count(2) == 1
        assert seen.count(0) > 2 and seen.count(1) > 3
    finally:
        sync.close()
        ray.kill(trainer)
        ray.kill(engine)


@pytest.mark.slow
def test_a_failed_broadcast_raises_its_error_on_every_wait_and_the_next_one_rebuilds(ray_cluster: None) -> None:
    from relax_hpc.weights.channel import WeightChannelError
    from relax_hpc.weights.ray_sync import DistributedWeightSync

    trainer_cls, engine_cls = _actor_classes()
    trainer = ray.remote(trainer_cls).options(num_cpus=0).remote()
    engine = ray.remote(engine_cls).options(max_concurrency=2, num_cpus=0).remote()
    sync = DistributedWeightSync(trainer, [engine], host="127.0.0.1", bucket_bytes=1024, timeout_s=3,
                                 labels=["rollout 0"])
    try:
        ray.get(trainer.set_seed.remote(-1))
        pending = sync.start(1)
        with pytest.raises(WeightChannelError) as first:
            pending.wait()
        message = str(first.value)
        assert message.startswith("weight sync to version 1 failed: sender: ")
        assert "export failed for seed -1" in message and "rollout 0 (channel rank 1) failed" in message
        with pytest.raises(WeightChannelError) as again:  # the loop may wait once more on its way out
            pending.wait()
        assert again.value is first.value
        # The receiver learnt that its receive failed (rollout's producer stops waiting on it).
        failures = ray.get(engine.failed.remote())
        assert len(failures) == 1 and "WeightChannel" in failures[0]
        version, _, _ = ray.get(engine.snapshot.remote())
        assert version == 0

        ray.get(trainer.set_seed.remote(5))
        sync.sync(2)  # a new channel (new store port), the receiver joins it again
        assert ray.get(engine.snapshot.remote())[0] == 2
    finally:
        sync.close()
        ray.kill(trainer)
        ray.kill(engine)


def _flat_actor_classes() -> tuple[Any, Any, Any]:
    import torch

    from relax_hpc.weights.endpoints import WeightInbox, WeightReceiverEndpoint, WeightSenderEndpoint
    from relax_hpc.weights.flat import bind_module

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8))

    class LiveTrainer(WeightSenderEndpoint):
        """Hands over its live tensors: the channel takes the snapshot."""

        def __init__(self) -> None:
            self.model = model(0)

        def reseed(self, seed: int) -> None:
            with torch.no_grad():
                for name, p in model(seed).state_dict().items():
                    self.model.state_dict()[name].copy_(p)

        def export_weights(self) -> list[tuple[str, torch.Tensor]]:
            raise AssertionError("a sender with live_weights is snapshotted by the channel")

        def live_weights(self) -> list[tuple[str, torch.Tensor]]:
            return list(self.model.state_dict().items())

    class BindingEngine(WeightReceiverEndpoint):
        """A role with an inbox: receives into flat buffers and runs its module on them."""

        def __init__(self) -> None:
            self.model, self.version, self.inbox = model(1), 0, WeightInbox()
            self.buffers: set[int] = set()

        def weight_version(self) -> int:
            return self.version

        def update_weights(self, named: Any, version: int) -> None:
            raise AssertionError("flat updates are bound, not copied")

        def weight_inbox(self) -> WeightInbox:
            return self.inbox

        def commit_weights(self, version: int) -> None:
            self.inbox.commit(version)

            def bind(flat: Any, v: int) -> bool:
                self.buffers.add(flat.buffer.data_ptr())
                return bind_module(self.model, flat)

            self.version = self.inbox.install(bind, self.update_weights) or self.version

        def state(self) -> tuple[int, int, dict[str, list[float]]]:
            return self.version, len(self.buffers), {
                n: t.flatten().tolist() for n, t in self.model.state_dict().items()
            }

    return LiveTrainer, BindingEngine, model


@pytest.mark.slow
def test_live_weights_are_snapshotted_and_bound_by_the_receiver_without_copies(ray_cluster: None) -> None:
    from relax_hpc.weights.ray_sync import DistributedWeightSync

    trainer_cls, engine_cls, model = _flat_actor_classes()
    trainer = ray.remote(trainer_cls).options(num_cpus=0).remote()
    engine = ray.remote(engine_cls).options(num_cpus=0).remote()
    sync = DistributedWeightSync(trainer, [engine], host="127.0.0.1", bucket_bytes=1024, timeout_s=30)
    try:
        for version, seed in [(1, 11), (2, 22), (3, 33)]:
            ray.get(trainer.reseed.remote(seed))
            pending = sync.start(version)
            ray.get(trainer.reseed.remote(999))  # after the snapshot: must not reach the engine
            pending.wait()
            got_version, buffers, weights = ray.get(engine.state.remote())
            expected = {n: t.flatten().tolist() for n, t in model(seed).state_dict().items()}
            assert got_version == version and weights == expected, f"version {version} differs"
        assert buffers == 2  # the engine's buffer and the spare trade places
    finally:
        sync.close()
        ray.kill(trainer)
        ray.kill(engine)


@pytest.mark.slow
def test_a_broadcast_the_trainer_starts_itself_reaches_receivers_posted_afterwards(ray_cluster: None) -> None:
    """The training loop's flow: the trainer starts each broadcast at the end of its step, and
    the driver posts the receivers only when the step's result is back (`expect`)."""
    from weights_harness import make_weights, tensor_bytes

    from relax_hpc.weights.ray_sync import DistributedWeightSync

    trainer_cls, engine_cls = _actor_classes()
    trainer = ray.remote(trainer_cls).options(num_cpus=0).remote()
    engine = ray.remote(engine_cls).options(num_cpus=0).remote()
    sync = DistributedWeightSync(trainer, [engine], host="127.0.0.1", bucket_bytes=1024, timeout_s=30,
                                 labels=["rollout 0"])
    try:
        sync.connect()
        for version, seed in [(1, 11), (2, 22), (3, 33)]:
            ray.get(trainer.set_seed.remote(seed))
            started = trainer.start_send_weights.remote(version)  # as train_from_queue does
            ray.get(started)  # the sender now waits for its receivers
            pending = sync.expect(version)
            pending.wait()
            got_version, _, weights = ray.get(engine.snapshot.remote())
            assert got_version == version
            assert weights == {n: tensor_bytes(t)[2] for n, t in make_weights(seed)}
        assert ray.get(trainer.finish_send_weights.remote()) == 3
    finally:
        sync.close()
        ray.kill(trainer)
        ray.kill(engine)
