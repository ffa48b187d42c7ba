"""Keep Python's cyclic garbage collector off the long-lived heap of a long-running process.

A role or the driver imports torch, transformers and Ray: about 400,000 objects that live as
long as the process. Python's full (generation 2) collection walks all of them whenever enough
objects survived into the old generation, which a training loop's per-step garbage makes
happen every few seconds. Measured on the tiny task (2 cores): a 250 ms pause about every 45
steps in the driver, which also hosts the transfer-queue server, so every role stalled with it;
that was 16% of the run. `settle_heap()` collects once, then freezes what is alive
(`gc.freeze`): later collections skip those objects. Reference counting still frees them;
only cycles among them, which a settled heap should not form, would stay.
"""

from __future__ import annotations

import gc

_settled = False


def settle_heap() -> bool:
    """Collect, then exempt every object alive now from later collections; once per process.

    Call it once start-up is over (after the first step, when lazy imports have happened).
    Returns True when this call did it.
    """
    global _settled
    if _settled:
        return False
    _settled = True
    gc.collect()
    gc.freeze()
    return True
