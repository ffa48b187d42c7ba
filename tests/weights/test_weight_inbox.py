"""The receiving side's bookkeeping, in process: which version a step needs, the inbox that keeps
a broadcast apart until it is complete, and the in-process sync's handle."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from relax_hpc.weights.base import InProcessWeightSync, required_weight_version
from relax_hpc.weights.endpoints import WeightInbox
from relax_hpc.weights.flat import FlatWeights


@pytest.mark.parametrize("step, start_step, start_version, max_staleness, expected", [
    (0, 0, 0, 0, 0),  # the first step runs the initial weights
    (3, 0, 0, 0, 3),  # on-policy: trained on steps 0, 1, 2
    (3, 0, 0, 1, 2),  # one step ahead: 3 - 1 - 0 = 2
    (1, 0, 0, 1, 0),  # max(0, 1 - 1 - 0) = 0: generated while step 0 trains
    (5, 5, 9, 0, 9),  # resumed at step 5 with version 9: the restored weights
    (7, 5, 9, 1, 10),  # 9 + max(0, 7 - 1 - 5) = 10
    (6, 5, 9, 2, 9),  # 9 + max(0, 6 - 2 - 5) = 9
])
def test_required_weight_version(step: int, start_step: int, start_version: int, max_staleness: int,
                                 expected: int) -> None:
    assert required_weight_version(step, start_step, start_version, max_staleness) == expected


def _take(inbox: WeightInbox) -> tuple[dict[str, torch.Tensor], int] | None:
    """Install the newest complete update into an engine that copies; what it got, or None."""
    got: list[tuple[dict[str, torch.Tensor], int]] = []
    inbox.install(lambda flat, version: False, lambda named, version: got.append((dict(named), version)))
    return got[0] if got else None


def test_staged_buckets_are_invisible_until_the_commit() -> None:
    inbox = WeightInbox()
    buffer = torch.ones(3)
    inbox.stage([("a", buffer)])
    buffer.fill_(7.0)  # a channel reuses its bucket buffer: the staged copy must not change
    assert _take(inbox) is None
    inbox.stage([("b", torch.zeros(2))])
    inbox.commit(4)
    update = _take(inbox)
    assert update is not None
    weights, version = update
    assert version == 4 and sorted(weights) == ["a", "b"]
    assert torch.equal(weights["a"], torch.ones(3))
    assert _take(inbox) is None  # handed out once


def test_complete_updates_not_yet_taken_merge_and_the_newer_wins() -> None:
    inbox = WeightInbox()
    inbox.stage([("a", torch.tensor([1.0])), ("b", torch.tensor([1.0]))])
    inbox.commit(1)
    inbox.stage([("a", torch.tensor([2.0]))])
    inbox.commit(2)
    update = _take(inbox)
    assert update is not None
    weights, version = update
    assert version == 2 and weights["a"].item() == 2.0 and weights["b"].item() == 1.0


def _waiter(inbox: WeightInbox, version: int, current: int, stop: threading.Event,
            timeout_s: float = 60.0) -> tuple[threading.Thread, list[Any]]:
    outcome: list[Any] = []

    def run() -> None:  # what a producer does at its batch boundary: wait, then take the update
        try:
            outcome.append(inbox.wait_for(version, current, stop, timeout_s, "rollout"))
            update = _take(inbox)
            outcome.append(None if update is None else update[1])
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def _until_awaiting(inbox: WeightInbox, version: int) -> None:
    for _ in range(6000):
        if inbox.awaited == version:
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"the waiter never started waiting for version {version}")


def test_wait_returns_only_after_a_complete_update_of_the_needed_version() -> None:
    inbox, stop = WeightInbox(), threading.Event()
    assert inbox.wait_for(3, current=3, stop=stop, timeout_s=0.0, who="rollout")  # the engine has it
    thread, outcome = _waiter(inbox, 2, current=0, stop=stop)
    _until_awaiting(inbox, 2)
    inbox.stage([("a", torch.zeros(1))])
    inbox.commit(1)  # complete, but too old for the waiter
    assert inbox.awaited == 2 and outcome == []
    inbox.stage([("a", torch.ones(1))])
    assert inbox.awaited == 2 and outcome == []  # staged only
    inbox.commit(2)
    thread.join(timeout=60)
    # The waiter took version 2: had it returned on the commit of version 1 (too old) or on the
    # staged bucket, it would have taken version 1 or nothing.
    assert outcome == [True, 2] and inbox.awaited is None


def test_wait_stops_when_asked_and_reports_a_failed_broadcast() -> None:
    inbox, stop = WeightInbox(), threading.Event()
    thread, outcome = _waiter(inbox, 1, current=0, stop=stop)
    _until_awaiting(inbox, 1)
    stop.set()
    thread.join(timeout=60)
    assert outcome == [False, None]

    thread, outcome = _waiter(inbox, 1, current=0, stop=threading.Event())
    _until_awaiting(inbox, 1)
    inbox.stage([("a", torch.ones(1))])
    inbox.fail("WeightChannelError: rank 0 died")
    thread.join(timeout=60)
    assert isinstance(outcome[0], RuntimeError)
    assert "rollout needs weight version 1 (engine has 0)" in str(outcome[0])
    assert "rank 0 died" in str(outcome[0])
    inbox.commit(1)  # the half-received update was dropped: only what was staged since counts
    update = _take(inbox)
    assert update is not None and update[0] == {}


def test_wait_times_out_naming_the_version() -> None:
    with pytest.raises(TimeoutError, match=r"rollout waited 0.01 s for weight version 5 \(engine has 3"):
        WeightInbox().wait_for(5, current=3, stop=threading.Event(), timeout_s=0.01, who="rollout")


class Receiver:
    def __init__(self) -> None:
        self.updates: list[tuple[list[str], int]] = []

    def update_weights(self, named: Any, version: int) -> None:
        self.updates.append(([n for n, _ in named], version))


class Trainer:
    def export_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [("w", torch.ones(2))]


def test_in_process_sync_delivers_at_start_and_returns_a_finished_handle() -> None:
    receivers = [Receiver(), Receiver()]
    sync = InProcessWeightSync(Trainer(), receivers)
    pending = sync.start(3)
    assert [r.updates for r in receivers] == [[(["w"], 3)], [(["w"], 3)]]
    pending.wait()
    assert pending.version == 3
    sync.sync(4)
    assert receivers[0].updates[-1] == (["w"], 4)


# --------------------------------------------------------------------------- flat buffers
class FakeReceiver:
    """Stands in for a channel receiver: fills the buffer it is given (or a new one) with `value`."""

    def __init__(self) -> None:
        self.given: list[FlatWeights | None] = []
        self.filled: list[FlatWeights] = []

    def receive_into(self, into: FlatWeights | None) -> tuple[FlatWeights, int]:
        self.given.append(into)
        flat = into if into is not None else FlatWeights.snapshot([("w", torch.zeros(2))], 1 << 20, 1 << 20)
        flat.buffer.view(torch.float32).fill_(float(len(self.given)))
        self.filled.append(flat)
        return flat, len(self.given)


class Engine:
    def __init__(self, can_bind: bool = True) -> None:
        self.can_bind, self.bound, self.copied = can_bind, None, []

    def bind(self, flat: FlatWeights, version: int) -> bool:
        if self.can_bind:
            self.bound = flat
        return self.can_bind

    def copy(self, named: Any, version: int) -> None:
        self.copied.append(({n: t.clone() for n, t in named}, version))


def _receive(inbox: WeightInbox, receiver: FakeReceiver) -> int:
    version = inbox.receive(receiver)
    inbox.commit(version)
    return version


def test_flat_updates_are_bound_and_two_buffers_trade_places() -> None:
    inbox, receiver, engine = WeightInbox(), FakeReceiver(), Engine()
    assert inbox.install(engine.bind, engine.copy) is None  # nothing arrived yet
    _receive(inbox, receiver)
    assert inbox.install(engine.bind, engine.copy) == 1
    first = engine.bound
    _receive(inbox, receiver)  # the engine runs on `first`: this one needs a second buffer
    assert receiver.given[-1] is None
    assert inbox.install(engine.bind, engine.copy) == 2
    second = engine.bound
    assert second is not first and first is not None
    _receive(inbox, receiver)  # the buffer the engine left is the spare now
    assert receiver.given[-1] is first and engine.bound is second
    assert float(second.buffer.view(torch.float32)[0]) == 2.0  # untouched while bound
    assert inbox.install(engine.bind, engine.copy) == 3 and engine.bound is first
    assert engine.copied == []


def test_an_update_not_yet_installed_lends_its_buffer_to_the_next_receive() -> None:
    inbox, receiver, engine = WeightInbox(), FakeReceiver(), Engine()
    _receive(inbox, receiver)
    inbox.install(engine.bind, engine.copy)
    _receive(inbox, receiver)  # version 2 waits, never installed ...
    _receive(inbox, receiver)  # ... so version 3 is received into its buffer
    assert receiver.given[-1] is receiver.filled[1]
    assert inbox.install(engine.bind, engine.copy) == 3
    assert float(engine.bound.buffer.view(torch.float32)[0]) == 3.0


def test_an_engine_that_cannot_bind_gets_a_copy_from_a_buffer_kept_until_the_next_install() -> None:
    # An SGLang engine keeps the tensors it was given (to push them again to a restarted server)
    # instead of a host copy of its own: they must not change while the next version arrives.
    inbox, receiver, engine = WeightInbox(), FakeReceiver(), Engine(can_bind=False)
    _receive(inbox, receiver)
    assert inbox.install(engine.bind, engine.copy) == 1
    assert engine.bound is None and torch.equal(engine.copied[0][0]["w"], torch.ones(2))
    installed = receiver.filled[0]
    _receive(inbox, receiver)
    assert receiver.given[-1] is None  # not into the buffer the engine was given
    assert torch.equal(dict(installed.named())["w"], torch.ones(2))
    inbox.install(engine.bind, engine.copy)
    assert [v for _, v in engine.copied] == [1, 2] and torch.equal(engine.copied[1][0]["w"], torch.full((2,), 2.0))
    _receive(inbox, receiver)  # version 2 installed: version 1's buffer is the spare now
    assert receiver.given[-1] is installed and len({id(f) for f in receiver.filled}) == 2


def test_a_failed_flat_receive_is_dropped_and_reported() -> None:
    inbox, stop = WeightInbox(), threading.Event()
    receiver = FakeReceiver()
    inbox.receive(receiver)  # the bytes arrived but the broadcast failed before the commit
    inbox.fail("WeightChannelError: done message out of step")
    with pytest.raises(RuntimeError, match="out of step"):
        inbox.wait_for(1, current=0, stop=stop, timeout_s=1.0, who="rollout")
    engine = Engine()
    assert inbox.install(engine.bind, engine.copy) is None and engine.bound is None


def test_released_buffers_are_dropped_but_a_waiting_update_is_kept() -> None:
    inbox, receiver, engine = WeightInbox(), FakeReceiver(), Engine()
    _receive(inbox, receiver)
    inbox.install(engine.bind, engine.copy)  # bound to buffer 1
    _receive(inbox, receiver)
    inbox.install(engine.bind, engine.copy)  # bound to buffer 2; buffer 1 is the spare
    spare = receiver.filled[0].buffer.numel()  # bytes, alignment included
    assert inbox.release_buffers() == spare > 0  # the spare only (the engine counts its own)
    _receive(inbox, receiver)  # the next receive allocates anew: nothing kept to lend
    assert receiver.given[-1] is None
    assert inbox.release_buffers() == 0  # nothing spare; the complete update 3 stays
    assert inbox.install(engine.bind, engine.copy) == 3
