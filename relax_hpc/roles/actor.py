"""The Actor role: one trainer process wrapping a training backend.

With `world_size > 1` each process joins a torch.distributed group (gloo on CPU, NCCL on GPU)
through a TCP store on rank 0's host, trains on its shard of every batch, and checkpoints
collectively. Each rank picks its own device (`rank_device`: Ray's GPU ids, LOCAL_RANK, or its
position among the trainer ranks on its node). With `strategy = "fsdp2"` the weights are sharded
over the ranks: every rank gathers them after each published step (and at start and after a
resume), and rank 0 keeps that full copy for the weight channel. With the Megatron backend a
rank whose backend does not read rows (`TrainBackend.reads_rows`: a tensor or pipeline peer)
leaves the queue alone and trains on the rows its replica's first rank shares with it. A plain
class; the driver places one Ray actor per rank.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from relax_hpc.auth import JobSecret, job_secret
from relax_hpc.backends.base import TrainBackend, make_backend
from relax_hpc.backends.batch import pack_rows
from relax_hpc.backends.parallel import rank_device, ray_gpu_ids
from relax_hpc.ckpt.resume_state import ResumeState
from relax_hpc.data.rows import (
    ARCHIVE_FIELDS,
    MEDIA_FIELDS,
    ROUTED_EXPERTS_FIELD,
    TRAIN_FIELDS,
    row_to_sample,
)
from relax_hpc.data.sample import Sample
from relax_hpc.ops.archive import HDF5TrajectoryArchive, TrajectoryArchive
from relax_hpc.ops.heap import settle_heap
from relax_hpc.roles.heartbeat import Heartbeats
from relax_hpc.spec.schema import (
    AlgorithmSpec,
    CheckpointSpec,
    JobInfoSpec,
    ModelSpec,
    RolloutSpec,
    TrainSpec,
)
from relax_hpc.transfer.connect import connect_queue
from relax_hpc.transfer.queue import TransferQueue, partition_name
from relax_hpc.weights.endpoints import WeightSenderEndpoint
from relax_hpc.weights.group import host_store
from relax_hpc.weights.sealed_store import SealedStore, agree_epoch, keep_until_exit, seal_store

# How long every trainer rank waits for the others to reach the group's TCP store at start.
RENDEZVOUS_TIMEOUT = timedelta(minutes=10)
# How long a collective waits for a rank before it fails (gloo raises; NCCL's watchdog ends the
# process). Longer than the transfer queue's wait for rows (10 min by default): under fsdp2 a
# rank waits inside a collective while a peer waits for its next rows, and the queue's timeout
# names the partition that starved it. A rank that dies is reported at once by the driver
# (`roles.supervision`), not after this.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class ActorConfig:
    """A trainer rank: the spec tables it reads, as the spec gives them, and what the driver
    resolves for it."""

    model: ModelSpec  # path, dtype
    train: TrainSpec  # the optimizer and its batches, backend, strategy, [train.megatron]
    algorithm: AlgorithmSpec  # the loss, the OPD teacher, routing replay
    rollout: RolloutSpec  # temperature
    checkpoint: CheckpointSpec  # keep_last
    job: JobInfoSpec  # seed
    checkpoint_dir: str  # JOBDIR/checkpoints
    device: str = "cpu"  # resolved (cpu, cuda:N)
    num_threads: int = 0  # torch's intra-op threads; 0: torch's own choice
    archive_dir: str | None = None  # JOBDIR/trajectories when [metrics] trajectory_archive is on
    role_fields: tuple[str, ...] = ()  # fields the ActorFwd / Reference roles write: wait for them
    # [cluster] colocate: the optimizer state leaves the device between steps (engines use it)
    offload_between_steps: bool = False


def trainer_store(host: str, port: int, rank: int, world_size: int, secret: JobSecret,
                  group: str = "trainer") -> SealedStore:
    """The trainer group's store (or another group of ranks': `group`, e.g. "critic"): rank 0
    hosts it listening on `host` only (the address the other ranks are given). Every key, the
    process group's rendezvous included, lives under the job secret's prefix and every value is
    sealed with it (docs/weights.md, "Who can reach the store").

    Kept alive until the process exits: `init_process_group` holds only the C++ half of a store
    written in Python, and the default group lives that long (weights/sealed_store.py)."""
    if rank == 0:
        raw = host_store(host, port, world_size, RENDEZVOUS_TIMEOUT, wait_for_workers=True)
    else:
        raw = dist.TCPStore(host, port, world_size, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
    return keep_until_exit(seal_store(raw, secret, group))


def join_rank_group(group: str, requested_device: str, rank: int, world_size: int, master: str) -> str:
    """This process as rank `rank` of `world_size` ranks of `group` ("trainer", "critic"): with
    several, the rendezvous through rank 0's sealed store at `master` (a fresh epoch each time)
    and the default process group (gloo on CPU, NCCL on GPU); returns the rank's device
    (`rank_device`), made current on CUDA. The process group is the process's own: a group of
    ranks never shares a process with another group's."""
    store: dist.Store | None = None
    local_rank = 0
    if world_size > 1:
        if not master:
            raise ValueError(f"a {group} with several ranks needs the rendezvous address of rank 0")
        host, port = master.rsplit(":", 1)
        # A fresh epoch per rendezvous: a rank address recorded before a restart cannot be put back.
        store = keep_until_exit(agree_epoch(trainer_store(host, int(port), rank, world_size, job_secret(), group),
                                            rank, world_size, group))
        local_rank = local_rank_on_node(store, rank)
    device = rank_device(requested_device, local_rank, ray_gpu_ids=ray_gpu_ids())
    if device.startswith("cuda"):
        torch.cuda.set_device(device)  # NCCL and the weight channel use the current device
    if store is not None:
        group_backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(group_backend, store=store, rank=rank, world_size=world_size,
                                timeout=COLLECTIVE_TIMEOUT)
    return device


def local_rank_on_node(store: dist.Store, rank: int) -> int:
    """How many lower trainer ranks run on this host: this rank's device index there.

    Every rank publishes its host name in the group's store; rank r reads ranks 0..r-1 (waiting
    until they have written)."""
    host = socket.gethostname()
    store.set(f"relax_hpc/trainer_host/{rank}", host)
    return sum(store.get(f"relax_hpc/trainer_host/{r}").decode() == host for r in range(rank))


class ActorWorker(WeightSenderEndpoint, Heartbeats):
    """Rank `rank` of the trainer. With several ranks, rank 0's node hosts the group's TCP store:
    the placement code picks `rendezvous_address()` on a trainer node, pins rank 0 there and passes
    the address to every rank."""

    def __init__(self, cfg: ActorConfig, rank: int = 0, world_size: int = 1, master: str = "",
                 backend: TrainBackend | None = None) -> None:
        """`backend`: the one to drive (tests: `backends.memory.RecordingBackend`); None builds
        the one `[train] backend` names, here."""
        if cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        self.device = join_rank_group("trainer", cfg.device, rank, world_size, master)
        torch.manual_seed(cfg.job.seed + rank)
        self.rank, self.world_size = rank, world_size
        t, a = cfg.train, cfg.algorithm
        self.cfg_micro_batch, self.mini_batches = t.micro_batch_size, t.mini_batches
        self.backend: TrainBackend = backend or make_backend(
            t.backend, cfg.model.path, t, a, dtype=cfg.model.dtype, device=self.device,
            temperature=cfg.rollout.temperature, teacher_path=a.opd_teacher_path if a.name == "opd" else None,
            opd_coef=a.opd_coef, keep_reference="ref_log_probs" not in cfg.role_fields, strategy=t.strategy,
            megatron=t.megatron, seed=cfg.job.seed, routing_replay=a.routing_replay,
        )
        # fsdp2: the whole weights as of the last collective gather (rank 0 only), for the channel.
        self._gathered: list[tuple[str, torch.Tensor]] | None = None
        self._gather_weights()
        # Routing replay: the engine's routed experts travel with each row (not in TRAIN_FIELDS: a
        # get returns only rows that have every field asked for).
        self.role_fields = (*cfg.role_fields, *((ROUTED_EXPERTS_FIELD,) if a.routing_replay else ()))
        if getattr(self.backend, "media_processor", None) is not None:  # a multimodal model reads its media
            self.role_fields = (*self.role_fields, *MEDIA_FIELDS)
        self.offload_between_steps = cfg.offload_between_steps
        self._offloaded = False  # the optimizer state is off the device until the next rows arrive
        from relax_hpc.ckpt.manager import CheckpointManager  # torch's DCP: in the rank, not the driver

        self.checkpoints = CheckpointManager(Path(cfg.checkpoint_dir), keep_last=cfg.checkpoint.keep_last)
        self._queue: TransferQueue | None = None
        self.archive: TrajectoryArchive | None = (
            HDF5TrajectoryArchive(Path(cfg.archive_dir), rank, world_size) if cfg.archive_dir else None)

    def doing(self) -> str:
        """What `relax-hpc status` shows for a trainer rank (relax_hpc/roles/heartbeat.py)."""
        step = getattr(self, "_training", None)
        return "idle" if step is None else f"training step {step}"

    def pid(self) -> int:
        """This rank's process id (its Ray worker log carries it; tests kill it)."""
        return os.getpid()

    def train(self, samples: list[Sample]) -> dict[str, float]:
        stats = self.backend.train(samples)
        self._gather_weights()
        return stats

    def train_from_queue(self, target: Any, step: int, timeout_s: float,
                         prefetch_step: int | None = None,
                         publish_version: int | None = None) -> dict[str, float]:
        """Train on partition train_<step> as its rows arrive; ack them only after the optimizer step.

        Rows are packed straight from their tensors (`pack_rows`); `Sample`s are built only for
        the trajectory archive, which stores them. With `prefetch_step`, the first micro-batch
        of that step is asked for before this one trains (`TransferQueue.prefetch`), so it
        arrives while this step computes. With `publish_version`, rank 0 then starts the
        broadcast of the trained weights as that version (`start_send_weights`: it waits for the
        previous broadcast, snapshots, and sends in the background), so the next step, queued
        behind this call, starts without a round trip to the driver. `train_s` is this rank's
        time for the step, `sync_s` its time starting the broadcast.
        """
        self._training = step
        t_start = time.perf_counter()
        if self._queue is None:
            self._queue = connect_queue(target, f"actor-rank{self.rank}")
        queue, partition = self._queue, partition_name(step)
        received: list[int] = []
        rewards: list[float] = []
        waited = [0.0]  # seconds inside queue.get: rows not there yet (or the get itself)
        trained: list[Sample] = []  # kept only for the trajectory archive
        # Training does not need the dataset row of a sample; the archive records it.
        fields = (*TRAIN_FIELDS, *self.role_fields)
        if self.archive is not None:
            fields = (*fields, *ARCHIVE_FIELDS)

        def row_batches() -> Iterator[list[dict[str, Any]]]:
            if not reads_rows:  # a model-parallel peer reads this replica's rows and shares them
                self._onload()
                return
            # The next micro-batch is fetched while this one trains; rows are acked below.
            batches = queue.stream(partition, "actor", fields, self.cfg_micro_batch, timeout=timeout_s, ack=False)
            while True:
                t0 = time.perf_counter()
                batch = next(batches, None)
                waited[0] += time.perf_counter() - t0
                if batch is None:
                    return
                if batch.rows:  # the engines are done with the device
                    self._onload()
                if batch.rows:
                    received.extend(batch.indices)
                    rewards.extend(float(r["rewards"]) for r in batch.rows)
                    if self.archive is not None:
                        trained.extend(row_to_sample(r) for r in batch.rows)
                    yield batch.rows

        reads_rows = self.backend.reads_rows
        if prefetch_step is not None and reads_rows:
            queue.prefetch(partition_name(prefetch_step), "actor", fields, self.cfg_micro_batch, timeout_s)
        pad_id = self.backend.pad_id
        if self.mini_batches > 1:  # several optimizer steps need the whole batch first
            every = [r for rows in row_batches() for r in rows]  # a rank may get none of them
            stats = self.backend.train_batch(pack_rows(every, pad_id) if every else None)
        else:
            stats = self.backend.train_stream(pack_rows(rows, pad_id) for rows in row_batches())
        if reads_rows:
            queue.ack(partition, "actor", received)
        if self.archive is not None:  # after the optimizer step: only trained samples are archived
            self.archive.append(step, trained)
        t_trained = time.perf_counter()
        if publish_version is not None:
            self._gather_weights()  # sharded: every rank takes part, rank 0 keeps the result
            if self.rank == 0:
                self.start_send_weights(publish_version)
        else:
            self._gathered = None  # the weights moved: no stale copy may be sent
        t_published = time.perf_counter()
        if self.offload_between_steps:  # the engines generate the next step meanwhile
            stats["offloaded_bytes"] = float(self.backend.offload())
            self._offloaded = True
        settle_heap()  # once, after the first step: start-up is over
        return {**stats, "rows": float(len(received)), "reward_sum": float(sum(rewards)),
                "queue_wait_s": waited[0], "train_s": t_trained - t_start, "sync_s": t_published - t_trained}

    def export_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, t.clone()) for n, t in self.live_weights()]

    def live_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The weights themselves: the weight channel snapshots them into its flat buffer.

        Sharded (fsdp2), rank 0's copy gathered at the last published step, start or resume:
        gathering is collective, so it cannot happen here, on rank 0 alone."""
        if not self.backend.sharded:
            return list(self.backend.named_weights())
        if self._gathered is None:
            raise RuntimeError(
                f"trainer rank {self.rank} holds no gathered copy of its sharded weights: with "
                "[train] strategy = \"fsdp2\" they are gathered only at start, after load_checkpoint "
                "and after a train_from_queue step with a publish_version (only rank 0 keeps them)"
            )
        return self._gathered

    def _gather_weights(self) -> None:
        """Sharded: gather the whole weights now (collective: every rank calls it); rank 0 keeps them."""
        if self.backend.sharded:
            weights = list(self.backend.named_weights())
            self._gathered = weights if self.rank == 0 else None

    def compute_log_probs(self, samples: list[Sample]) -> list[list[float]]:
        return self.backend.compute_log_probs(samples)

    def _onload(self) -> None:
        if self._offloaded:
            self.backend.onload()
            self._offloaded = False

    def save_checkpoint(self, state: ResumeState) -> str:
        self._onload()  # the checkpoint holds the optimizer state where training keeps it
        return str(self.backend.save_checkpoint(self.checkpoints, state))

    def load_checkpoint(self) -> ResumeState | None:
        self._onload()
        state = self.backend.load_checkpoint(self.checkpoints)
        self._gather_weights()  # every rank loads, so every rank gathers: the restored weights
        return state

    def memory_record(self) -> dict[str, Any]:
        """The bytes this rank holds, from its tensors (relax_hpc/roles/memory.py)."""
        from relax_hpc.roles.memory import trainer_record

        snapshot, staging = self.weight_channel_bytes()
        gathered = [t for _, t in self._gathered] if self._gathered is not None else []
        return trainer_record(self.backend, self.rank, {"weight_snapshot": snapshot, "gathered_weights": gathered},
                              staging).as_dict()

    def shutdown(self) -> None:
        self.close_weight_channel()
        if self._queue is not None:
            self._queue.close()
        if dist.is_initialized():
            dist.destroy_process_group()
