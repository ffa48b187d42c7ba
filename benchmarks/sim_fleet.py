"""Fleet simulation: N simulated rollout engines behind the real router, queue and staleness rule.

    python benchmarks/sim_fleet.py [--engines 16 64 256] [--steps 8] [--warmup 2] [--queue zmq|memory]
                                   [--prompts-per-engine 8] [--samples 8] [--max-new-tokens 1024]
                                   [--chunks-per-engine 1] [--max-staleness 1] [--train-step-s 0.2]
                                   [--engine-scale 1] [--decode-step-s S --decode-s-per-token S ...]
    python benchmarks/sim_fleet.py --measure   # the engine constants, on the real tiny model

What is real: `EngineRouter` (relax_hpc/engines/router.py) cutting each step into chunks and
handing them out by load, and taking each weight version to every engine; the transfer queue
(the ZMQ server in a process of its own, as the driver hosts it, or the in-memory queue with
`--queue memory`); the staleness rule (`wait_until_may_start`, then `required_weight_version`
and `WeightInbox` at the batch boundary, as `RolloutWorker._produce` does); the rows (`Sample`
-> `samples_to_rows`, by column; group advantages, sample ids), built and put on the
`StepShipper`'s thread while the next step generates. What is simulated: the engines
(relax_hpc/engines/sim_engine.py: a latency model measured on the native engine, long-tailed
response lengths, no CPU spent while "generating"), the rewards (random), and the trainer (a
process of its own; a thread with `--queue memory`), which reads each step's partition as the
actor does (stream, ack after the step), takes `--train-step-s` from its first row, clears the
partition and publishes the next weight version `--sync-s` later.

Each engine gets the same work at every fleet size: `--prompts-per-engine` prompts x `--samples`
samples per step. The run with one engine comes first; the ideal for N engines is N times its
samples/s. Samples/s counts the steps after `--warmup`, from the trainer clearing step warmup - 1
to clearing the last one. Per fleet size it prints the rollout producer's wall time per step by
what it did, and the CPU time per sample spent in router code (less the simulated engines' own),
in queue code (producer and trainer calls, and the whole server process) and building rows.
The last lines are the summary, e.g.

    fleet 16 engines: 0.99 of ideal
    fleet 64 engines: 0.97 of ideal
    fleet 256 engines: 0.95 of ideal
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch

from relax_hpc.algos import group_advantages
from relax_hpc.auth import JobSecret, write_job_secret
from relax_hpc.data.rows import TRAIN_FIELDS, samples_to_rows
from relax_hpc.data.sample import Sample, assign_sample_ids
from relax_hpc.engines.base import SamplingParams
from relax_hpc.engines.router import EngineRouter
from relax_hpc.engines.sim_engine import (
    SIM_EOS, SIM_TOKEN, EngineTimings, ResponseLengths, SimulatedEngineClient, Timeline,
)
from relax_hpc.ops.heap import settle_heap
from relax_hpc.roles.shipping import StepShipper
from relax_hpc.spec.schema import RolloutSpec
from relax_hpc.transfer import InMemoryTransferQueue, partition_name, queue_capacity
from relax_hpc.weights.base import required_weight_version
from relax_hpc.weights.endpoints import WeightInbox

TIMEOUT_S = 600.0


@dataclass(frozen=True)
class FleetConfig:
    steps: int = 8
    warmup: int = 2
    prompts_per_engine: int = 8
    samples: int = 8  # per prompt: a group
    prompt_len: int = 32
    max_new_tokens: int = 1024
    chunks_per_engine: int = RolloutSpec.chunks_per_engine  # the spec's default
    max_staleness: int = 1
    train_step_s: float = 0.2
    sync_s: float = 0.0
    train_batch: int = 256  # rows per get, as the actor's micro-batch
    queue: str = "zmq"
    seed: int = 0
    timings: EngineTimings = EngineTimings()
    lengths: ResponseLengths = ResponseLengths()


@dataclass
class FleetResult:
    engines: int
    counted: int  # samples of the steps after the warm-up, cleared within the window
    window_s: float  # from the clear of step warmup - 1 to the clear of the last step
    step_s: float  # mean time between clears, after the warm-up
    trained: int
    exactly_once: bool
    staleness: dict[int, int]  # step - weight_version -> trained samples
    router_cpu_s: float
    queue_cpu_s: float
    rows_cpu_s: float  # building samples and rows (the rollout role's own work)
    producer_wall: dict[str, float]  # wall seconds per step, by what it was doing (rows, put: the shipper thread)
    engine_busy: float  # the engines' busy share of the whole run
    chunks: int
    produced: int
    errors: list[str] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        return self.counted / self.window_s if self.window_s > 0 else 0.0

    def per_sample_us(self, seconds: float) -> float:
        return 1e6 * seconds / max(self.produced, 1)


class CpuMeter:
    """CPU seconds of the calling thread, and wall seconds, spent inside `with meter.section(name):`."""

    def __init__(self) -> None:
        self.seconds: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.wall: collections.defaultdict[str, float] = collections.defaultdict(float)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        cpu, wall = time.thread_time(), time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self.seconds[name] += time.thread_time() - cpu
                self.wall[name] += time.perf_counter() - wall


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Queues:
    """The run's transfer queue. "zmq": the real server in a process of its own, as the driver
    hosts it in a job (with its heap settled, `settle_heap`, as the driver's is), reached over its
    same-host path; "memory": the in-process queue."""

    def __init__(self, kind: str, capacity: int) -> None:
        self.kind, self._memory, self._server = kind, None, None
        if kind == "memory":
            self._memory = InMemoryTransferQueue(capacity=capacity)
            return
        self._dir = tempfile.mkdtemp(prefix="relax-sim-fleet-")
        self.secret_file = str(write_job_secret(Path(self._dir), JobSecret.generate()))
        context = multiprocessing.get_context("spawn")
        self._conn, theirs = context.Pipe()
        self._server = context.Process(target=serve_queue, args=(capacity, self.secret_file, theirs),
                                       name="transfer-queue", daemon=True)
        self._server.start()
        theirs.close()
        if not self._conn.poll(60):
            raise RuntimeError("the transfer queue server did not start within 60 s")
        self.address = self._conn.recv()

    def handle(self, consumer_id: str) -> Any:
        if self._memory is not None:
            return self._memory.open_session(consumer_id)
        return queue_client(self.address, self.secret_file, consumer_id)

    def server_cpu_s(self) -> float:
        return 0.0 if self._server is None or self._server.pid is None else process_cpu_s(self._server.pid)

    def close(self) -> None:
        if self._server is None:
            return
        self._conn.send("stop")  # the server stops and deletes its shm directory
        self._server.join(timeout=30)
        if self._server.is_alive():
            self._server.kill()
            self._server.join()
        shutil.rmtree(self._dir, ignore_errors=True)


def serve_queue(capacity: int, secret_file: str, conn: Any) -> None:
    """The queue server's process: serve until told to stop."""
    from relax_hpc.transfer.zmq_server import TransferQueueServer

    server = TransferQueueServer("tcp://127.0.0.1:0", capacity=capacity, secret=JobSecret.load(secret_file))
    conn.send(server.start())
    settle_heap()  # start-up is over (the driver settles after its first step)
    conn.recv()
    server.stop()


def queue_client(address: str, secret_file: str, consumer_id: str) -> Any:
    from relax_hpc.transfer.zmq_client import TransferQueueClient

    return TransferQueueClient(address, secret=JobSecret.load(secret_file), consumer_id=consumer_id)


@dataclass
class TrainerReport:
    trained_ids: collections.Counter[int] = field(default_factory=collections.Counter)
    staleness: collections.Counter[int] = field(default_factory=collections.Counter)
    cpu_s: float = 0.0  # in queue calls
    error: str | None = None


def train_steps(queue: Any, cfg: FleetConfig, cleared: Callable[[int, float], None]) -> TrainerReport:
    """The simulated trainer: read each step's partition as the actor does (stream, ack after the
    step), take `train_step_s` from its first row, clear it, and say so (`cleared(step, when)`)."""
    report, fields = TrainerReport(), (*TRAIN_FIELDS, "sample_id")
    meter = CpuMeter()
    try:
        for step in range(cfg.steps):
            partition, received, started = partition_name(step), [], None
            with meter.section("read"):
                batches = queue.stream(partition, "actor", fields, cfg.train_batch, timeout=TIMEOUT_S, ack=False)
            while True:
                with meter.section("read"):
                    batch = next(batches, None)
                if batch is None:
                    break
                started = started or time.monotonic()
                received.extend(batch.indices)
                for row in batch.rows:
                    report.trained_ids[int(row["sample_id"])] += 1
                    report.staleness[step - int(row["weight_version"])] += 1
            left = (started or time.monotonic()) + cfg.train_step_s - time.monotonic()
            if left > 0:
                time.sleep(left)
            with meter.section("read"):
                queue.ack(partition, "actor", received)
                queue.clear(partition)
            cleared(step, time.monotonic())
            settle_heap()  # once, after the first step, as the actor does
    except Exception as e:  # noqa: BLE001 - reported with the result
        report.error = f"trainer: {type(e).__name__}: {e}"
    finally:
        queue.close()
    report.cpu_s = meter.seconds["read"]
    return report


def trainer_process(cfg: FleetConfig, address: str, secret_file: str, conn: Any) -> None:
    """`train_steps` in a process of its own (a job's trainer is one): clears go up `conn` as
    they happen, the report at the end."""
    torch.set_num_threads(1)
    queue = queue_client(address, secret_file, "actor-rank0")
    conn.send(train_steps(queue, cfg, lambda step, when: conn.send((step, when))))
    conn.close()


class MeteredPuts:
    """A queue session whose put and complete count as the meter's "put" section."""

    def __init__(self, queue: Any, meter: CpuMeter) -> None:
        self._queue, self._meter = queue, meter

    def put(self, partition: str, rows: Sequence[dict[str, Any]], timeout: float) -> list[int]:
        with self._meter.section("put"):
            return self._queue.put(partition, rows, timeout=timeout)

    def complete(self, partition: str, total_rows: int) -> None:
        with self._meter.section("put"):
            self._queue.complete(partition, total_rows)

    def close(self) -> None:
        self._queue.close()


class Fleet:
    """One simulation: N engines behind the router, the producer (rollout) on a thread, the trainer."""

    def __init__(self, cfg: FleetConfig, engines: int) -> None:
        self.cfg, self.n = cfg, engines
        self.timeline = Timeline()
        self.clients = [SimulatedEngineClient(f"engine-{i}", self.timeline, cfg.timings, cfg.lengths, seed=i)
                        for i in range(engines)]
        self.router = EngineRouter(self.clients, tokenizer=None, eos_id=SIM_EOS,
                                   chunks_per_engine=cfg.chunks_per_engine)
        self.prompts = engines * cfg.prompts_per_engine
        self.per_step = self.prompts * cfg.samples
        self.queues = Queues(cfg.queue, queue_capacity(self.prompts, cfg.max_staleness, cfg.samples))
        self.inbox = WeightInbox()
        self.meter = CpuMeter()
        self.stop = threading.Event()
        self.cleared_at: list[float] = []
        self.errors: list[str] = []
        self.sampling = SamplingParams(max_new_tokens=cfg.max_new_tokens, stop_token_ids=(SIM_EOS,))

    # -- rollout: RolloutWorker._produce, with the engines simulated -----------------------------

    def produce(self) -> None:
        cfg, queue, meter = self.cfg, self.queues.handle("rollout"), self.meter
        shipper = StepShipper(MeteredPuts(self.queues.handle("rollout-ship"), meter), TIMEOUT_S)
        rng = random.Random(cfg.seed)
        try:
            for step in range(cfg.steps):
                with meter.section("staleness"):
                    while not self.stop.is_set():
                        if (failed := shipper.failure()) is not None:
                            raise failed
                        try:
                            queue.wait_until_may_start(step, cfg.max_staleness, timeout=1.0)
                            break
                        except TimeoutError:
                            continue
                if self.stop.is_set():
                    return
                with meter.section("weights"):  # the batch boundary
                    required = required_weight_version(step, 0, 0, cfg.max_staleness)
                    if not self.inbox.wait_for(required, self.router.weight_version, self.stop, TIMEOUT_S, "rollout"):
                        return
                    self.inbox.install(self.router.bind_weights, self.router.update_weights)
                prompts = [[SIM_TOKEN] * cfg.prompt_len for _ in range(self.prompts) for _ in range(cfg.samples)]
                seed = (cfg.seed * 1_000_003 + step) * 131
                with meter.section("generate"):
                    gens = self.router.generate(prompts, self.sampling, seed=seed, group_size=cfg.samples)
                with meter.section("ship_wait"):  # the step before must be on the queue first
                    shipper.ship(step, functools.partial(self._rows, step, gens, rng))
                settle_heap()  # once, after the first step, as RolloutWorker._produce does
            with meter.section("ship_wait"):
                shipper.wait()
        except Exception as e:  # noqa: BLE001 - reported with the result
            self.errors.append(f"producer: {type(e).__name__}: {e}")
            self.stop.set()
        finally:
            with contextlib.suppress(Exception):
                shipper.close()
            queue.close()

    def _rows(self, step: int, gens: list[Any], rng: random.Random) -> Sequence[dict[str, Any]]:
        with self.meter.section("rows"):  # on the shipper's thread
            return self._build_rows(step, gens, rng)

    def _build_rows(self, step: int, gens: list[Any], rng: random.Random) -> Sequence[dict[str, Any]]:
        n = self.cfg.samples
        groups: list[list[Sample]] = []
        for k, gen in enumerate(gens):
            if k % n == 0:
                groups.append([])
            reward = float(rng.random() < 0.5)
            groups[-1].append(Sample(prompt_ids=gen.prompt_ids, response_ids=gen.token_ids,
                                     rollout_log_probs=gen.logprobs, weight_version=gen.weight_version,
                                     group_id=step * self.prompts + k // n, prompt_index=k // n,
                                     finish_reason=gen.finish_reason, reward=reward, raw_reward=reward))
        assign_sample_ids(step, groups)
        samples = [s for g in groups for s in g]
        advantages = group_advantages(torch.tensor([s.reward for s in samples]), n, True)
        for sample, adv in zip(samples, advantages.tolist()):
            sample.advantage = adv
        return samples_to_rows(samples)

    def _cleared(self, step: int, when: float) -> None:
        """The trainer cleared `step`: its weights (version step + 1, as the loop numbers them)
        reach rollout `sync_s` later."""
        self.cleared_at.append(when)

        def publish() -> None:
            self.inbox.stage([])
            self.inbox.commit(step + 1)

        self.timeline.at(time.monotonic() + self.cfg.sync_s, publish)

    def _start_trainer(self) -> Callable[[], TrainerReport]:
        """Start the trainer (a thread on the in-memory queue, else a process); returns its join,
        which gives up on it once the producer has failed."""
        gave_up = TrainerReport(error="trainer stopped: the producer failed")
        if self.queues.kind == "memory":
            out: list[TrainerReport] = []
            thread = threading.Thread(target=lambda: out.append(
                train_steps(self.queues.handle("actor-rank0"), self.cfg, self._cleared)), name="trainer", daemon=True)
            thread.start()

            def join_thread() -> TrainerReport:
                while thread.is_alive() and not self.stop.is_set():
                    thread.join(0.5)
                return out[0] if out else gave_up

            return join_thread
        context = multiprocessing.get_context("spawn")
        mine, theirs = context.Pipe()
        proc = context.Process(target=trainer_process, name="trainer", daemon=True,
                               args=(self.cfg, self.queues.address, self.queues.secret_file, theirs))
        proc.start()
        theirs.close()

        def join_process() -> TrainerReport:
            while not self.stop.is_set():
                if not mine.poll(0.5):
                    continue
                try:
                    message = mine.recv()
                except EOFError:
                    proc.join()
                    return TrainerReport(error=f"trainer process exited with {proc.exitcode} before reporting")
                if isinstance(message, TrainerReport):
                    proc.join()
                    return message
                self._cleared(*message)
            proc.terminate()
            proc.join()
            return gave_up

        return join_process

    def run(self) -> FleetResult:
        cfg = self.cfg
        t0 = time.monotonic()
        server_cpu0 = self.queues.server_cpu_s()
        join_trainer = self._start_trainer()
        producer = threading.Thread(target=self.produce, name="rollout")
        producer.start()
        trainer = join_trainer()
        if trainer.error:
            self.errors.append(trainer.error)
            self.stop.set()
        producer.join()
        server_cpu = self.queues.server_cpu_s() - server_cpu0
        self.timeline.close()
        self.queues.close()
        self.router.close()
        expected = set(_planned_ids(cfg.steps, self.prompts, cfg.samples))
        ids = trainer.trained_ids
        once = set(ids) == expected and all(c == 1 for c in ids.values())
        done = len(self.cleared_at)
        first = min(cfg.warmup, done - 1)  # the window starts at the clear of step `warmup - 1`
        marks = [t0, *self.cleared_at]
        window = marks[done] - marks[first] if done else 0.0
        counted = (done - first) * self.per_step if done else 0
        cpu, wall = self.meter.seconds, self.meter.wall
        sim_cpu = sum(c.submit_cpu_s for c in self.clients)
        return FleetResult(
            engines=self.n, counted=counted, window_s=window,
            step_s=window / max(done - first, 1), trained=sum(ids.values()), exactly_once=once,
            staleness=dict(sorted(trainer.staleness.items())),
            router_cpu_s=cpu["generate"] + cpu["weights"] - sim_cpu,
            queue_cpu_s=cpu["staleness"] + cpu["put"] + trainer.cpu_s + server_cpu, rows_cpu_s=cpu["rows"],
            producer_wall={k: wall[k] / max(done, 1) for k in ("staleness", "weights", "generate", "ship_wait", "rows", "put")},
            engine_busy=sum(c.busy_s for c in self.clients) / max(self.n * (marks[done] - t0), 1e-9),
            chunks=sum(c.calls for c in self.clients), produced=sum(c.samples for c in self.clients),
            errors=self.errors,
        )


def _planned_ids(steps: int, prompts: int, samples: int) -> list[int]:
    from relax_hpc.data.sample import make_sample_id

    return [make_sample_id(s, g, m) for s in range(steps) for g in range(prompts) for m in range(samples)]


def run_fleet(cfg: FleetConfig, engines: int) -> FleetResult:
    return Fleet(cfg, engines).run()


def describe(r: FleetResult, ideal: float, cfg: FleetConfig) -> str:
    total = max(sum(r.staleness.values()), 1)
    stale = ", ".join(f"{k}: {100 * v / total:.1f}%" for k, v in r.staleness.items())
    walls = ", ".join(f"{k} {v:.3f}" for k, v in r.producer_wall.items())
    return (f"{r.engines} engines: {r.samples_per_s:.1f} samples/s, ideal {ideal:.1f}, "
            f"{r.samples_per_s / ideal if ideal else 0:.2f} of ideal; step {r.step_s:.3f} s "
            f"(rollout per step, s: {walls}); CPU per sample: router {r.per_sample_us(r.router_cpu_s):.1f} us, "
            f"queue {r.per_sample_us(r.queue_cpu_s):.1f} us, rows {r.per_sample_us(r.rows_cpu_s):.1f} us; "
            f"engines busy {100 * r.engine_busy:.0f}%; step - weight_version: {stale} "
            f"(max_staleness {cfg.max_staleness}); exactly once: {'yes' if r.exactly_once else 'NO'} "
            f"({r.trained} samples, {r.chunks} chunks)")


# -- measuring the engine constants on the real tiny model ------------------------------------------

def measure(repeats: int = 5) -> EngineTimings:
    """Time `NativeEngine` on the tiny model and fit the latency model's constants."""
    import statistics

    from relax_hpc.engines.native import NativeEngine
    from relax_hpc.models.tiny import TinyModelSize, write_tiny_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="relax-sim-measure-") as tmp:
        size = dataclasses.replace(TinyModelSize(), max_position_embeddings=512)
        engine = NativeEngine(write_tiny_model(Path(tmp) / "model", seed=1, size=size))
    engine.eos_id = -1  # no sampled token equals it: every row decodes to max_new_tokens
    model: Any = engine.model  # a transformers model: its config has the vocabulary size
    vocab = int(model.config.vocab_size)

    def seconds(batch: int, width: int, new: int) -> float:
        prompts = [[(i + j) % vocab for j in range(width)] for i in range(batch)]
        params = SamplingParams(max_new_tokens=new)
        engine.generate(prompts, params, seed=0)  # warm-up of this shape
        times = []
        for r in range(repeats):
            t0 = time.perf_counter()
            engine.generate(prompts, params, seed=r + 1)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    decode = [(b, (seconds(b, 16, 72) - seconds(b, 16, 8)) / 64) for b in (1, 8, 32, 64)]
    step_s, token_s = _line(decode)
    # One new token is one sampling step and one decode forward: take that step off the call.
    prefill = [(b * w, seconds(b, w, 1) - step_s - token_s * b) for b in (1, 8, 32) for w in (16, 64, 128)]
    call_s, prefill_s = _line(prefill)
    weights = [(n, t.clone()) for n, t in engine.model.state_dict().items()]
    loads = []
    for r in range(repeats):
        t0 = time.perf_counter()
        engine.update_weights(weights, r + 1)
        loads.append(time.perf_counter() - t0)
    for label, points in (("prefill without the step (B*W tokens)", prefill), ("decode step (batch)", decode)):
        print(label + ": " + ", ".join(f"{x}: {y * 1e3:.3f} ms" for x, y in points))
    return EngineTimings(call_s=max(call_s, 0.0), prefill_s_per_token=max(prefill_s, 0.0),
                         decode_step_s=max(step_s, 0.0), decode_s_per_token=max(token_s, 0.0),
                         load_s=statistics.median(loads))


def _line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Intercept and slope minimising the squared relative errors: the points span 16 to 4096
    tokens, and plain least squares would fit the largest ones and miss the fixed cost."""
    w = [1.0 / max(y, 1e-9) ** 2 for _, y in points]
    sw = sum(w)
    mx = sum(wi * x for wi, (x, _) in zip(w, points)) / sw
    my = sum(wi * y for wi, (_, y) in zip(w, points)) / sw
    slope = (sum(wi * (x - mx) * (y - my) for wi, (x, y) in zip(w, points))
             / sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, points)))
    return my - slope * mx, slope


# -- command line ------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, FleetConfig]:
    t, lengths, d = EngineTimings(), ResponseLengths(), FleetConfig()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--measure", action="store_true", help="measure the engine constants on the tiny model and exit")
    p.add_argument("--engines", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--warmup", type=int, default=d.warmup, help="steps left out of samples/s")
    p.add_argument("--prompts-per-engine", type=int, default=d.prompts_per_engine)
    p.add_argument("--samples", type=int, default=d.samples, help="samples per prompt (a group)")
    p.add_argument("--prompt-len", type=int, default=d.prompt_len)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--chunks-per-engine", type=int, default=d.chunks_per_engine)
    p.add_argument("--max-staleness", type=int, default=d.max_staleness)
    p.add_argument("--train-step-s", type=float, default=d.train_step_s)
    p.add_argument("--sync-s", type=float, default=d.sync_s, help="from a step's clear to its weights at rollout")
    p.add_argument("--train-batch", type=int, default=d.train_batch)
    p.add_argument("--queue", choices=("zmq", "memory"), default=d.queue)
    p.add_argument("--seed", type=int, default=d.seed)
    for name in ("call_s", "prefill_s_per_token", "decode_step_s", "decode_s_per_token", "load_s"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(t, name))
    p.add_argument("--engine-scale", type=float, default=1.0,
                   help="multiply the five engine constants: an engine this many times slower than the tiny model's")
    p.add_argument("--median-len", type=float, default=lengths.median, help="median response length (lognormal)")
    p.add_argument("--sigma", type=float, default=lengths.sigma, help="lognormal shape of response lengths")
    p.add_argument("--truncated", type=float, default=lengths.truncated,
                   help="share of responses that run to --max-new-tokens")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    for flag in ("engines", "prompts_per_engine", "samples", "prompt_len", "max_new_tokens", "chunks_per_engine",
                 "train_batch"):
        if min(getattr(args, flag) if flag == "engines" else [getattr(args, flag)]) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.max_staleness < 0 or args.engine_scale <= 0:
        p.error("--max-staleness must be >= 0 and --engine-scale > 0")
    k = args.engine_scale
    timings = EngineTimings(args.call_s * k, args.prefill_s_per_token * k, args.decode_step_s * k,
                            args.decode_s_per_token * k, args.load_s * k)
    cfg = FleetConfig(steps=args.steps, warmup=args.warmup, prompts_per_engine=args.prompts_per_engine,
                      samples=args.samples, prompt_len=args.prompt_len, max_new_tokens=args.max_new_tokens,
                      chunks_per_engine=args.chunks_per_engine, max_staleness=args.max_staleness,
                      train_step_s=args.train_step_s, sync_s=args.sync_s, train_batch=args.train_batch,
                      queue=args.queue, seed=args.seed, timings=timings,
                      lengths=ResponseLengths(args.median_len, args.sigma, args.truncated))
    return args, cfg


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    args, cfg = parse_args(argv)
    if args.measure:
        print(measure())
        return 0
    print(f"per engine and step: {cfg.prompts_per_engine} prompts x {cfg.samples} samples; {cfg.steps} steps "
          f"({cfg.warmup} warm-up); {cfg.chunks_per_engine} chunks per engine; queue {cfg.queue}; "
          f"max_new_tokens {cfg.max_new_tokens}, lengths {cfg.lengths}; {cfg.timings}", flush=True)
    one = run_fleet(cfg, 1)
    print("fleet " + describe(one, one.samples_per_s, cfg), flush=True)
    ratios = {}
    failed = bool(one.errors) or not one.exactly_once
    for n in args.engines:
        r = run_fleet(cfg, n)
        ideal = n * one.samples_per_s
        ratios[n] = r.samples_per_s / ideal if ideal else 0.0
        print("fleet " + describe(r, ideal, cfg), flush=True)
        for error in r.errors:
            print(f"  error: {error}")
        failed |= bool(r.errors) or not r.exactly_once
    for n, ratio in ratios.items():
        print(f"fleet {n} engines: {ratio:.2f} of ideal")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
