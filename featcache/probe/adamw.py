"""Mini-batch AdamW probes on rows in memory, trained the way CLIP_benchmark trains them."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def fit_adamw(
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    decays: Sequence[float],
    *,
    lr: float,
    epochs: int,
    batch_size: int,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One linear probe per weight decay in ``decays``, trained side by side.

    Each model starts from the same seeded ``nn.Linear`` initialisation (uniform within
    ``1 / sqrt(D)``) and is trained with AdamW (decoupled weight decay on weight and
    bias, as ``model.parameters()`` gets it) on the cross-entropy, for ``epochs`` passes
    over seeded shuffled batches of ``batch_size`` rows, the learning rate decayed from
    ``lr`` to zero along a cosine without warm-up. The models see the same batches and
    do not interact: their losses are summed, and each has its own parameter group.

    ``x``: float32 ``[N, D]``, ``y``: int64 ``[N]``, on one device. Returns float32
    weights ``[K, C, D]`` and biases ``[K, C]``.
    """
    generator = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(x.shape[1])
    weight = (torch.rand(num_classes, x.shape[1], generator=generator) * 2 - 1) * bound
    bias = (torch.rand(num_classes, generator=generator) * 2 - 1) * bound
    params = [
        (weight.clone().to(x.device).requires_grad_(), bias.clone().to(x.device).requires_grad_())
        for _ in decays
    ]
    optimizer = torch.optim.AdamW(
        [
            {"params": list(pair), "weight_decay": decay}
            for pair, decay in zip(params, decays, strict=True)
        ],
        lr=lr,
    )
    per_epoch = math.ceil(len(x) / batch_size)
    steps = epochs * per_epoch
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda t: 0.5 * (1 + math.cos(math.pi * min(t, steps) / steps))
    )
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator).to(x.device)
        for rows in order.split(batch_size):
            xb, yb = x[rows], y[rows]
            loss = sum(F.cross_entropy(F.linear(xb, w, b), yb) for w, b in params)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[union-attr]
            optimizer.step()
            schedule.step()
    weights = torch.stack([w.detach() for w, _ in params])
    biases = torch.stack([b.detach() for _, b in params])
    return weights, biases
