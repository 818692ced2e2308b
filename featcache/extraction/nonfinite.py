"""The non-finite policy: rows holding NaN or Inf fail the run, are skipped, or are kept."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from featcache.config.spec import StoreSpec
from featcache.errors import FeatcacheError
from featcache.store import codec


def skip_record(row: int, sample_id: str, reason: str) -> dict[str, Any]:
    return {"index": int(row), "id": str(sample_id), "reason": reason}


def check_finite(
    captured: Mapping[str, torch.Tensor],
    index: torch.Tensor,
    ids: Sequence[str],
    store: StoreSpec,
    skipped: list[dict[str, Any]],
    lengths: torch.Tensor | None = None,
    ragged: frozenset[str] = frozenset(),
) -> torch.Tensor | None:
    """Apply ``store.on_nonfinite``; returns a ``[B]`` bool row mask when rows must be
    dropped. The layers in ``ragged`` are per-token rows ``[sum(lengths), ...]``."""
    if store.on_nonfinite == "keep":
        return None
    bad_by_layer = {}
    for key, value in captured.items():
        bad = nonfinite_rows(codec.values(value, store.dtype))
        if key in ragged and lengths is not None:
            owner = torch.repeat_interleave(torch.arange(len(index)), lengths.cpu())
            bad = torch.zeros(len(index), dtype=torch.long).index_add_(0, owner, bad.long()) > 0
        bad_by_layer[key] = bad
    bad_rows = torch.stack(list(bad_by_layer.values())).any(dim=0)
    if not bad_rows.any():
        return None
    first = int(bad_rows.nonzero()[0])
    layers = [key for key, bad in bad_by_layer.items() if bad[first]]
    if store.on_nonfinite == "fail":
        hint = " (float16 overflows above 65504: bfloat16 or float32 may fit)"
        raise FeatcacheError(
            f"non-finite values (NaN or Inf) in layer {layers[0]} for sample "
            f"{ids[int(index[first])]}{hint if store.dtype == 'float16' else ''}; set "
            "store.on_nonfinite=skip to leave such rows out or keep to store them"
        )
    for j in bad_rows.nonzero().flatten().tolist():
        names = ", ".join(key for key, bad in bad_by_layer.items() if bad[j])
        row = int(index[j])
        skipped.append(skip_record(row, ids[row], f"non-finite values in layer {names}"))
    return ~bad_rows


# An IEEE float is NaN or infinite exactly when its exponent bits are all ones: its bits as
# a signed integer are then at least +Inf's (positive floats), or as an unsigned integer at
# least -Inf's (negative ones). Two max reductions per row over the integer views find such
# rows without a temporary array, many times faster than isfinite on the CPU
# (scripts/bench_write.py). Off the CPU one masked reduction runs on the device.
_INF_BITS = {  # the integer dtype of the bits, the sign-cleared mask, +Inf and -Inf
    torch.float16: (torch.int16, 0x7FFF, 0x7C00, 0xFC00),
    torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80, 0xFF80),
    torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000, 0xFF800000),
    torch.float64: (torch.int64, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000, 0xFFF0000000000000),
}


def nonfinite_rows(value: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool on the CPU: rows of ``value`` ``[B, ...]`` holding a NaN or an Inf."""
    flat = value.flatten(1)
    if flat.shape[1] == 0:
        return torch.zeros(len(flat), dtype=torch.bool)
    if flat.dtype not in _INF_BITS:
        return (~torch.isfinite(flat).all(dim=1)).cpu()
    integer, magnitude, inf, minus_inf = _INF_BITS[flat.dtype]
    bits = flat.view(integer)
    if bits.device.type != "cpu":
        return ((bits & magnitude).amax(dim=1) >= inf).cpu()
    signed = bits.numpy()
    unsigned = signed.view(f"u{signed.itemsize}")  # the same bits, unsigned
    return torch.from_numpy((signed.max(axis=1) >= inf) | (unsigned.max(axis=1) >= minus_inf))
