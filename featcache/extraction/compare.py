"""When a recomputed row equals a stored one: the one tolerance of featcache.

Rows recomputed on other hardware, in another batch or under autocast differ in their
last bits; features of other data differ by tens of percent. So rows are equal when
their largest difference, relative to the row's largest stored magnitude, is a few
units in the last place of the stored (or coarser autocast) dtype. The continuity
check, an update's proof and ``verify`` all compare this way.
"""

from __future__ import annotations

import numpy as np
import torch

# The largest difference allowed, relative to the row's largest magnitude, by dtype: for
# int8 codes (one step is 1/127 of the row's largest), two steps.
TOLERANCE = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2, "int8": 2 / 127}


def tolerance_of(store_dtype: str, amp: torch.dtype | None = None) -> tuple[float, str]:
    """The tolerance of a recomputation, and the dtype that sets it: the store dtype's,
    or the autocast dtype's where that is coarser."""
    names = [store_dtype] if amp is None else [store_dtype, str(amp).removeprefix("torch.")]
    dtype = max(names, key=TOLERANCE.__getitem__)  # the store dtype's on a tie
    return TOLERANCE[dtype], dtype


def relative_differences(recomputed: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """Each row's largest difference over its largest stored magnitude: float32 ``[n]``
    from rows ``[n, ...]``. Non-finite values count as equal where both sides hold the
    same one (NaN in both); where they differ the row's difference is infinite."""
    new, old = recomputed.float().flatten(1), stored.float().flatten(1)
    finite = torch.isfinite(new) & torch.isfinite(old)
    same_nonfinite = (new == old) | (new.isnan() & old.isnan())
    differ = (~(finite | same_nonfinite)).any(dim=1)
    new, old = new.where(finite, 0.0), old.where(finite, 0.0)
    scale = old.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny)
    relative = (new - old).abs().amax(dim=1) / scale
    return relative.masked_fill(differ, float("inf"))


def token_differences(
    recomputed: torch.Tensor,
    lengths: np.ndarray,
    stored: torch.Tensor,
    offsets: np.ndarray,
) -> tuple[torch.Tensor, list[str]]:
    """Per-token rows, each row's tokens compared as one flat row: ``recomputed`` packed
    (``lengths`` each), ``stored`` by ``offsets`` (``[n + 1]``). Returns float32 ``[n]``
    relative differences and a note per row where its token count differs, else ""."""
    new_offsets = np.concatenate([[0], np.cumsum(lengths)])
    relative = torch.zeros(len(lengths))
    notes = []
    for row in range(len(lengths)):
        new = recomputed[new_offsets[row] : new_offsets[row + 1]]
        old = stored[offsets[row] : offsets[row + 1]]
        if len(new) != len(old):
            notes.append(f"{len(new)} tokens vs {len(old)} stored")
            relative[row] = float("inf")
            continue
        notes.append("")
        relative[row] = relative_differences(new.reshape(1, -1), old.reshape(1, -1))[0]
    return relative, notes


def first_over(relative: torch.Tensor, tolerance: float) -> int | None:
    """The first row whose difference is beyond ``tolerance`` (NaN is), None if none is."""
    over = (~(relative <= tolerance)).nonzero()
    return int(over[0, 0]) if len(over) else None
