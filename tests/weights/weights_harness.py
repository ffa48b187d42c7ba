"""Process entry points and fixtures' data for the weight-channel tests.

Child processes come from a forkserver that imported torch once (cheap to fork, and the
forkserver itself never ran a torch op, so no thread pool is forked mid-use). Results travel
back as plain bytes, so the parent compares exact bit patterns.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import traceback
from typing import Any

import torch

CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "relax_hpc.weights.channel", "weights_harness"])


def make_weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    """A deterministic mix of dtypes and shapes, different for every seed."""
    g = torch.Generator().manual_seed(seed)
    return [
        ("embed.weight", torch.randn(300, 64, generator=g)),  # 76.8 kB: direct when direct_bytes is small
        ("layer.0.w", torch.randn(17, 33, 5, generator=g)),
        ("layer.0.b", torch.randn(33, generator=g)),
        ("layer.1.w_bf16", torch.randn(64, 64, generator=g).to(torch.bfloat16)),
        ("layer.1.b_bf16", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("ids.int64", torch.randint(-(2**40), 2**40, (10,), generator=g)),
        ("ids.int32", torch.randint(-1000, 1000, (5, 6), generator=g, dtype=torch.int32)),
        ("mask.bool", torch.rand(9, generator=g) > 0.5),
        ("scale.scalar", torch.tensor(float(seed) + 0.25)),
        ("empty", torch.empty(0, 4)),
        ("transposed", torch.randn(8, 12, generator=g).t()),  # non-contiguous source
    ]


def tensor_bytes(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    flat = t.detach().contiguous().reshape(-1)
    raw = flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
    return str(t.dtype), tuple(t.shape), raw.numpy().tobytes()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sender_main(
    n: int, plan: list[dict[str, Any]], timeout_s: float, device: str, port_out: Any, results: Any,
    flat: bool = False, staged: bool | None = None,
) -> None:
    """Host the channel, then run each planned broadcast: {version, seed, bucket_bytes, direct_bytes}.

    `flat`: send a `snapshot` (refilling the previous one) instead of loose tensors. `staged`:
    the channel's `stage` (None: its default, staged when the snapshot is off the wire's device).
    """
    from relax_hpc.auth import job_secret
    from relax_hpc.weights.channel import WeightChannelSender

    torch.set_num_threads(1)
    sender = WeightChannelSender("127.0.0.1", 0, n, timeout_s=timeout_s, device=device, secret=job_secret(),
                                 stage=staged)
    port_out.put(sender.port)
    outcomes: list[tuple[str, Any]] = []
    snapshot = None
    try:
        for step in plan:
            sender.bucket_bytes, sender.direct_bytes = step["bucket_bytes"], step["direct_bytes"]
            named: Any = [(k, v.to(device)) for k, v in make_weights(step["seed"])]
            if flat:
                named = snapshot = sender.snapshot(named, reuse=snapshot)
            pending = sender.broadcast_async(named, step["version"])
            outcomes.append(("sent", pending.wait()))
    except Exception as exc:  # noqa: BLE001 - the parent asserts on the message
        outcomes.append(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        results.put(outcomes)
        sender.close()


def receiver_main(
    port: int, rank: int, n: int, broadcasts: int, timeout_s: float, device: str, results: Any,
    flat: bool = False, staged: bool | None = None,
) -> None:
    """Join as `rank` and take part in `broadcasts` broadcasts (0: join, then idle until killed).

    `flat`: receive into a flat buffer (the previous one when it fits) instead of applying buckets;
    `staged`: that buffer in host memory, each bucket through staging on the wire's device.
    """
    from relax_hpc.auth import job_secret
    from relax_hpc.weights.channel import WeightChannelReceiver

    torch.set_num_threads(1)
    try:
        home = "cpu" if staged else None
        receiver = WeightChannelReceiver(
            "127.0.0.1", port, rank, n, timeout_s=timeout_s, device=device, secret=job_secret(),
            home=home, stage=staged,
        )
        if broadcasts == 0:
            results.put((rank, "joined", None))
            CTX.Event().wait(timeout_s * 4)
            return
        buffer = None
        for _ in range(broadcasts):
            if flat:
                previous = buffer
                buffer, version = receiver.receive_into(previous)
                weights = {name: tensor_bytes(t.cpu()) for name, t in buffer.named()}
                payload = {"version": version, "reused": buffer is previous, "weights": weights,
                           "staging_bytes": receiver.staging_bytes, "buffer_bytes": buffer.nbytes,
                           "largest_bucket": max(b.nbytes for b in buffer.buckets)}
                results.put((rank, "version", payload))
                continue
            got: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
            calls = [0]

            def apply(bucket: list[tuple[str, torch.Tensor]]) -> None:
                calls[0] += 1
                for name, t in bucket:
                    got[name] = tensor_bytes(t.cpu())

            version = receiver.receive(apply)
            results.put((rank, "version", {"version": version, "calls": calls[0], "weights": got}))
        receiver.close()
    except Exception:  # noqa: BLE001
        results.put((rank, "error", traceback.format_exc(limit=3)))


def run_channel(
    receivers: dict[int, int], n: int, plan: list[dict[str, Any]], timeout_s: float, device: str = "cpu",
    join_s: float = 60.0, receiver_device: str | None = None, flat_sender: bool = False,
    flat_receivers: tuple[int, ...] = (), staged: bool | None = None,
) -> tuple[list[tuple[str, Any]], dict[int, list[tuple[str, Any]]]]:
    """Start a sender and the given receivers ({rank: broadcasts}); returns (sender results, per-rank results).

    `flat_sender` sends snapshots; the ranks in `flat_receivers` receive into flat buffers;
    `staged` is given to the sender and to those receivers (see `sender_main`).
    """
    port_q, sender_q, recv_q = CTX.Queue(), CTX.Queue(), CTX.Queue()
    sender = CTX.Process(target=sender_main, args=(n, plan, timeout_s, device, port_q, sender_q, flat_sender, staged))
    sender.start()
    procs = [sender]
    try:
        port = port_q.get(timeout=join_s)
        for rank, count in receivers.items():
            p = CTX.Process(
                target=receiver_main,
                args=(port, rank, n, count, timeout_s, receiver_device or device, recv_q, rank in flat_receivers,
                      staged if rank in flat_receivers else None),
            )
            p.start()
            procs.append(p)
        sent = sender_q.get(timeout=join_s + timeout_s * (len(plan) + 1))
        expected = sum(max(c, 1) for c in receivers.values())
        per_rank: dict[int, list[tuple[str, Any]]] = {r: [] for r in receivers}
        for _ in range(expected):
            try:
                rank, kind, payload = recv_q.get(timeout=join_s + timeout_s)
            except Exception:  # noqa: BLE001 - a receiver that is still blocked reports nothing
                break
            per_rank[rank].append((kind, payload))
        return sent, per_rank
    finally:
        for p in procs:
            p.join(timeout=1.0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
