"""What one omni-modal step costs the transfer queue today: bytes moved and the server's memory.

Run: ``python benchmarks/bench_omni_step.py [--quick] [--paths tcp,shm] [--repeats N]``

The step has jobspecs/qwen3_omni.toml's shape: ``prompts_per_step`` prompts x
``n_samples_per_prompt`` samples, each prompt one synthetic video and one audio clip as the
loader makes them (``relax_hpc.media.items``): uint8 (T, H, W, 3) frames, T from the clip's
length at ``[data] video_fps`` (at most ``max_frames``, padded to the temporal patch), and
float32 mono audio at 16 kHz. The clip length (AVQA's clips are 10 s) and the frame size (the
fitted size depends on the source video; 448x448 is the reference of docs/multimodal.md) are
flags, not read from the spec, which does not fix them.

Rows are built as the rollout role builds them (``samples_to_rows``): today every sample row
carries its own copy of its prompt's media (``MEDIA_FIELDS``), so a step puts
``n_samples_per_prompt`` copies of each prompt's media. The real ``TransferQueueServer`` runs in
its own process; two producer processes each put their half of the prompts' rows in one put
and complete the partition (as two rollout processes would); two consumer processes read it as
two trainer ranks do (consumer ids ``actor-rank0/1``, task ``actor``, the spec's micro-batch,
``stream(..., ack=False)``, the whole share held, then acked: the spec trains 4 mini-batches);
then the partition is cleared. Path ``tcp``: every byte goes producer -> server -> consumer over
the loopback; path ``shm``: producers write payloads into the server's /dev/shm directory and
consumers copy them out, only headers cross the sockets.

Figures, per run and their median over ``--repeats``:

* unique media bytes (one copy per prompt) and row bytes (the array bytes of every row put);
* bytes moved: what the producers put plus what the consumers got, counted from the array
  bytes of the rows handed to ``put`` and returned by ``stream`` (the client exposes no byte
  counters; scalars ride in the msgpack header and are left out);
* GB/s: row bytes / wall time from the first put call to the last row received (one
  CLOCK_MONOTONIC across the processes);
* the server's peak memory in the step: its VmHWM (reset through /proc/<pid>/clear_refs before
  the step), and on ``shm`` the peak size of its shared-memory directory as well, since those
  files hold the step's bytes there and are memory all the same.

It ends with one line per path:
``omni step: moved X.XX GB for Y.YY GB unique = Z.ZZx; server peak memory P.PP GB = Q.QQx one
step's media (tcp; median of N)``.

This is the baseline for media by reference (a prompt's media stored once and rows naming it),
which does not exist yet: a ``--media-by-reference`` mode is to build its rows in
``step_rows`` and count the stored media in ``unique``/``moved`` the same way; the rest of the
measurement stays as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.synchronize import Barrier, Event
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from relax_hpc.auth import JobSecret  # noqa: E402
from relax_hpc.data.rows import MEDIA_FIELDS, TRAIN_FIELDS, media_from_fields, samples_to_rows  # noqa: E402
from relax_hpc.data.sample import Sample  # noqa: E402
from relax_hpc.media.families import FAMILIES  # noqa: E402
from relax_hpc.media.items import MediaItem, PromptMedia  # noqa: E402
from relax_hpc.spec.loader import load_spec  # noqa: E402
from relax_hpc.transfer.columns import ArrayColumn, ColumnRows  # noqa: E402
from relax_hpc.transfer.queue import queue_capacity  # noqa: E402
from relax_hpc.transfer.zmq_client import TransferQueueClient  # noqa: E402
from relax_hpc.transfer.zmq_server import TransferQueueServer  # noqa: E402

GB = 1e9
FORK = mp.get_context("fork")  # children inherit the built rows (copy on write) and the secret
SECRET = JobSecret.generate()
PRODUCERS = CONSUMERS = 2
AUDIO_RATE = 16000  # the Whisper feature extractor's rate, which canonical audio is brought to
MEL_HOP = 160  # audio samples per mel frame of that extractor (100 frames a second)
# Qwen3-Omni's vision tower: 16-pixel patches, 2x2 merged, 2 frames a temporal patch; only the
# prompt's token count depends on these (its placeholders), a few KB of a row of megabytes.
PATCH, MERGE, TEMPORAL = 16, 2, 2
TEXT_TOKENS = 64  # question and choices, beside the media placeholders
TIMEOUT_S = 600.0


@dataclass(frozen=True)
class StepShape:
    prompts: int
    samples: int  # per prompt: the group size
    frames: int
    height: int
    width: int
    video_fps: float
    audio_samples: int
    prompt_tokens: int
    response_tokens: int
    micro_batch: int
    capacity: int  # the queue's rows, as the driver sizes it

    @property
    def video_bytes(self) -> int:
        return self.frames * self.height * self.width * 3  # uint8 RGB

    @property
    def audio_bytes(self) -> int:
        return self.audio_samples * 4  # float32

    @property
    def media_bytes(self) -> int:
        return self.video_bytes + self.audio_bytes

    @property
    def rows(self) -> int:
        return self.prompts * self.samples

    def describe(self) -> str:
        return (f"step {self.prompts} prompts x {self.samples} samples = {self.rows} rows; per prompt: video "
                f"{self.frames} x {self.height} x {self.width} x 3 uint8 ({self.video_bytes / 1e6:.2f} MB, "
                f"{self.video_fps:g} fps) + audio {self.audio_samples} float32 ({self.audio_bytes / 1e6:.2f} MB, "
                f"{AUDIO_RATE} Hz) = {self.media_bytes / 1e6:.2f} MB; tokens {self.prompt_tokens} prompt + "
                f"{self.response_tokens} response; micro-batch {self.micro_batch}")


def step_shape(spec_path: Path, clip_seconds: float, frame_size: int, prompts: int | None,
               response_tokens: int) -> StepShape:
    """The step of ``spec_path`` with clips of ``clip_seconds`` and frames of ``frame_size``
    pixels a side (a multiple of the patch grid's 32, as the loader fits them)."""
    spec = load_spec(spec_path)
    if frame_size % (PATCH * MERGE):
        raise SystemExit(f"--frame-size must be a multiple of {PATCH * MERGE} (the fitted grid), got {frame_size}")
    frames = min(spec.data.max_frames, max(1, round(clip_seconds * spec.data.video_fps)))  # as decode_video samples
    frames += -frames % TEMPORAL  # padded with the last frame, as fit_video does
    audio_samples = int(clip_seconds * AUDIO_RATE)
    video_tokens = frames // TEMPORAL * (frame_size // (PATCH * MERGE)) ** 2
    audio_tokens = FAMILIES["qwen3_omni_moe"].audio_tokens(audio_samples // MEL_HOP)  # type: ignore[misc]
    r = spec.rollout
    return StepShape(
        prompts=prompts or r.prompts_per_step, samples=r.n_samples_per_prompt, frames=frames,
        height=frame_size, width=frame_size, video_fps=spec.data.video_fps, audio_samples=audio_samples,
        prompt_tokens=video_tokens + audio_tokens + TEXT_TOKENS, response_tokens=response_tokens,
        micro_batch=spec.train.micro_batch_size,
        capacity=queue_capacity(prompts or r.prompts_per_step, spec.algorithm.max_staleness, r.n_samples_per_prompt),
    )


def prompt_media(shape: StepShape, rng: np.random.Generator) -> PromptMedia:
    """Random pixels and samples: nothing on the path compresses or dedups, so content is moot."""
    video = np.frombuffer(rng.bytes(shape.video_bytes), np.uint8).reshape(shape.frames, shape.height, shape.width, 3)
    audio = rng.uniform(-1.0, 1.0, shape.audio_samples).astype(np.float32)
    return PromptMedia((MediaItem("video", video, shape.video_fps), MediaItem("audio", audio, float(AUDIO_RATE))))


def step_rows(shape: StepShape, prompts: Sequence[int], media: Sequence[PromptMedia]) -> ColumnRows:
    """The rows the rollout role puts for ``prompts``: one per sample, each with its prompt's media."""
    samples = [
        Sample(prompt_ids=[3] * shape.prompt_tokens, response_ids=[5] * shape.response_tokens,
               rollout_log_probs=[-1.0] * shape.response_tokens, weight_version=1, group_id=p, prompt_index=p,
               reward=float(k % 2), raw_reward=float(k % 2), advantage=0.5 - k % 2, media=media[p],
               sample_id=p * shape.samples + k)
        for p in prompts for k in range(shape.samples)
    ]
    rows = samples_to_rows(samples)
    assert isinstance(rows, ColumnRows)  # alike samples are built by column
    return rows


def array_bytes(rows: Sequence[dict[str, Any]]) -> int:
    """The tensor and array bytes of ``rows``: what crosses as payload (scalars ride in the header)."""
    if isinstance(rows, ColumnRows):
        return sum(int(c.data.nbytes) for c in rows.columns.values() if isinstance(c, ArrayColumn))
    return sum(int(v.nbytes) for row in rows for v in row.values() if isinstance(v, (torch.Tensor, np.ndarray)))


# --------------------------------------------------------------------------- server and its memory
def _serve(capacity: int, payload: str, address_out: Any, stop: Event) -> None:
    server = TransferQueueServer("tcp://127.0.0.1:0", secret=SECRET, capacity=capacity,
                                 payload=payload)  # type: ignore[arg-type]
    address_out.send(server.start())
    stop.wait()
    server.stop()


@contextlib.contextmanager
def server_process(capacity: int, payload: str = "curve") -> Iterator[tuple[str, int]]:
    """The queue server in its own process, forked before any row exists (so that its memory
    holds only what it receives); yields its address and pid."""
    receiver, sender = FORK.Pipe(duplex=False)
    stop = FORK.Event()
    proc = FORK.Process(target=_serve, args=(capacity, payload, sender, stop), daemon=True)
    proc.start()
    try:
        yield receiver.recv(), int(proc.pid)  # type: ignore[arg-type]
    finally:
        stop.set()
        proc.join(30)


def _status_bytes(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise SystemExit(f"/proc/{pid}/status has no {key}; this benchmark needs Linux's /proc")


def reset_peak(pid: int) -> None:
    """Start the process's VmHWM afresh at its current RSS (Linux >= 4.0, own processes)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError as exc:
        raise SystemExit(f"cannot reset the server's peak RSS through /proc/{pid}/clear_refs ({exc}); "
                         "run on Linux as the user who started it") from None


class DirPeak:
    """The most memory the files of a directory held, sampled every few ms on a thread: their
    allocated blocks (a segment's size is rounded up to a power of two, and tmpfs holds only the
    pages written)."""

    def __init__(self, path: str | None, every_s: float = 0.005) -> None:
        self.path, self.every_s, self.peak = path, every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        if path is not None:
            self._thread.start()

    def _size(self) -> int:
        total = 0
        assert self.path is not None
        with os.scandir(self.path) as entries:
            for entry in entries:
                with contextlib.suppress(FileNotFoundError):  # a segment freed while we look
                    if entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_blocks * 512  # pages held, not st_size
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._size())
            self._stop.wait(self.every_s)

    def stop(self) -> int:
        if self.path is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self._size())
        return self.peak


# --------------------------------------------------------------------------- one step
def _client(address: str, shm: bool, consumer_id: str = "") -> TransferQueueClient:
    client = TransferQueueClient(address, secret=SECRET, consumer_id=consumer_id, shm=shm,
                                 request_timeout=TIMEOUT_S)
    if shm and client.shm_dir is None:
        raise SystemExit("the server offers no shared-memory directory here (is /dev/shm mounted? RELAX_TQ_SHM=0?); "
                         "run with --paths tcp")
    return client


def _producer(address: str, shm: bool, partition: str, total: int, rows: ColumnRows, start: Barrier,
              cleared: Event, results: Any) -> None:
    client = _client(address, shm)
    start.wait()
    t_first_put = time.perf_counter()
    client.put(partition, rows, timeout=TIMEOUT_S)  # the half of a step in one put, as the rollout role does
    client.complete(partition, total)
    results.put({"role": "producer", "t_first_put": t_first_put, "t_put_done": time.perf_counter(),
                 "bytes": array_bytes(rows)})
    cleared.wait(TIMEOUT_S)  # a producer lives on, and reuses its segments, until the step is cleared
    client.close()


def _consumer(address: str, shm: bool, partition: str, rank: int, micro_batch: int, digests: dict[int, str],
              start: Barrier, results: Any) -> None:
    client = _client(address, shm, consumer_id=f"actor-rank{rank}")
    start.wait()
    rows: list[dict[str, Any]] = []
    indices: list[int] = []
    for batch in client.stream(partition, "actor", (*TRAIN_FIELDS, *MEDIA_FIELDS), micro_batch,
                               timeout=TIMEOUT_S, ack=False):
        rows.extend(batch.rows)
        indices.extend(batch.indices)
    t_last_get = time.perf_counter()
    client.ack(partition, "actor", indices)
    # After the clock stops: the media came through whole (one row; hashing them all costs seconds).
    intact = not rows or media_from_fields(rows[0]).digest == digests[int(rows[0]["group_id"])]  # type: ignore[union-attr]
    results.put({"role": "consumer", "t_last_get": t_last_get, "bytes": array_bytes(rows), "rows": len(rows),
                 "indices": indices, "intact": intact})
    client.close()


@dataclass(frozen=True)
class Run:
    seconds: float
    put_seconds: float  # first put call to the last put's reply: the rows are all on the queue
    put_bytes: int
    got_bytes: int
    rows_got: int
    server_before: int  # RSS when the step starts
    server_peak: int  # VmHWM over the step
    shm_peak: int  # the shm directory's peak size (0 on tcp)

    @property
    def moved(self) -> int:
        return self.put_bytes + self.got_bytes

    @property
    def peak_memory(self) -> int:
        return self.server_peak + self.shm_peak


def run_step(address: str, server_pid: int, shm: bool, shape: StepShape, halves: Sequence[ColumnRows],
             digests: dict[int, str], partition: str) -> Run:
    start, cleared, results = FORK.Barrier(PRODUCERS + CONSUMERS + 1), FORK.Event(), FORK.Queue()
    procs = [FORK.Process(target=_producer, args=(address, shm, partition, shape.rows, half, start, cleared, results))
             for half in halves]
    procs += [FORK.Process(target=_consumer, args=(address, shm, partition, rank, shape.micro_batch, digests,
                                                   start, results)) for rank in range(CONSUMERS)]
    for proc in procs:
        proc.start()
    main = _client(address, shm)
    try:
        reset_peak(server_pid)
        before = _status_bytes(server_pid, "VmRSS")
        shm_dir = DirPeak(main.shm_dir if shm else None)
        start.wait(TIMEOUT_S)  # every client has connected
        reports = [results.get(timeout=TIMEOUT_S) for _ in procs]
        peak, shm_peak = _status_bytes(server_pid, "VmHWM"), shm_dir.stop()
        main.clear(partition)
    finally:
        cleared.set()
        main.close()
        for proc in procs:
            proc.join(TIMEOUT_S)
    if any(proc.exitcode for proc in procs):
        raise SystemExit(f"a producer or consumer process failed (exit codes {[p.exitcode for p in procs]}); see above")
    return _run_of(reports, shape, before, peak, shm_peak)


def _run_of(reports: list[dict[str, Any]], shape: StepShape, before: int, peak: int, shm_peak: int) -> Run:
    producers = [r for r in reports if r["role"] == "producer"]
    consumers = [r for r in reports if r["role"] == "consumer"]
    indices = [i for c in consumers for i in c["indices"]]
    if len(indices) != shape.rows or len(set(indices)) != shape.rows or not all(c["intact"] for c in consumers):
        raise SystemExit(f"the consumers got {len(indices)} rows ({len(set(indices))} distinct) of {shape.rows}, "
                         f"media intact: {[c['intact'] for c in consumers]}; the queue lost or mixed rows")
    t0 = min(p["t_first_put"] for p in producers)
    seconds = max(c["t_last_get"] for c in consumers) - t0
    return Run(seconds, max(p["t_put_done"] for p in producers) - t0, sum(p["bytes"] for p in producers), sum(c["bytes"] for c in consumers),
               len(indices), before, peak, shm_peak)


# --------------------------------------------------------------------------- report
@dataclass(frozen=True)
class Summary:
    path: str
    unique: int
    row_bytes: int
    moved: int
    gbps: float
    server_peak: int
    shm_peak: int
    repeats: int

    @property
    def peak_memory(self) -> int:
        return self.server_peak + self.shm_peak


def summarise(path: str, unique: int, runs: list[Run]) -> Summary:
    moved = {r.moved for r in runs}
    assert len(moved) == 1, moved  # the same rows every run
    return Summary(path, unique, runs[0].put_bytes, runs[0].moved,
                   statistics.median(r.put_bytes / r.seconds / GB for r in runs),
                   int(statistics.median(r.server_peak for r in runs)), int(statistics.median(r.shm_peak for r in runs)),
                   len(runs))


def final_line(s: Summary) -> str:
    return (f"omni step: moved {s.moved / GB:.2f} GB for {s.unique / GB:.2f} GB unique = {s.moved / s.unique:.2f}x; "
            f"server peak memory {s.peak_memory / GB:.2f} GB = {s.peak_memory / s.unique:.2f}x one step's media "
            f"({s.path}; median of {s.repeats})")


def _run_line(path: str, k: int, run: Run) -> str:
    shm = f" + shm files {run.shm_peak / GB:.3f} GB" if path == "shm" else ""
    return (f"  {path} run {k + 1}: {run.seconds:.2f} s, {run.put_bytes / run.seconds / GB:.2f} GB/s (puts done at {run.put_seconds:.2f} s); put "
            f"{run.put_bytes / GB:.3f} GB, got {run.got_bytes / GB:.3f} GB ({run.rows_got} rows); server RSS "
            f"{run.server_before / GB:.3f} GB at the start, peak {run.server_peak / GB:.3f} GB{shm}")


def main(argv: list[str] | None = None) -> dict[str, Summary]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default=str(REPO / "jobspecs" / "qwen3_omni.toml"), help="the step's shape")
    parser.add_argument("--quick", action="store_true",
                        help="4 prompts, 2 s clips of 224x224 frames, 2 repeats (a few seconds)")
    parser.add_argument("--clip-seconds", type=float, default=None, help="video and audio length (default 10, --quick 2)")
    parser.add_argument("--frame-size", type=int, default=None, help="fitted frame side in pixels (default 448, --quick 224)")
    parser.add_argument("--response-tokens", type=int, default=1024, help="response length of every sample")
    parser.add_argument("--repeats", type=int, default=None, help="steps per path (default 3, --quick 2)")
    parser.add_argument("--paths", default="tcp,shm", help="queue paths to measure: tcp, shm or both")
    parser.add_argument("--payload", choices=("encrypt", "authenticate", "curve"), default=None,
                        help="how the tcp path's messages are protected (default: the spec's [security] payload)")
    args = parser.parse_args(argv)
    payload = args.payload or load_spec(Path(args.spec)).security.payload
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not paths or any(p not in ("shm", "tcp") for p in paths):
        parser.error(f"--paths must name tcp and/or shm, got {args.paths!r}")
    shape = step_shape(Path(args.spec), args.clip_seconds or (2.0 if args.quick else 10.0),
                       args.frame_size or (224 if args.quick else 448), 4 if args.quick else None, args.response_tokens)
    repeats = args.repeats or (2 if args.quick else 3)
    torch.set_num_threads(1)
    print(shape.describe(), f"tcp path: payload = {payload!r}", flush=True)
    summaries: dict[str, Summary] = {}
    with server_process(shape.capacity, payload) as (address, server_pid):
        rng = np.random.default_rng(0)
        media = [prompt_media(shape, rng) for _ in range(shape.prompts)]
        digests = {p: m.digest for p, m in enumerate(media)}
        prompts = list(range(shape.prompts))
        halves = [step_rows(shape, prompts[k::PRODUCERS], media) for k in range(PRODUCERS)]
        unique = sum(m.nbytes for m in media)
        print(f"unique media {unique / GB:.3f} GB a step (one copy per prompt); rows put "
              f"{sum(array_bytes(h) for h in halves) / GB:.3f} GB ({shape.samples} copies of the media + tokens)",
              flush=True)
        for k, path in enumerate(paths):
            runs = [run_step(address, server_pid, path == "shm", shape, halves, digests, f"train_{k * 1000 + rep}")
                    for rep in range(repeats)]
            for rep, run in enumerate(runs):
                print(_run_line(path, rep, run), flush=True)
            summaries[path] = summarise(path, unique, runs)
    print(f"load: {' '.join(f'{v:.2f}' for v in os.getloadavg())} on {os.cpu_count()} CPUs; bytes moved counted from "
          "the rows' array bytes put and got (scalars left out)")
    for s in summaries.values():
        print(f"{s.path}: {s.gbps:.2f} GB/s (row bytes / first put to last get, median of {s.repeats}); server RSS "
              f"peak {s.server_peak / GB:.2f} GB" + (f" + shm files {s.shm_peak / GB:.2f} GB" if s.path == "shm" else ""))
    for s in summaries.values():
        print(final_line(s))
    return summaries


if __name__ == "__main__":
    main()
