"""Step time vs rollout engines and trainer ranks: a model from measured component costs, checked
against real runs.

    python benchmarks/step_model.py [--steps 60] [--warmup 10] [--configs colocate:1:1,colocate:2:1,...]
                                    [--repeats 5] [--no-runs]

1. Measures, on this machine and from the code a run executes (docs/scaling.md has the list):
   the host's parallel speed-up (two single-threaded torch processes against one, as
   bench_federation.py measures it), one engine pass of B samples of the tiny task
   (`EngineRouter.generate` over the native engine, in process and through an `EngineHost` Ray
   actor), reward scoring per sample (`RewardHub.score`), advantages and the rows per sample
   (`RolloutWorker._rows_of`: `samples_to_rows`), queue put and get per row (the ZMQ queue server in a process of its own, the trainer's
   `ActorWorker.train_from_queue`), the trainer's step per sample (the same call, less its
   waits), the weight channel's broadcast and snapshot per byte (bench_weights.py's ranks, one
   receiver), sharing a weight version with an engine actor (`RayEngineClient.share` /
   `load_weights`), one gloo all-reduce between two processes (trainer ranks), and one Ray call
   and one queue request round trip.
2. Predicts the step time of each configuration with `predict_step_s` (a pure function of those
   costs; docs/scaling.md states the model).
3. Runs jobspecs/tiny_local.toml through `relax_hpc.driver.run.run_job` (bench_async.py's code
   path: a temporary job dir, a local Ray cluster) for each configuration and reads the mean
   `time/step_s` of metrics.jsonl after `--warmup` steps.

A configuration is MODE:ENGINES:RANKS, MODE colocate or async (max_staleness 1, tis_cap 2.0, as
bench_async.py runs it). The last lines are the table:

    config            predicted s  measured s  measured/predicted
    colocate e1 r1         0.0901      0.1098                1.22
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from relax_hpc.spec.schema import RolloutSpec  # noqa: E402

# The tiny_local step: 8 prompts x 32 samples, one micro-batch of 256; the spec's chunks per engine.
TINY_GROUPS, TINY_GROUP_SIZE, TINY_MICRO_BATCH = 8, 32, 256
CHUNKS_PER_ENGINE = RolloutSpec.chunks_per_engine  # [rollout] chunks_per_engine's default, as the runs use it
DEFAULT_CONFIGS = "colocate:1:1,colocate:2:1,colocate:4:1,async:1:1,async:1:2"


# -- the model ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Costs:
    """Measured component costs, in seconds (per sample, per row, per byte where named so)."""

    cores: float  # parallel speed-up of 2 single-threaded processes over 1 (2.0: two free cores)
    gen_call_s: float  # one engine pass, in process: gen_call_s + gen_sample_s * B
    gen_sample_s: float
    remote_call_s: float  # one engine pass in an EngineHost actor (N > 1 engines): the same line
    remote_sample_s: float
    reward_sample_s: float  # RewardHub.score
    rows_sample_s: float  # group advantages + the rows (samples_to_rows)
    put_row_s: float  # producer's put + complete, per row
    get_row_s: float  # trainer's get (stream) + ack, per row
    train_fixed_s: float  # trainer compute (forward, backward, optimizer step) = fixed + per sample * B
    train_sample_s: float
    broadcast_fixed_s: float  # weight channel, trainer rank 0 -> one receiver: fixed + per byte * bytes
    broadcast_byte_s: float
    snapshot_fixed_s: float  # rank 0 copies its weights into the channel's flat buffer
    snapshot_byte_s: float
    engine_share_s: float  # ray.put of one weight version for the engine actors (N > 1)
    engine_load_s: float  # one engine actor loading it
    ray_rt_s: float  # one Ray actor call's round trip
    queue_rt_s: float  # one queue request's round trip
    model_bytes: int = 407_040  # what is broadcast (the tiny model, float32)
    collective_s: float = 0.0  # one gloo all-reduce of a few bytes between 2 processes (trainer ranks)
    param_tensors: int = 0  # the model's parameter tensors: ddp all-reduces each one's gradient


@dataclass(frozen=True)
class Prediction:
    step_s: float
    terms: dict[str, float] = field(default_factory=dict)  # the parts the step time is made of
    bound: str = ""  # what sets the step time: "serial", "rollout", "trainer" or "cores"


def generation_s(c: Costs, engines: int, samples: int, groups: int, chunks_per_engine: int = CHUNKS_PER_ENGINE) -> float:
    """One step's generation: the router hands one engine the whole step in one pass; N > 1 engine
    actors get min(groups, N * chunks_per_engine) chunks of whole groups, one at a time each. The
    engines share the host's cores: at most min(N, cores) passes run at once."""
    if engines <= 1:
        return c.gen_call_s + c.gen_sample_s * samples
    chunks = min(groups, engines * chunks_per_engine)
    one_pass = c.remote_call_s + c.remote_sample_s * samples / chunks
    waves = max(math.ceil(chunks / engines), chunks / min(engines, c.cores))
    return waves * one_pass


def engine_work_s(c: Costs, engines: int, samples: int, groups: int, chunks_per_engine: int = CHUNKS_PER_ENGINE) -> float:
    """CPU seconds the engines spend on one step's generation (all passes, one after another)."""
    if engines <= 1:
        return generation_s(c, 1, samples, groups)
    chunks = min(groups, engines * chunks_per_engine)
    return chunks * (c.remote_call_s + c.remote_sample_s * samples / chunks)


def install_s(c: Costs, engines: int) -> float:
    """New weights into the engines at the batch boundary: one engine in the rollout process binds
    the received buffer (no copy: 0 here); N > 1 engine actors get one shared copy each through
    Ray's object store, loading at the same time on min(N, cores) cores."""
    if engines <= 1:
        return 0.0
    return c.engine_share_s + c.engine_load_s * engines / min(engines, c.cores)


def train_s(c: Costs, samples: int, ranks: int, micro_batch: int) -> float:
    """The trainer's compute for one step. Ranks take micro-batches off the step's partition as
    they come (one get of up to `micro_batch` rows each), so the busiest rank trains
    ceil(ceil(samples / micro_batch) / ranks) micro-batches; ranks that train share the cores.
    With several ranks (ddp, TorchBackend.train_stream) every rank then makes one all-reduce per
    parameter tensor's gradient and about 4 more collectives (row and token counts, the names and
    values of the step's statistics): (param_tensors + 4) collectives' latency, plus the
    gradients' bytes twice over the wire at the weight channel's speed per byte."""
    micro = math.ceil(samples / micro_batch)
    rows = min(samples, math.ceil(micro / ranks) * micro_batch)
    busy = min(ranks, micro)
    t = (c.train_fixed_s + c.train_sample_s * rows) * max(1.0, busy / c.cores)
    if ranks > 1:
        t += (c.param_tensors + 4) * c.collective_s + 2 * c.broadcast_byte_s * c.model_bytes
    return t


def predict(c: Costs, engines: int, trainer_ranks: int, mode: str, *, samples: int = TINY_GROUPS * TINY_GROUP_SIZE,
            groups: int = TINY_GROUPS, micro_batch: int = TINY_MICRO_BATCH, chunks_per_engine: int = CHUNKS_PER_ENGINE) -> Prediction:
    """The step time of `mode` ("colocate": max_staleness 0; "async": max_staleness >= 1).

    colocate: every part is on one path, one after another (relax_hpc/driver/loop.py):
        handoff + broadcast(bytes) + install(N) + G(N) + S (reward + rows + put + get) + train(S, R) + snapshot(bytes)
    handoff is what passes between the trainer's end and the next generation: the step's result
    back to the driver (a Ray call), the clear (a queue request), rollout's staleness wait (a queue
    request) and the receivers' post of the broadcast (a Ray call).
    async: rollout generates step N + 1 while step N trains, so
        max(rollout side, trainer side, (CPU work of both sides + broadcast) / cores)
    rollout side = install(N) + G(N) + S (reward + rows + put); trainer side = S get + train(S, R) +
    snapshot; the broadcast runs on the trainer's background thread and off both paths.
    """
    S = samples
    gen = generation_s(c, engines, S, groups, chunks_per_engine)
    inst = install_s(c, engines)
    score = S * (c.reward_sample_s + c.rows_sample_s)
    put, get = S * c.put_row_s, S * c.get_row_s
    train = train_s(c, S, trainer_ranks, micro_batch)
    snap = c.snapshot_fixed_s + c.snapshot_byte_s * c.model_bytes
    bcast = c.broadcast_fixed_s + c.broadcast_byte_s * c.model_bytes
    if mode == "colocate":
        handoff = 2 * c.ray_rt_s + 2 * c.queue_rt_s
        terms = {"handoff": handoff, "broadcast": bcast, "install": inst, "generate": gen,
                 "reward+rows": score, "put": put, "get": get, "train": train, "snapshot": snap}
        return Prediction(sum(terms.values()), terms, "serial")
    if mode != "async":
        raise ValueError(f"mode {mode!r}: colocate or async")
    rollout = inst + gen + score + put
    trainer = get + train + snap
    work = (inst + engine_work_s(c, engines, S, groups, chunks_per_engine) + score + put) + trainer + bcast
    sides = {"rollout": rollout, "trainer": trainer, "cores": work / c.cores}
    bound = max(sides, key=lambda k: sides[k])
    terms = {"rollout side": rollout, "trainer side": trainer, "cpu work / cores": work / c.cores,
             "generate": gen, "train": train}
    return Prediction(sides[bound], terms, bound)


def predict_step_s(costs: Costs, engines: int, trainer_ranks: int, mode: str, **shape: int) -> float:
    """Predicted seconds per training step (see `predict`)."""
    return predict(costs, engines, trainer_ranks, mode, **shape).step_s


# -- measuring the costs ----------------------------------------------------------------------------

def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return my - slope * mx, slope


def median_s(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_weights(sizes: list[int], repeats: int) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(bytes, broadcast s) and (bytes, snapshot s) per size: bench_weights.py's ranks (the weight
    channel, flat snapshot into flat buffers), trainer rank 0 and one receiver (rollout)."""
    import bench_weights
    from relax_hpc.auth import JobSecret

    args = argparse.Namespace(receivers=1, device="cpu", dtype="float32", hidden=64, bucket_mib=512,
                              direct_mb=16.0, loose=False, targets=True, repeats=repeats)
    bcast, snaps = [], []
    for size in sizes:
        ctx = mp.get_context("fork")
        out = ctx.Queue()
        port = bench_weights._free_port()
        secret = JobSecret.generate()
        procs = [ctx.Process(target=bench_weights._rank_main, args=(r, port, args, size, secret, out))
                 for r in range(2)]
        for p in procs:
            p.start()
        results = [out.get(timeout=300) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        _, total, _raws, chans, snap, _ = next(r for r in results if r[0] == "times")
        bcast.append((total, statistics.median(chans)))
        snaps.append((total, statistics.median(snap)))
    return bcast, snaps


def _collective_rank(rank: int, port: int, repeats: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    one = torch.ones(4, dtype=torch.float64)
    for _ in range(20):
        dist.all_reduce(one)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(50):
            dist.all_reduce(one)
        times.append((time.perf_counter() - t0) / 50)
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def measure_collective_s(repeats: int) -> float:
    """One gloo all-reduce of 4 numbers between two processes on this host (trainer ranks)."""
    import bench_weights

    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port = bench_weights._free_port()
    procs = [ctx.Process(target=_collective_rank, args=(r, port, repeats, out)) for r in range(2)]
    for p in procs:
        p.start()
    seconds = float(out.get(timeout=120))
    for p in procs:
        p.join(timeout=30)
    return seconds


def measure_costs(base: str, model_dir: Path, root: Path, repeats: int, log: Callable[[str], None]) -> Costs:
    import bench_async
    import bench_federation
    import bench_queue

    from relax_hpc.auth.secret import SECRET_ENV, write_job_secret

    log("host: parallel speed-up of 2 single-threaded torch processes ...")
    cores = min(2.0, max(1.0, statistics.median(bench_federation.host_parallel_speedup() for _ in range(3))))
    log(f"  {cores:.2f}x ({os.cpu_count()} CPUs)")

    # The weight channel first: its ranks are forked, before this process runs torch much.
    tiny = 407_040
    bcast, snaps = measure_weights([tiny, 20_000_000], repeats)
    collective = measure_collective_s(repeats)
    log(f"gloo all-reduce between 2 processes: {collective * 1e3:.3f} ms")
    b0, b1 = fit_line([(float(x), y) for x, y in bcast])
    s0, s1 = fit_line([(float(x), y) for x, y in snaps])
    log("weights: " + ", ".join(f"{x / 1e6:.2f} MB broadcast {y * 1e3:.2f} ms" for x, y in bcast)
        + "; snapshot " + ", ".join(f"{y * 1e3:.2f} ms" for _, y in snaps))

    import torch

    from relax_hpc.driver.run import role_configs
    from relax_hpc.roles.actor import ActorWorker
    from relax_hpc.roles.rollout import RolloutWorker
    from relax_hpc.spec import parse_spec

    job_dir = root / "measure"
    job_dir.mkdir(parents=True, exist_ok=True)
    spec = parse_spec(bench_async.spec_text(base, model_dir, job_dir, 10, "colocate", 0, None), "<step model>")
    rollout_cfg, actor_cfg = role_configs(spec, job_dir, "cpu")
    n = rollout_cfg.rollout.n_samples_per_prompt
    saved_secret = os.environ.get(SECRET_ENV)
    os.environ[SECRET_ENV] = str(write_job_secret(job_dir, bench_queue.SECRET))  # the queue's and roles'
    try:
        with bench_queue._server_process(capacity=4 * TINY_GROUPS * n) as address:
            worker = RolloutWorker(rollout_cfg)  # one engine in process, as num_engines = 1 runs it
            torch.set_num_threads(1)
            router, sampling, rows = worker.engine, worker.sampling, worker.rows

            def prompts(groups: int) -> list[list[int]]:
                return [rows[g % len(rows)].prompt_ids for g in range(groups) for _ in range(n)]

            def gen_line(r: Any, label: str) -> tuple[float, float]:
                points = []
                for groups in (1, 2, 4, 8):
                    batch = prompts(groups)
                    r.generate(batch, sampling, seed=0, group_size=n)  # warm-up of this shape

                    def call(b: list[list[int]] = batch) -> Any:
                        return r.generate(b, sampling, seed=1, group_size=n)

                    points.append((len(batch), median_s(call, repeats)))
                log(f"generation, {label}: " + ", ".join(f"B={b} {s * 1e3:.2f} ms" for b, s in points))
                return fit_line([(float(b), s) for b, s in points])

            gen_call, gen_sample = gen_line(router, "engine in process")
            # Reward, advantages and rows: a real step of samples, as the producer makes them.
            groups, _ = worker._generate_groups(TINY_GROUPS, 0, 0)
            samples = [s for g in groups for s in g]
            reward = median_s(lambda: worker.rewards.score(samples), repeats) / len(samples)

            def rows_of() -> Sequence[dict[str, Any]]:
                worker._set_advantages(samples)
                return worker._rows_of(samples)  # by column, as the producer builds them

            step_rows = rows_of()
            rows_s = median_s(rows_of, repeats) / len(samples)
            log(f"reward {reward * 1e6:.1f} us/sample, advantages + rows {rows_s * 1e6:.1f} us/sample "
                f"(mean response {sum(s.response_length for s in samples) / len(samples):.2f} tokens)")

            # Queue and trainer: the producer's put, then the trainer's own step call.
            producer = bench_queue.TransferQueueClient(address, secret=bench_queue.SECRET, consumer_id="rollout")
            actor = ActorWorker(actor_cfg)
            puts: dict[int, list[float]] = {}
            trains: dict[int, list[tuple[float, float]]] = {}
            for step in range(2 + 2 * repeats):
                size = len(step_rows) if step % 2 == 0 else len(step_rows) // 2
                part = f"train_{step}"
                t0 = time.perf_counter()
                producer.put(part, step_rows[:size])
                producer.complete(part, size)
                put_s = time.perf_counter() - t0
                stats = actor.train_from_queue(address, step, 60.0)
                producer.clear(part)
                if step >= 2:  # after a warm-up step of each size
                    puts.setdefault(size, []).append(put_s)
                    trains.setdefault(size, []).append((stats["queue_wait_s"], stats["train_s"] - stats["queue_wait_s"]))
            full = len(step_rows)
            put_row = statistics.median(puts[full]) / full
            get_row = statistics.median(w for w, _ in trains[full]) / full
            t_fixed, t_sample = fit_line([(float(size), statistics.median(c for _, c in v)) for size, v in trains.items()])
            queue_rt = median_s(lambda: producer.clear("train_none"), 5 * repeats)
            log(f"queue: put {put_row * 1e6:.1f} us/row, get {get_row * 1e6:.1f} us/row, round trip "
                f"{queue_rt * 1e3:.3f} ms; train " + ", ".join(
                    f"{size} rows {statistics.median(c for _, c in v) * 1e3:.1f} ms" for size, v in sorted(trains.items())))
            weights = [(name, t.detach().clone()) for name, t in actor.backend.named_weights()]
            param_tensors = sum(1 for _ in actor.backend.model.parameters())
            actor.shutdown()
            producer.close()
            worker.stop_producer()
    finally:
        if saved_secret is None:
            os.environ.pop(SECRET_ENV, None)
        else:
            os.environ[SECRET_ENV] = saved_secret

    # Engines in Ray actors: one pass through an EngineHost, sharing a version, one call's round trip.
    import ray

    from bench_engines import router_over
    from relax_hpc.roles.engine_host import EngineHost, RayEngineClient

    ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}})
    try:
        host: Any = ray.remote(EngineHost).options(num_cpus=0).remote("native", str(model_dir), "float32", "cpu", 1)
        ray.get(host.pid.remote())
        remote_call, remote_sample = gen_line(router_over([host], router.tokenizer, 2), "engine in a Ray actor")
        client = RayEngineClient("engine-0", host)
        version = [1]

        def share_load() -> tuple[float, float]:
            t0 = time.perf_counter()
            shared = client.share(weights, version[0])
            t1 = time.perf_counter()
            client.load_weights(shared, version[0]).result()
            version[0] += 1
            return t1 - t0, time.perf_counter() - t1

        share_load()
        loads = [share_load() for _ in range(repeats)]
        share = statistics.median(s for s, _ in loads)
        load = statistics.median(x for _, x in loads)
        ray_rt = median_s(lambda: ray.get(host.weight_version.remote()), 5 * repeats)
        log(f"engine actor: share {share * 1e3:.2f} ms, load {load * 1e3:.2f} ms per version; "
            f"Ray call round trip {ray_rt * 1e3:.3f} ms")
    finally:
        ray.shutdown()
    # The lines are kept as fitted, a negative intercept included: they are used only within the
    # sizes they were measured at, where they pass through the measured points.
    return Costs(cores=cores, gen_call_s=gen_call, gen_sample_s=gen_sample,
                 remote_call_s=remote_call, remote_sample_s=remote_sample,
                 reward_sample_s=reward, rows_sample_s=rows_s, put_row_s=put_row, get_row_s=get_row,
                 train_fixed_s=t_fixed, train_sample_s=t_sample,
                 broadcast_fixed_s=b0, broadcast_byte_s=b1,
                 snapshot_fixed_s=s0, snapshot_byte_s=s1,
                 engine_share_s=share, engine_load_s=load, ray_rt_s=ray_rt, queue_rt_s=queue_rt,
                 model_bytes=sum(t.numel() * t.element_size() for _, t in weights),
                 collective_s=collective, param_tensors=param_tensors)


# -- real runs --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    mode: str
    engines: int
    ranks: int

    @property
    def label(self) -> str:
        return f"{self.mode} e{self.engines} r{self.ranks}"


def parse_configs(text: str) -> list[Config]:
    configs = []
    for item in text.split(","):
        mode, engines, ranks = item.strip().split(":")
        if mode not in ("colocate", "async"):
            raise ValueError(f"config {item!r}: mode is colocate or async")
        configs.append(Config(mode, int(engines), int(ranks)))
    return configs


def config_spec_text(base: str, model_dir: Path, job_dir: Path, steps: int, cfg: Config) -> str:
    """tiny_local as bench_async.py runs it, with `[rollout] num_engines` and `[train] num_processes`."""
    import re

    import bench_async

    async_ = cfg.mode == "async"
    text = bench_async.spec_text(base, model_dir, job_dir, steps, cfg.mode, 1 if async_ else 0, 2.0 if async_ else None)
    text = re.sub(r"(?m)^n_samples_per_prompt = (\d+)", rf"n_samples_per_prompt = \1\nnum_engines = {cfg.engines}", text)
    return re.sub(r"(?m)^steps = (\d+)", rf"steps = \1\nnum_processes = {cfg.ranks}", text)


COMPONENTS = ("time/generate_s", "time/reward_s", "time/train_s", "time/queue_wait_s", "time/sync_s",
              "time/rollout_wait_staleness_s", "time/rollout_wait_weights_s")


def run_config(base: str, model_dir: Path, root: Path, steps: int, warmup: int, cfg: Config) -> dict[str, float]:
    """Mean time/step_s (and the logged component times) of a real run, after `warmup` steps."""
    from relax_hpc.driver.run import run_job
    from relax_hpc.ops.metrics import read_metrics
    from relax_hpc.spec import parse_spec

    job_dir = root / cfg.label.replace(" ", "-")
    spec = parse_spec(config_spec_text(base, model_dir, job_dir, steps, cfg), f"<step model {cfg.label}>")
    run_job(spec, progress=False)
    rows = read_metrics(job_dir / "metrics.jsonl")[warmup:]
    out = {"step_s": statistics.mean(r["time/step_s"] for r in rows)}
    for key in COMPONENTS:
        values = [r[key] for r in rows if key in r]
        if values:
            out[key] = statistics.mean(values)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default=str(REPO / "jobspecs" / "tiny_local.toml"))
    parser.add_argument("--steps", type=int, default=60, help="steps per real run")
    parser.add_argument("--warmup", type=int, default=10, help="first steps of a run left out")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="MODE:ENGINES:RANKS, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per measured cost (median)")
    parser.add_argument("--no-runs", action="store_true", help="measure and predict only")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    configs = parse_configs(args.configs)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    def log(line: str) -> None:
        print(line, flush=True)

    load = os.getloadavg()
    log(f"load at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs")
    from relax_hpc.models.tiny import write_tiny_model

    base = Path(args.spec).read_text()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="relax-step-model-") as tmp:
        root = Path(tmp)
        model_dir = write_tiny_model(root / "model", seed=1)
        costs = measure_costs(base, model_dir, root, args.repeats, log)
        log("costs: " + ", ".join(f"{k} {v:.3g}" for k, v in asdict(costs).items()))
        measured: dict[Config, dict[str, float]] = {}
        if not args.no_runs:
            for cfg in configs:
                measured[cfg] = run_config(base, model_dir, root, args.steps, args.warmup, cfg)
                m = measured[cfg]
                log(f"{cfg.label}: {m['step_s'] * 1e3:.1f} ms/step; " + ", ".join(
                    f"{k.removeprefix('time/')} {v * 1e3:.1f} ms" for k, v in m.items() if k != "step_s"))
    load = os.getloadavg()
    log(f"load at end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {time.perf_counter() - t_start:.0f} s in all")
    nan = float("nan")
    log("per configuration, predicted -> measured (ms): generation (time/generate_s), the trainer's compute "
        "(time/train_s less time/queue_wait_s)")
    for cfg in configs:
        p, m = predict(costs, cfg.engines, cfg.ranks, cfg.mode), measured.get(cfg, {})
        train = m.get("time/train_s", nan) - m.get("time/queue_wait_s", 0.0)
        log(f"  {cfg.label:<16} generate {p.terms['generate'] * 1e3:.1f} -> {m.get('time/generate_s', nan) * 1e3:.1f}, "
            f"train {p.terms['train'] * 1e3:.1f} -> {train * 1e3:.1f}; {p.bound}: "
            + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in p.terms.items()))
    log(f"{'config':<16} {'predicted s':>12} {'measured s':>11} {'measured/predicted':>19}")
    for cfg in configs:
        p = predict(costs, cfg.engines, cfg.ranks, cfg.mode)
        got = measured.get(cfg, {}).get("step_s", nan)
        log(f"{cfg.label:<16} {p.step_s:>12.4f} {got:>11.4f} {got / p.step_s:>19.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
