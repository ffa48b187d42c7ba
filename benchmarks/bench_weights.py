"""Weight-channel sync time against one raw torch.distributed broadcast of the same bytes.

Run: ``python benchmarks/bench_weights.py [--quick]``

Three processes on this host (the sender, i.e. trainer rank 0, and 2 receivers) share one
TCPStore and one job secret made here (its values sealed, as in a job). For each model size
(100 MB and 500 MB of float32 parameters shaped like a small transformer: embedding, per-layer
attention and MLP matrices, norms and biases) it alternates:

* raw: one ``broadcast`` of a preallocated flat tensor holding the same number of bytes, on a
  group of the same backend built the same way (the ceiling for any channel);
* channel, as the roles run it: the sender broadcasts a ``snapshot`` of the model (one flat
  buffer laid out in buckets) and every receiver receives into the spare one of its two flat
  buffers (``receive_into``), the one its engine is not bound to; the header, the done message
  and the acknowledgements are included. Taking the snapshot is timed apart: the trainer
  makes that copy before the next training step whatever the channel does (it used to clone).
* ``--loose``: the channel's other path, as a caller with loose tensors uses it: the sender
  packs small tensors into staging buffers, every receiver copies each bucket into its own copy
  of the model (``copy_``).

Each timing runs from a barrier (1-element all-reduce) to a barrier, seen by the sender. The
figure is the median over ``--repeats`` alternating pairs of the channel's time divided by the
raw time of its pair (a shared host's noise drifts over seconds, and hits both of a pair
alike); best against best is printed beside it. gloo on CPU; NCCL when CUDA is available and
there is one GPU per rank. It ends with one line per size, e.g.
``weights 100MB 1.08x of raw broadcast (channel 0.41 s, raw 0.38 s; 0.24 GB/s; snapshot 0.03 s)``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from relax_hpc.auth import JobSecret  # noqa: E402

MB = 1_000_000
MIB = 1 << 20

def _context(device: str) -> Any:
    # fork is cheap and safe on CPU (the parent runs no torch op); CUDA cannot survive a fork
    return mp.get_context("spawn" if device == "cuda" else "fork")


def synthetic_model(total_bytes: int, hidden: int, dtype: Any) -> list[tuple[str, Any]]:
    """Parameters shaped like a transformer, `total_bytes` in all (the embedding takes the rest)."""
    import torch

    item = torch.empty(0, dtype=dtype).element_size()
    shapes: list[tuple[str, tuple[int, ...]]] = []

    def layer(i: int) -> list[tuple[str, tuple[int, ...]]]:
        h = hidden
        return [
            *[(f"layers.{i}.attn.{p}.weight", (h, h)) for p in ("q", "k", "v", "o")],
            (f"layers.{i}.mlp.up.weight", (4 * h, h)), (f"layers.{i}.mlp.up.bias", (4 * h,)),
            (f"layers.{i}.mlp.down.weight", (h, 4 * h)), (f"layers.{i}.mlp.down.bias", (h,)),
            (f"layers.{i}.norm1.weight", (h,)), (f"layers.{i}.norm2.weight", (h,)),
        ]

    def nbytes(items: list[tuple[str, tuple[int, ...]]]) -> int:
        return sum(item * _numel(s) for _, s in items)

    while nbytes(shapes) + nbytes(layer(0)) <= 0.8 * total_bytes:
        shapes += layer(len(shapes) // 10)
    rows = max(1, (total_bytes - nbytes(shapes) - hidden * item) // (hidden * item))
    shapes = [("embed.weight", (rows, hidden)), *shapes, ("final_norm.weight", (hidden,))]
    # Distinct, cheap-to-make values (randn of 500 MB costs seconds per process).
    return [
        (name, (torch.arange(_numel(shape), dtype=torch.float32) * 1e-6 + i).reshape(shape).to(dtype))
        for i, (name, shape) in enumerate(shapes)
    ]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _rank_main(rank: int, port: int, args: argparse.Namespace, size: int, secret: JobSecret, out: Any) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from relax_hpc.weights.channel import WeightChannelReceiver, WeightChannelSender
    from relax_hpc.weights.group import TorchBroadcastGroup

    torch.set_num_threads(1)
    n = args.receivers
    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype)
    named = [(k, v.to(device)) for k, v in synthetic_model(size, args.hidden, dtype)]
    total = sum(t.numel() * t.element_size() for _, t in named)
    if rank == 0:
        chan: Any = WeightChannelSender(
            "127.0.0.1", port, n, bucket_bytes=args.bucket_mib * MIB, timeout_s=300, device=str(device),
            direct_bytes=int(args.direct_mb * MB), secret=secret,
        )
        store = chan.store
    else:
        chan = WeightChannelReceiver(
            "127.0.0.1", port, rank, n, timeout_s=300, device=str(device), secret=secret
        )
        store = chan.store
    raw_group = TorchBroadcastGroup(
        store, rank, 1 + n, "nccl" if device.type == "cuda" else "gloo", 300, "127.0.0.1", device, name="raw"
    )
    flat = torch.ones(total, dtype=torch.uint8, device=device)  # touched: no first-use page faults
    model = {k: v.clone() for k, v in named}
    one = torch.zeros(1, device=device)
    snapshot: Any = None
    buffers: list[Any] = [None, None]  # receiver: [bound to the engine, spare]

    def barrier() -> None:
        raw_group.pg.allreduce([one]).wait()
        if device.type == "cuda":
            torch.cuda.synchronize()

    def apply(bucket: list[tuple[str, Any]]) -> None:
        for name, t in bucket:
            model[name].copy_(t)

    def timed(fn: Any) -> float:
        barrier()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        barrier()
        return time.perf_counter() - t0

    def raw() -> None:
        raw_group.broadcast(flat, 0).wait()

    def take_snapshot() -> None:
        nonlocal snapshot
        if rank == 0 and not args.loose:
            snapshot = chan.snapshot(named, reuse=snapshot)

    def channel(version: int) -> None:
        if rank == 0:
            chan.broadcast(named if args.loose else snapshot, version)
        elif args.loose:
            assert chan.receive(apply, targets=model if args.targets else None) == version
        else:  # the spare buffer takes the new version, then the two trade places (engine swap)
            received, got = chan.receive_into(buffers[1])
            assert got == version
            buffers[:] = [received, buffers[0]]

    raws, chans, snaps = [], [], []
    take_snapshot()
    channel(0)  # warm-up: group construction, buffer allocation
    channel(1000)  # warm-up: the receivers' second flat buffer
    raw()
    for rep in range(args.repeats):
        raws.append(timed(raw))
        snaps.append(timed(take_snapshot))
        chans.append(timed(lambda: channel(rep + 1)))
    if rank != 0:
        got_model = model if args.loose else dict(buffers[0].named())
        ok = all(torch.equal(got_model[k], v) for k, v in named)
        out.put(("check", rank, ok))
    else:
        out.put(("times", total, raws, chans, snaps, len(named)))
    barrier()
    chan.close()
    raw_group.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(args: argparse.Namespace, size: int) -> str:
    ctx = _context(args.device)
    out = ctx.Queue()
    port = _free_port()
    secret = JobSecret.generate()  # one for the whole channel, as a job's ranks share theirs
    procs = [
        ctx.Process(target=_rank_main, args=(r, port, args, size, secret, out)) for r in range(args.receivers + 1)
    ]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=600) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    times = next(r for r in results if r[0] == "times")
    checks = [r for r in results if r[0] == "check"]
    if not all(ok for _, _, ok in checks):
        raise SystemExit(f"weights {size // MB}MB: a receiver's model differs from the sender's after sync")
    _, total, raws, chans, snaps, count = times
    ratio = statistics.median(c / r for c, r in zip(chans, raws))
    raw, chan = statistics.median(raws), statistics.median(chans)
    path = "loose tensors" if args.loose else "flat snapshot -> flat buffers"
    print(
        f"{size // MB:>4} MB ({count} tensors, {args.device}, {path}): raw best {min(raws):.3f} s median "
        f"{raw:.3f} s | channel best {min(chans):.3f} s median {chan:.3f} s | best vs best "
        f"{min(chans) / min(raws):.2f}x | pairs {' '.join(f'{c / r:.2f}' for c, r in zip(chans, raws))} "
        f"(bucket {args.bucket_mib} MiB, direct >= {args.direct_mb} MB, {args.repeats} pairs)",
        flush=True,
    )
    snap = f"; snapshot {statistics.median(snaps):.3f} s" if not args.loose else ""
    return (
        f"weights {size // MB}MB {ratio:.2f}x of raw broadcast (channel {chan:.3f} s, raw {raw:.3f} s; "
        f"{total / chan / 1e9:.2f} GB/s{snap})"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (under about 30 s)")
    parser.add_argument("--repeats", type=int, default=None, help="alternating raw/channel pairs")
    parser.add_argument("--receivers", type=int, default=2)
    parser.add_argument("--bucket-mib", type=int, default=512, help="channel bucket size in MiB (the channel's default)")
    parser.add_argument("--direct-mb", type=float, default=16.0, help="tensors of at least this go unpacked")
    parser.add_argument("--loose", action="store_true",
                        help="send loose tensors and copy each bucket into the receivers' models")
    parser.add_argument("--no-targets", dest="targets", action="store_false",
                        help="with --loose: copy direct buckets too (no in-place receive)")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size of the synthetic model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--sizes", default="100,500", help="model sizes in MB, comma-separated")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (5 if args.quick else 9)
    if args.device == "auto":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        args.device = "cuda" if gpus >= 2 else "cpu"
        if args.device == "cuda":
            args.receivers = min(args.receivers, gpus - 1)
    summary = [measure(args, int(s) * MB) for s in args.sizes.split(",")]
    print("\n".join(summary))


if __name__ == "__main__":
    main()
