"""``data.limit``: a trial run's rows, spread evenly over the source.

Sources list rows in a stable order (a class folder class by class), so evenly spaced
rows hold every class in proportion, where the first ``N`` would hold the first only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from featcache.sources.base import SourceDataset
from featcache.util.fingerprints import lines_sha256


def limit_source(source: SourceDataset, limit: int) -> SourceDataset:
    """``source`` limited to ``limit`` rows evenly spaced from its first to its last
    (itself when no longer)."""
    if limit >= len(source):
        return source
    # spacing (len - 1) / (limit - 1) >= 1, so rounding never repeats a position
    positions = np.linspace(0, len(source) - 1, limit).round()
    return SpreadRows(source, [int(p) for p in positions])


class SpreadRows(SourceDataset):
    """The rows of ``base`` at ``positions``: row ``i`` is ``base[positions[i]]``, with
    that row's id, label and per-row columns."""

    def __init__(self, base: SourceDataset, positions: list[int]) -> None:
        super().__init__(
            [base.ids[p] for p in positions], base.class_names, base.has_labels, base.transform
        )
        self.base = base
        self.positions = positions

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return self.base[self.positions[self.position(index)]]  # the base transforms it

    def prefetch(self, rows: list[int]) -> None:
        self.base.prefetch([self.positions[r] for r in rows])

    def fingerprint(self, content: bool = False) -> str:
        """sha256 of the base source's fingerprint and the positions taken."""
        taken = ",".join(map(str, self.positions))
        return lines_sha256([self.base.fingerprint(content), f"rows\t{taken}"])

    def change_stamps(self) -> list[str] | None:
        """The chosen rows' change stamps (None when the base tells none)."""
        return self._rows_of(self.base.change_stamps())

    @property
    def labels(self) -> Any:
        """The chosen rows' labels (None when the base lists none)."""
        return self._rows_of(getattr(self.base, "labels", None))

    @property
    def row_columns(self) -> dict[str, np.ndarray]:
        """The base's per-row columns at the chosen rows."""
        columns = getattr(self.base, "row_columns", None) or {}
        return {name: np.asarray(column)[self.positions] for name, column in columns.items()}

    @property
    def token_lengths(self) -> np.ndarray | None:
        """The chosen rows' token counts (None when the base declares none)."""
        return self._rows_of(getattr(self.base, "token_lengths", None))

    @property
    def pad_values(self) -> dict[str, Any]:
        """What the loader pads each input with: the base's."""
        try:
            return self.base.pad_values  # type: ignore[attr-defined]
        except AttributeError:
            raise AttributeError("pad_values") from None

    @property
    def remote(self) -> Any:
        """The base's remote reader, if any (its retries are this run's)."""
        return getattr(self.base, "remote", None)

    def _rows_of(self, values: Any) -> Any:
        if values is None:
            return None
        if isinstance(values, np.ndarray):
            return values[self.positions]
        return [values[p] for p in self.positions]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} of {self.base!r})"
