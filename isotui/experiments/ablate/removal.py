"""What ``--remove`` names, and the edit each removal makes at a site (one convention, used by
the run and its tests): estimated from a site's first-pass sums, applied at every position.

- ``mean``: subtract the site's corpus mean;
- ``pc:K``: project out the top K principal directions of the site's covariance, x - V V^T x;
- ``rogue:K``: set the K dimensions that contribute most to avg_cos (Timkey & van Schijndel 2021:
  dimension i's share ((sum u_i)^2 - sum u_i^2) / (n (n - 1)) of the unit vectors u) to their
  corpus mean;
- ``dims:I,J,...``: set the named coordinates to their corpus mean.

The random baseline of each: a vector of the mean's norm along a random direction, K random
orthonormal directions, or as many random coordinates, seeded by (seed, site, removal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from isotui.errors import IsotuiError

if TYPE_CHECKING:
    import torch

KINDS = ("mean", "pc", "rogue", "dims")
MAX_K = 4096  # directions or coordinates one removal names (checked before any work)
# rows (sites x removals) one request measures: each batch runs 1 + 2 x rows forwards, and each
# run keeps every hidden state's sums (checked before any work)
MAX_ROWS = 1024
FORM = "mean, pc:K, rogue:K or dims:I,J,... (K and the count of dims at most 4,096)"

Vector = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Removal:
    """One ``--remove`` value: its ``kind``, ``k`` (pc and rogue) or ``dims`` (dims)."""

    kind: str
    k: int = 0
    dims: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        if self.kind == "mean":
            return "mean"
        if self.kind == "dims":
            return "dims:" + ",".join(map(str, self.dims))
        return f"{self.kind}:{self.k}"


def parse_removal(text: str) -> Removal:
    """``text`` as a :class:`Removal`, or one sentence naming ``--remove``."""
    kind, _, arg = text.strip().partition(":")
    bad = f"remove {text!r} is not one of {FORM}"
    if kind not in KINDS or (kind == "mean") != (not arg):
        raise IsotuiError(bad)
    if kind == "mean":
        return Removal("mean")
    try:
        values = [int(v) for v in arg.split(",")]
    except ValueError:
        raise IsotuiError(bad) from None
    if kind == "dims":
        if not values or min(values) < 0 or len(values) > MAX_K or len(set(values)) != len(values):
            raise IsotuiError(f"{bad}: dims are distinct coordinates from 0")
        return Removal("dims", dims=tuple(values))
    if len(values) != 1 or not 1 <= values[0] <= MAX_K:
        raise IsotuiError(f"{bad}: K is a whole number from 1 to {MAX_K:,}")
    return Removal(kind, k=values[0])


def check_rows(sites: int, removals: int) -> None:
    """Refuse more (site, removal) rows than :data:`MAX_ROWS` (``removals`` alone: their count)."""
    if sites * removals > MAX_ROWS:
        said = f"{sites} sites x {removals} removals" if sites > 1 else f"{removals} removals"
        raise IsotuiError(
            f"remove and --modules ask {said} = {sites * removals:,} rows, each two more forward passes "
            f"of every batch; at most {MAX_ROWS:,} at once: name fewer sites or removals"
        )


def check_width(removal: Removal, dim: int, site: str) -> None:
    """Refuse a removal that names more directions or coordinates than ``site`` has (``dim``)."""
    if removal.kind in ("pc", "rogue") and removal.k >= dim:
        raise IsotuiError(f"remove {removal.label}: site {site} is {dim} wide; K must be below {dim}")
    if removal.kind == "dims" and max(removal.dims) >= dim:
        raise IsotuiError(
            f"remove {removal.label}: site {site} has coordinates 0 to {dim - 1}; "
            f"dimension {max(removal.dims)} is not one of them"
        )


@dataclass(frozen=True)
class SiteMoments:
    """What a site's first pass gives a removal: its mean, each dimension's share of avg_cos,
    and the covariance's eigenvectors (columns, largest first; None when no pc:K is asked)."""

    mean: Vector
    dim_contrib: Vector
    vecs: npt.NDArray[np.float64] | None


@dataclass(frozen=True)
class Change:
    """An edit x -> x - shift - basis (basis^T x), then ``dims`` set to ``values``: any of the
    three removals (a ``mean`` is a shift; ``pc`` a basis; ``rogue``/``dims`` coordinates).
    Applied in float32 (float64 for a float64 model) and given back in the tensor's dtype."""

    shift: Vector | None = None
    basis: npt.NDArray[np.float64] | None = None
    dims: tuple[int, ...] = ()
    values: Vector | None = None

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        import torch

        work = torch.float64 if h.dtype == torch.float64 else torch.float32
        x = h.to(work)
        if self.shift is not None:
            x = x - torch.as_tensor(self.shift, dtype=work, device=h.device)
        if self.basis is not None:
            v = torch.as_tensor(self.basis, dtype=work, device=h.device)
            x = x - (x @ v) @ v.T
        if self.dims:
            x = x.clone() if x is h else x
            at = torch.as_tensor(self.dims, device=h.device)
            x[..., at] = torch.as_tensor(self.values, dtype=work, device=h.device)
        return x.to(h.dtype)

    @property
    def size(self) -> float:
        """How much it names: the shift's norm, the basis' rank, or the coordinates' count."""
        if self.shift is not None:
            return float(np.linalg.norm(self.shift))
        if self.basis is not None:
            return float(self.basis.shape[1])
        return float(len(self.dims))


def changes(removal: Removal, moments: SiteMoments, rng: np.random.Generator) -> tuple[Change, Change]:
    """(the removal's edit at a site, its random baseline) from the site's first-pass moments."""
    mean = moments.mean
    d = len(mean)
    if removal.kind == "mean":
        r = rng.standard_normal(d)
        return Change(shift=mean), Change(shift=r * (np.linalg.norm(mean) / np.linalg.norm(r)))
    if removal.kind == "pc":
        assert moments.vecs is not None  # the first pass keeps the covariance when pc:K is asked
        q = np.linalg.qr(rng.standard_normal((d, removal.k)))[0]
        return Change(basis=moments.vecs[:, : removal.k]), Change(basis=q)
    if removal.kind == "rogue":
        dims = tuple(int(i) for i in np.argsort(-moments.dim_contrib, kind="stable")[: removal.k])
    else:
        dims = removal.dims
    picked = tuple(int(i) for i in rng.choice(d, size=len(dims), replace=False))
    return Change(dims=dims, values=mean[list(dims)]), Change(dims=picked, values=mean[list(picked)])
