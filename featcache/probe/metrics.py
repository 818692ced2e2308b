"""What the probes measure and how they prepare rows: top-k accuracy of ranked
predictions, feature moments, and the scaling of rows built on them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from featcache.errors import ConfigError
from featcache.probe.options import ProbeOptions
from featcache.probe.recipes import recipe

SLICE_ROWS = 8192  # rows Moments converts to float64 at a time


def rank(logits: torch.Tensor) -> torch.Tensor:
    """Int64 ``[..., min(5, C)]``: the highest-scoring classes of logits ``[..., C]``,
    best first."""
    return logits.topk(min(5, logits.shape[-1]), dim=-1).indices


def topk_metrics(
    ranked: torch.Tensor, labels: torch.Tensor, class_names: Sequence[str] | None = None
) -> dict[str, Any]:
    """Accuracy from ranked predictions ``ranked`` int64 ``[N, k]`` (best first) of
    ``labels`` int64 ``[N]``: top-1, top-5 (when ``k >= 5``), per class present (by name
    with ``class_names``) and its mean, and the chance of guessing the most frequent."""
    ranked, labels = ranked.cpu(), labels.cpu()
    hit1 = ranked[:, 0] == labels
    counts = torch.bincount(labels)
    per_class = {}
    for label in torch.nonzero(counts).flatten().tolist():
        name = class_names[label] if class_names and label < len(class_names) else str(label)
        per_class[name] = hit1[labels == label].double().mean().item()
    frequencies = counts.double().sort(descending=True).values / len(labels)
    out: dict[str, Any] = {"n": len(labels), "top1": hit1.double().mean().item()}
    out["chance_top1"] = frequencies[0].item()
    if ranked.shape[1] >= 5:
        out["top5"] = (ranked[:, :5] == labels[:, None]).any(1).double().mean().item()
        out["chance_top5"] = frequencies[:5].sum().item()
    out["mean_per_class"] = float(np.mean(list(per_class.values())))
    out["per_class"] = per_class
    return out


class Moments:
    """Running mean and variance per feature (Chan et al.'s parallel update, float64)."""

    def __init__(self, dim: int):
        self.n = 0
        self.mean = torch.zeros(dim, dtype=torch.float64)
        self.m2 = torch.zeros(dim, dtype=torch.float64)

    def update(self, x: torch.Tensor) -> Moments:
        """Add rows ``x`` ``[B, D]`` (any device and float dtype; read in slices, so a
        large array is never copied whole to float64)."""
        for part in x.split(SLICE_ROWS):
            part = part.to("cpu", torch.float64)
            mean = part.mean(0)
            self._add(len(part), mean, ((part - mean) ** 2).sum(0))
        return self

    def merge(self, other: Moments) -> Moments:
        """Add the rows another :class:`Moments` has seen, in place."""
        self._add(other.n, other.mean, other.m2)
        return self

    def _add(self, n: int, mean: torch.Tensor, m2: torch.Tensor) -> None:
        if n:
            total = self.n + n
            delta = mean - self.mean
            self.mean = self.mean + delta * (n / total)
            self.m2 = self.m2 + m2 + delta**2 * (self.n * n / total)
            self.n = total

    def standardizer(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 ``(mean, std)`` ``[D]`` on ``device``; constant features get std 1.

        Raises:
            ConfigError: the rows held NaN or Inf (a store written with
                ``store.on_nonfinite: keep``), which no probe can fit."""
        require_finite(torch.stack([self.mean, self.m2]), "the features")
        n = max(self.n, 1)
        variance = self.m2 / n
        # A variance within float64 rounding of zero, for n rows of this mean, is a
        # constant feature; a threshold on the std alone would also flatten features that
        # are merely small (gradients, say), and leave the probe at chance.
        eps = torch.finfo(torch.float64).eps
        constant = variance <= n * eps * variance + (n * eps * self.mean) ** 2
        std = torch.where(constant, torch.ones_like(variance), variance.sqrt())
        return self.mean.float().to(device), std.float().to(device)


def require_finite(x: torch.Tensor, where: str) -> None:
    """Refuse rows ``x`` that hold NaN or Inf; ``where`` leads the error ("the features")."""
    if not bool(torch.isfinite(x).all()):
        raise ConfigError(
            f"{where} hold NaN or Inf values (the store was written with store.on_nonfinite: "
            "keep); re-extract with on_nonfinite: skip, or in float32 if float16 overflowed"
        )


@dataclasses.dataclass(frozen=True)
class Scaling:
    """The preparation of rows ``[N, D]``: each row scaled to unit L2 norm (``l2``, first),
    then each dimension standardised with the fitted rows' mean and standard deviation
    (``standardize``)."""

    l2: bool
    standardize: bool

    @classmethod
    def named(cls, name: str) -> Scaling:
        """``"standardize"``, ``"l2"``, ``"l2+standardize"`` or ``"none"``."""
        steps = set(name.split("+")) - {"none"}
        return cls(l2="l2" in steps, standardize="standardize" in steps)

    @property
    def name(self) -> str:
        steps = [step for step, on in (("l2", self.l2), ("standardize", self.standardize)) if on]
        return "+".join(steps) or "none"

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """Rows ``[N, D]`` with the per-row step applied (float32; a zero row stays zero)."""
        return F.normalize(x, dim=1) if self.l2 else x

    def standardizer(
        self, moments: Moments, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 ``(mean, std)`` ``[D]`` of the fitted rows' ``moments`` (zeros and ones
        when this scaling does not standardise); NaN or Inf is refused either way."""
        mean, std = moments.standardizer(device)
        if not self.standardize:
            return torch.zeros_like(mean), torch.ones_like(std)
        return mean, std


def scaling_for(method: str, options: ProbeOptions) -> Scaling:
    """The scaling ``method`` uses: ``options.normalize``, else the method's default (k-NN:
    ``l2``; linear: the recipe's, or ``standardize``)."""
    if options.normalize is not None:
        return Scaling.named(options.normalize)
    if method == "knn":
        return Scaling.named("l2")
    published = recipe(options.recipe)
    return Scaling.named(published.normalize if published else "standardize")
