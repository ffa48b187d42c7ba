"""Throughput and latency of the ZMQ transfer queue against raw pyzmq PUSH/PULL.

Run: ``python benchmarks/bench_queue.py [--quick] [--relay] [--paths shm,tcp,tcp-encrypt]``

For each sample size (64 KiB and 1 MiB) it measures, in the same run and on the same host:

* raw zmq: one process PUSHes samples (one message each, zero-copy) to a PULL in this process;
  with ``--relay`` also through a relay process running zmq.proxy (the two-hop ceiling for a
  broker);
* queue, per path: the server runs in its own process (like the driver), a producer process
  puts samples into ``train_<k>`` partitions (``put_async``: up to 4 puts in flight) and
  completes them, this process reads them as the actor does: ``prefetch`` of partition k+1
  before partition k is read, ``stream`` (the next get in flight while a batch is read; acks
  ride on gets), then ``clear``. Path ``shm`` (the default on one host): payloads go through the server's
  shared-memory directory and only headers cross the loopback. Path ``tcp`` (what a client on
  another host uses): every byte crosses the loopback twice, producer -> server -> consumer,
  through CURVE ([security] payload = "curve", the default); ``tcp-encrypt`` the same with each
  message sealed with AES-256-GCM, ``tcp-authenticate`` with AES-GMAC tags only (each payload
  mode its own server);
* latency: single samples put at a gentle pace while the consumer waits in ``get``; p50/p99 of
  put-call start -> get return (both clocks are CLOCK_MONOTONIC, shared across processes).

Raw and queue runs alternate; the figure is the median over runs of each queue run's GB/s
divided by that of the raw run just before it. It ends with one line per size and path, e.g.
``queue 64KiB 0.84x of raw zmq (shm; median of 5 paired runs; best queue 2.13 GB/s 32.6k samples/s
vs best raw 2.47 GB/s 37.7k samples/s = 0.86x; p50 0.34 ms, p99 0.84 ms)``.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from multiprocessing.synchronize import Event
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from relax_hpc.auth import JobSecret  # noqa: E402
from relax_hpc.transfer.zmq_client import TransferQueueClient  # noqa: E402
from relax_hpc.transfer.zmq_server import TransferQueueServer  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
FORK = mp.get_context("fork")  # children inherit imports; each builds its own zmq context
SECRET = JobSecret.generate()  # the queue's job secret, inherited by the forked server and clients


@dataclass(frozen=True)
class Plan:
    shm: bool  # same-host shared-memory path (else TCP only)
    size: int
    samples: int
    rows_per_message: int
    rows_per_partition: int
    latency_samples: int
    first_step: int  # partition names are never reused, so each run numbers its own steps


@dataclass(frozen=True)
class Result:
    seconds: float
    samples: int
    size: int

    @property
    def gbps(self) -> float:
        return self.samples * self.size / self.seconds / 1e9

    @property
    def per_s(self) -> float:
        return self.samples / self.seconds


# --------------------------------------------------------------------------- raw zmq
def _raw_pusher(address: str, size: int, count: int, go: Event) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 256)
    sock.connect(address)
    payload = np.ones(size, dtype=np.uint8)
    go.wait()
    for _ in range(count):
        sock.send(payload, copy=False)
    sock.close(linger=-1)


def _raw_relay(outbound: int, port_out: Any) -> None:
    import zmq

    ctx = zmq.Context()
    front, back = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port_out.send(front.bind_to_random_port("tcp://127.0.0.1"))
    back.connect(f"tcp://127.0.0.1:{outbound}")
    zmq.proxy(front, back)  # runs in C until the process is terminated


def bench_raw(size: int, count: int, two_hops: bool = False) -> Result:
    """PUSH -> PULL; with ``two_hops`` through a relay process running zmq.proxy in C, the
    ceiling for any design where a broker sits between producer and consumer."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 256)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    relay = None
    target = f"tcp://127.0.0.1:{port}"
    if two_hops:
        receiver, sender = FORK.Pipe(duplex=False)
        relay = FORK.Process(target=_raw_relay, args=(port, sender), daemon=True)
        relay.start()
        target = f"tcp://127.0.0.1:{receiver.recv()}"
    go = FORK.Event()
    proc = FORK.Process(target=_raw_pusher, args=(target, size, count, go))
    proc.start()
    time.sleep(0.2)  # let the pusher connect
    go.set()
    t0 = time.perf_counter()
    for _ in range(count):
        frame = sock.recv(copy=False)
        assert len(frame) == size
    seconds = time.perf_counter() - t0
    proc.join()
    if relay is not None:
        relay.terminate()
        relay.join()
    sock.close(0)
    return Result(seconds, count, size)


# --------------------------------------------------------------------------- queue
PATHS = {"shm": (True, "curve"), "tcp": (False, "curve"), "tcp-encrypt": (False, "encrypt"),
         "tcp-authenticate": (False, "authenticate")}  # path -> (shared memory, the server's [security] payload)


def _serve(bind: str, capacity: int, payload: str, address_out: Any, stop: Event) -> None:
    server = TransferQueueServer(bind, secret=SECRET, capacity=capacity, payload=payload)  # type: ignore[arg-type]
    address_out.send(server.start())
    stop.wait()
    server.stop()


def _queue_producer(address: str, plan: Plan, go: Event) -> None:
    client = _client(address, plan)
    payload = torch.ones(plan.size // 4, dtype=torch.float32)
    go.wait()
    sent, step = 0, plan.first_step
    while sent < plan.samples:
        partition, in_partition = f"train_{step}", min(plan.rows_per_partition, plan.samples - sent)
        for start in range(0, in_partition, plan.rows_per_message):
            n = min(plan.rows_per_message, in_partition - start)
            client.put_async(partition, [{"x": payload}] * n, timeout=120)  # a few in flight
        client.complete(partition, in_partition)  # waits for them
        sent, step = sent + in_partition, step + 1
    client.close()


def _latency_producer(address: str, plan: Plan, go: Event) -> None:
    client = _client(address, plan)
    payload = torch.ones(plan.size // 4, dtype=torch.float32)
    go.wait()
    for i in range(plan.latency_samples):
        client.put(f"latency_{plan.first_step + i}", [{"x": payload, "t": time.perf_counter()}], timeout=60)
        time.sleep(0.002)  # one sample at a time: no queueing in the figure
    client.close()


def _client(address: str, plan: Plan) -> TransferQueueClient:
    client = TransferQueueClient(address, secret=SECRET, shm=plan.shm)
    if plan.shm and client.shm_dir is None:
        raise SystemExit("the server offers no shared-memory directory here (is /dev/shm mounted? RELAX_TQ_SHM=0?)")
    return client


def bench_queue(address: str, plan: Plan) -> Result:
    client = _client(address, plan)
    go = FORK.Event()
    proc = FORK.Process(target=_queue_producer, args=(address, plan, go))
    proc.start()
    time.sleep(0.2)
    go.set()
    t0 = time.perf_counter()
    got, step = 0, plan.first_step
    while got < plan.samples:
        partition = f"train_{step}"
        # As the actor reads: the next partition's first get is asked for before this one is
        # read; within a partition the next get is on its way while a batch is read and acks
        # ride on gets.
        if got + plan.rows_per_partition < plan.samples:
            client.prefetch(f"train_{step + 1}", "bench", ["x"], plan.rows_per_message, timeout=120)
        for batch in client.stream(partition, "bench", ["x"], plan.rows_per_message, timeout=120):
            got += len(batch)
        client.clear(partition)
        step += 1
    seconds = time.perf_counter() - t0
    proc.join()
    client.close()
    return Result(seconds, got, plan.size)


def bench_latency(address: str, plan: Plan) -> list[float]:
    client = _client(address, plan)
    go = FORK.Event()
    proc = FORK.Process(target=_latency_producer, args=(address, plan, go))
    proc.start()
    go.set()
    delays = []
    for i in range(plan.latency_samples):  # one partition per sample, cleared at once: no capacity build-up
        name = f"latency_{plan.first_step + i}"
        batch = client.get(name, "bench", ["x", "t"], 1, timeout=60)
        delays.append((time.perf_counter() - float(batch.rows[0]["t"])) * 1e3)  # type: ignore[arg-type]
        client.ack(name, "bench", batch.indices)
        client.clear(name)
    proc.join()
    client.close()
    return delays


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def label(size: int) -> str:
    return f"{size // MIB}MiB" if size >= MIB else f"{size // KIB}KiB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small volumes (about 10-20 s in all)")
    parser.add_argument("--rows-per-message", type=int, default=16, help="rows per put and per get")
    parser.add_argument("--partitions-in-flight", type=int, default=2, help="queue capacity in partitions")
    parser.add_argument("--repeats", type=int, default=None,
                        help="alternating raw/queue runs per path (default 5, --quick 3)")
    parser.add_argument("--relay", action="store_true", help="also measure raw zmq through a zmq.proxy relay")
    parser.add_argument("--paths", default="shm,tcp,tcp-encrypt",
                        help=f"queue paths to measure, of {', '.join(PATHS)} (default: shm,tcp,tcp-encrypt)")
    args = parser.parse_args(argv)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not paths or any(p not in PATHS for p in paths):
        parser.error(f"--paths must name some of {', '.join(PATHS)}; got {args.paths!r}")
    volume = 128 * MIB if args.quick else 1024 * MIB
    args.repeats = args.repeats or (3 if args.quick else 5)
    # A partition of about 8 MiB and room for two of them: the consumer keeps pace, as the
    # actor does, so the queue is a pipeline and not a store (see docs/transfer-queue.md).
    plans = [
        Plan(True, size, volume // size, args.rows_per_message, max(args.rows_per_message, 8 * MIB // size),
             200 if args.quick else 1000, 0)
        for size in (64 * KIB, MIB)
    ]
    torch.set_num_threads(1)
    summary = []
    for plan in plans:
        with contextlib.ExitStack() as servers:
            capacity = args.partitions_in_flight * plan.rows_per_partition
            by_payload = {payload: servers.enter_context(_server_process(capacity, payload))
                          for payload in sorted({PATHS[p][1] for p in paths})}
            addresses = {p: by_payload[PATHS[p][1]] for p in paths}
            summary.extend(_measure(addresses, plan, args.repeats, paths, args.relay))
    print(f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f} on {os.cpu_count()} CPUs")
    print("\n".join(summary))


@contextlib.contextmanager
def _server_process(capacity: int, payload: str = "curve") -> Iterator[str]:
    receiver, sender = FORK.Pipe(duplex=False)
    stop = FORK.Event()
    server = FORK.Process(target=_serve, args=("tcp://127.0.0.1:0", capacity, payload, sender, stop))
    server.start()
    try:
        yield receiver.recv()
    finally:
        stop.set()
        server.join(10)


def _measure(addresses: dict[str, str], plan: Plan, repeats: int, paths: list[str], relay: bool) -> list[str]:
    # best of a few alternating runs: a shared host's noise hits every path alike
    raws: list[Result] = []
    relays: list[Result] = []
    queues: dict[str, list[Result]] = {path: [] for path in paths}
    for rep in range(repeats):
        raws.append(bench_raw(plan.size, plan.samples))
        if relay:
            relays.append(bench_raw(plan.size, plan.samples, two_hops=True))
        for k, path in enumerate(paths):
            step = (rep * len(paths) + k) * 10**5  # partition names are never reused
            queues[path].append(bench_queue(addresses[path], replace(plan, shm=PATHS[path][0], first_step=step)))
    raw = max(raws, key=lambda r: r.gbps)
    line = f"{label(plan.size):>6}: raw {raw.gbps:6.2f} GB/s {raw.per_s:9.0f}/s (runs {_runs(raws)})"
    if relays:
        best_relay = max(relays, key=lambda r: r.gbps)
        line += f" | raw via relay {best_relay.gbps:6.2f} GB/s ({best_relay.gbps / raw.gbps:.2f}x)"
    print(line, flush=True)
    summary = []
    for path, results in queues.items():
        queue = max(results, key=lambda r: r.gbps)
        # Each queue run against the raw run just before it: the host's load drifts over a run
        # (raw alone varies 2x between runs here), so the paired ratio is the figure; best-of
        # each side is printed beside it.
        paired = statistics.median(q.gbps / r.gbps for q, r in zip(results, raws))
        lat = bench_latency(addresses[path], replace(plan, shm=PATHS[path][0],
                                                     first_step=(1 + paths.index(path)) * 10**7))
        p50, p99 = statistics.median(lat), percentile(lat, 0.99)
        print(
            f"{label(plan.size):>6} {path}: queue {queue.gbps:6.2f} GB/s {queue.per_s:9.0f}/s "
            f"(best {queue.gbps / raw.gbps:.2f}x of best raw; paired runs "
            f"{', '.join(f'{q.gbps / r.gbps:.2f}' for q, r in zip(results, raws))}) | latency p50 {p50:.3f} ms "
            f"p99 {p99:.3f} ms ({repeats} x {plan.samples} samples; runs {_runs(results)})",
            flush=True,
        )
        summary.append(
            f"queue {label(plan.size)} {paired:.2f}x of raw zmq ({path}; median of {repeats} paired runs; best "
            f"queue {queue.gbps:.2f} GB/s {queue.per_s / 1e3:.1f}k samples/s vs best raw {raw.gbps:.2f} GB/s "
            f"{raw.per_s / 1e3:.1f}k samples/s = {queue.gbps / raw.gbps:.2f}x; p50 {p50:.2f} ms, p99 {p99:.2f} ms)"
        )
    return summary


def _runs(results: list[Result]) -> str:
    return ", ".join(f"{r.gbps:.2f}" for r in results)


if __name__ == "__main__":
    main()
