"""Fixtures that run the transfer-queue contract against every implementation."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from transfer_harness import QueueHarness


@pytest.fixture(params=["memory", "zmq", "zmq-shm", "zmq-encrypt", "zmq-authenticate"])
def harness(request: pytest.FixtureRequest) -> Iterator[QueueHarness]:
    h = QueueHarness(request.param)
    yield h
    h.close()
