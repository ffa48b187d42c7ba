"""Keep Python's cyclic garbage collector off the long-lived heap of a long-running process.

A role or the driver imports torch, transformers and Ray: about 400,000 objects that live as
long as the process. Python's full (generation 2) collection walks all of them whenever enough
objects survived into the old generation, which a training loop's per-step garbage makes
happen every few seconds. Measured on the tiny task (2 cores): a 250 ms pause about every 45
steps in the driver, which also hosts the transfer-queue server, so every role stalled with it;
that was 16% of the run. `settle_heap()` collects once, then freezes what is alive
(`gc.freeze`): later collections skip those objects. Reference counting still frees them;
only cycles among them, which a settled heap should not form, would stay.

It also spaces the collections out (`gc.set_threshold`). Python collects its youngest
generation every 700 new container objects, and every tenth of those collections the next one,
which holds what is still alive: a step's responses, samples and rows. At 256 simulated
engines the rollout process makes hundreds of thousands of such objects a step, and collecting
them again and again held it back: 0.83 of the ideal throughput with Python's defaults, 0.91
with these (docs/benchmarks.md, "Fleet simulation"). A young collection every 100,000 new
objects takes a few milliseconds; cycles are still freed, a few steps later at most.
"""

from __future__ import annotations

import gc

_settled = False
# Young collection every YOUNG new container objects; the middle generation every MIDDLE young
# collections, the old one every OLD middle ones (Python's defaults: 700, 10, 10).
YOUNG, MIDDLE, OLD = 100_000, 50, 100


def settle_heap() -> bool:
    """Collect, then exempt every object alive now from later collections, and space the
    collections out (YOUNG, MIDDLE, OLD); once per process.

    Call it once start-up is over (after the first step, when lazy imports have happened).
    Returns True when this call did it.
    """
    global _settled
    if _settled:
        return False
    _settled = True
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG, MIDDLE, OLD)
    return True
