"""How rows are prepared for a probe: L2 normalisation per row, standardisation per dimension."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from featcache.probe.metrics import Moments
from featcache.probe.options import ProbeOptions
from featcache.probe.recipes import recipe


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
        """Float32 ``(mean, std)`` ``[D]`` that rows are standardised with: the fitted
        rows' (``moments``), or zeros and ones when this scaling does not standardise.
        NaN or Inf in the rows is refused either way."""
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


STANDARDIZE = Scaling(l2=False, standardize=True)  # featcache's own protocol
