"""The experiment's settings: sizes, the sweep of norms N, seeds, block wiring; the cache key."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from importlib import metadata
from typing import Any

import numpy as np

from isotui.errors import IsotuiError

SCHEMA = 4  # 3: score bins asinh-spaced with scale 0.001; 4: score bins from the data range
FOLDER = "drift-block"
DEFAULT_NORMS = "0:30:31"
MAX_NORMS = 1000
BLOCKS = ("post-ln", "pre-ln")
MEASURES = ("after-norm", "before-norm")


def _settings_defaults() -> tuple[float, ...]:
    return parse_norms(DEFAULT_NORMS)


def parse_norms(text: str) -> tuple[float, ...]:
    """``start:stop:count`` (inclusive, evenly spaced) or a comma list; sorted ascending."""
    text = str(text).strip()
    if ":" in text:
        parts = text.split(":")
        if len(parts) != 3:
            raise IsotuiError(f"--norms {text!r} must be START:STOP:COUNT (e.g. 0:30:31) or a comma list")
        try:
            start, stop = float(parts[0]), float(parts[1])
            count = int(parts[2])
        except ValueError:
            raise IsotuiError(
                f"--norms {text!r} needs numbers START:STOP and a whole COUNT, e.g. 0:30:31"
            ) from None
        if not (math.isfinite(start) and math.isfinite(stop)):
            raise IsotuiError(f"--norms {text!r} has a start or stop that is not a finite number")
        if count < 1 or count > MAX_NORMS:
            raise IsotuiError(f"--norms {text!r} has count {count}; give a count from 1 to {MAX_NORMS}")
        if start > stop:
            raise IsotuiError(f"--norms {text!r} starts above where it stops; give START <= STOP")
        if count == 1 and start != stop:
            raise IsotuiError(f"--norms {text!r} has count 1 but START != STOP; give a count of 2 or more")
        values = [float(v) for v in np.linspace(start, stop, count)]
    else:
        try:
            values = [float(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise IsotuiError(
                f"--norms {text!r} is not START:STOP:COUNT or a comma list of numbers, e.g. 0,5,10"
            ) from None
        if not values:
            raise IsotuiError("--norms is empty; give START:STOP:COUNT (e.g. 0:30:31) or a comma list")
        if len(values) > MAX_NORMS:
            raise IsotuiError(f"--norms lists {len(values)} values; give at most {MAX_NORMS}")
        if len(set(values)) != len(values):
            raise IsotuiError(f"--norms {text!r} repeats a value; list each norm once")
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise IsotuiError(f"--norms {text!r} has a negative or non-finite norm; norms must be >= 0")
    return tuple(sorted(values))


def parse_seeds(text: str, flag: str = "--seeds") -> tuple[int, ...]:
    """A comma list of distinct non-negative integers, in the order given."""
    try:
        seeds = tuple(int(s) for s in str(text).split(",") if s.strip())
    except ValueError:
        raise IsotuiError(f"{flag} {text!r} must be whole numbers separated by commas, e.g. 0,1,2") from None
    if not seeds:
        raise IsotuiError(f"{flag} is empty; give one or more seeds, e.g. 0,1,2")
    if any(s < 0 or s >= 2**63 for s in seeds):
        raise IsotuiError(f"{flag} {text!r} has a seed outside 0..2^63-1; give non-negative seeds")
    if len(set(seeds)) != len(seeds):
        raise IsotuiError(f"{flag} {text!r} repeats a seed; list each seed once")
    return seeds


@dataclass(frozen=True)
class DriftBlockConfig:
    """Every setting of the experiment. Construction validates (raises :class:`IsotuiError`)."""

    hidden: int = 768
    heads: int = 12
    intermediate: int = 3072
    init_std: float = 0.02
    vocab: int = 30522
    batch: int = 16
    seq_len: int = 512
    norms: tuple[float, ...] = field(default_factory=_settings_defaults)
    seeds: tuple[int, ...] = (0,)
    device: str = "auto"
    block: str = "post-ln"
    measure: str = "after-norm"

    def __post_init__(self) -> None:
        if self.block not in BLOCKS:
            raise IsotuiError(f"--block {self.block!r} is not one of {', '.join(BLOCKS)}")
        if self.measure not in MEASURES:
            raise IsotuiError(f"--measure {self.measure!r} is not one of {', '.join(MEASURES)}")
        if self.block == "pre-ln" and self.measure == "before-norm":
            raise IsotuiError(
                "--measure before-norm needs --block post-ln: a pre-LN block does not end in a "
                "LayerNorm, so its output is already the un-normalised residual sum"
            )
        for name in ("hidden", "heads", "intermediate", "vocab", "batch", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                flag = "--" + name.replace("_", "-")
                raise IsotuiError(f"{flag} {value!r} must be a whole number of at least 1")
        if self.hidden % self.heads:
            raise IsotuiError(
                f"--heads {self.heads} does not divide --hidden {self.hidden}; choose a number of heads "
                "that divides the hidden size"
            )
        if not (
            isinstance(self.init_std, (int, float)) and math.isfinite(self.init_std) and self.init_std > 0
        ):
            raise IsotuiError(f"--init-std {self.init_std!r} must be a positive number, e.g. 0.02")
        if self.seq_len < 2:
            raise IsotuiError(f"--seq-len {self.seq_len} is too short; give at least 2 tokens")
        norms = tuple(sorted(float(v) for v in self.norms))
        if not norms:
            raise IsotuiError("--norms is empty; give START:STOP:COUNT (e.g. 0:30:31) or a comma list")
        if len(set(norms)) != len(norms):
            raise IsotuiError("--norms repeats a value; list each norm once")
        if any(not math.isfinite(v) or v < 0 for v in norms):
            raise IsotuiError("--norms has a negative or non-finite norm; norms must be >= 0")
        object.__setattr__(self, "norms", norms)  # ascending: arrays are indexed by N in this order
        seeds = tuple(int(s) for s in self.seeds)
        if not seeds or len(set(seeds)) != len(seeds) or any(s < 0 or s >= 2**63 for s in seeds):
            raise IsotuiError("--seeds must be one or more distinct non-negative integers, e.g. 0,1,2")
        object.__setattr__(self, "seeds", seeds)
        from isotui.extract.device import validate_device

        validate_device(self.device)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def memory_bytes(self) -> int:
        """A lower bound of the memory one seed needs (float32): the embedding table (kept on
        the device), the block, and one N's activations (inputs, Q/K/V, outputs, the feed-forward
        and the attention scores with their softmax)."""
        h, i, tokens = self.hidden, self.intermediate, self.batch * self.seq_len
        table = self.vocab * h
        block = 4 * h * h + 2 * h * i
        activations = tokens * (8 * h + 2 * i) + 2 * self.batch * self.heads * self.seq_len**2
        return 4 * (table + block + activations) + 8 * tokens

    def settings(self) -> dict[str, Any]:
        """The settings that decide the numbers (not the seeds or the device)."""
        return {
            "hidden": self.hidden,
            "heads": self.heads,
            "intermediate": self.intermediate,
            "init_std": float(self.init_std),
            "vocab": self.vocab,
            "batch": self.batch,
            "seq_len": self.seq_len,
            "norms": [float(v) for v in self.norms],
            "block": self.block,
            "measure": self.measure,
        }

    def describe_block(self) -> str:
        """``post-ln, output after-norm``, ``post-ln, output before-norm`` or ``pre-ln`` (no final norm)."""
        return self.block if self.block == "pre-ln" else f"{self.block}, output {self.measure}"

    @property
    def ends_in_norm(self) -> bool:
        """Whether the measured output is a LayerNorm's output (post-LN block, after its norm)."""
        return self.block == "post-ln" and self.measure == "after-norm"

    def key(self, seed: int) -> str:
        """The cache key of one seed's sweep."""
        fields_ = {
            "experiment": FOLDER,
            "schema": SCHEMA,
            "torch": _version("torch"),
            "transformers": _version("transformers"),
            "dtype": "float32",
            "seed": int(seed),
            **self.settings(),
        }
        for name, default in (("block", "post-ln"), ("measure", "after-norm")):
            if fields_[name] == default:  # keys of the default sweep stay those of earlier versions
                del fields_[name]
        from isotui.experiments.cached import key_hash

        return key_hash(fields_)


# the settings that ``key=value`` words name (the lab's settings box), in the class's order
SETTINGS = tuple(f.name for f in fields(DriftBlockConfig) if f.name != "device")
# those that each row of a sweep repeats (the row's own N and seed stand apart)
ROW_SETTINGS = tuple(name for name in SETTINGS if name not in ("norms", "seeds"))


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"
