"""One rule for the garbage collector of a process the runner owns (the CLI's train and serve).

A run's heap is mostly what its imports and its first step leave behind (JAX, the SDKs, torch
where installed, compiled executables): hundreds of thousands of long-lived objects that every
full (generation-2) collection walks again. Measured on the main job against the local server,
such a collection took about 150 ms, seven times per 20+20-step run in the Tinker client -- each
one a pause in which no sampling request goes out, so the server's batcher saw a call's prompts
split in two (benchmarks/wire_overhead.py). `freeze_heap` collects once and moves every live
object to the permanent generation (`gc.freeze`): later collections walk only what was made
after it. Frozen objects are never freed, so only a process that keeps them for its whole life
calls it, once, after its setup -- never a library function on its caller's behalf.
"""

from __future__ import annotations

import gc


def freeze_heap() -> int:
    """Collects garbage, then freezes every live object (`gc.freeze`); the number frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
