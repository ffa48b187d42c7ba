"""Import user code named by a "package.module:Name" path from the job spec."""

from __future__ import annotations

import importlib
from typing import Any


def load_dotted(key: str, path: str) -> Any:
    """The object `path` ("package.module:Name") names; ValueError naming the spec key if not.

    `key` is the spec key the path came from (e.g. "[rollout] env"), so the message says which
    setting to fix.
    """
    module_name, colon, attr = path.partition(":")
    if not colon or not module_name or not attr:
        raise ValueError(f'{key} = "{path}": must be "package.module:Name" (a module, a colon, a name)')
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f'{key} = "{path}": cannot import module \'{module_name}\' ({e}); is it installed or on '
            "PYTHONPATH?"
        ) from e
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f'{key} = "{path}": module \'{module_name}\' has no attribute \'{attr}\'')
        target = getattr(target, part)
    return target
