"""One batch of pooled rows as float32: float16 against int8, and int8's multiply in torch
against numpy, timed alone.

A batch of ``--batch`` rows of ``--dim`` values is gathered at random positions from
``--rows`` stored rows (numpy's ``take``, as ``FeatureDataset.batches`` gathers) and made
float32: float16 by a cast; int8 by featcache's ``codec.dequantize`` of the codes and
their per-row scales; and, for comparison, the multiply alone in torch and in numpy
(``np.multiply(codes, scales[:, None], dtype=np.float32)``). Printed: microseconds per
call, the best of ``--repeats`` timings of ``--number`` calls, on one torch thread (as in
a DataLoader worker).

    python scripts/bench_dequantize.py [--rows 10000] [--dim 64] [--batch 256]
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable

import numpy as np
import torch

from featcache.store import codec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--number", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    values = rng.standard_normal((args.rows, args.dim), dtype=np.float32)
    halves = values.astype(np.float16)
    codes, scales = (t.numpy() for t in codec.quantize(torch.from_numpy(values)))
    position = rng.permutation(args.rows)[: args.batch]
    picked_codes = torch.from_numpy(codes.take(position, axis=0))
    picked_scales = torch.from_numpy(scales.take(position))

    cases: dict[str, Callable[[], object]] = {
        "float16: gather + cast": lambda: torch.from_numpy(halves.take(position, axis=0)).float(),
        "int8: gather codes and scales + dequantize": lambda: codec.dequantize(
            torch.from_numpy(codes.take(position, axis=0)),
            torch.from_numpy(scales.take(position)),
        ),
        "int8 multiply alone, torch": lambda: picked_codes * picked_scales.view(-1, 1),
        "int8 multiply alone, numpy": lambda: np.multiply(
            picked_codes.numpy(), picked_scales.numpy()[:, None], dtype=np.float32
        ),
    }
    print(f"{args.batch} rows x {args.dim} values of {args.rows}; us per call, best of "
          f"{args.repeats} x {args.number}")  # fmt: skip
    for name, run in cases.items():
        best = min(timeit.repeat(run, number=args.number, repeat=args.repeats)) / args.number
        print(f"{name:<46} {best * 1e6:8.2f}")


if __name__ == "__main__":
    main()
