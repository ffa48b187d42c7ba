from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from relax_hpc.models.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=1)
