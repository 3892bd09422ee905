"""The price table (data in prices.json, overridable) and the cost of a call's usage, in integer nano-USD."""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keepstate.gateway.usage import Usage

BUILTIN = Path(__file__).with_name("prices.json")
NANO_PER_USD = 1_000_000_000


class PriceTableError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Price:
    """USD per million tokens."""

    input: float
    output: float
    cached_input: float | None = None
    cache_write: float | None = None

    def cost_nano(self, u: Usage) -> int:
        cached_price = self.input if self.cached_input is None else self.cached_input
        write_price = self.input if self.cache_write is None else self.cache_write
        plain = max(0, u.input_tokens - u.cached_tokens - u.cache_write_tokens)
        # USD per Mtok x tokens = micro-USD; x 1000 = nano-USD.
        micro = plain * self.input + u.cached_tokens * cached_price + u.cache_write_tokens * write_price
        micro += u.output_tokens * self.output
        return round(micro * 1000)

    def worst_case_nano(self, input_tokens: int, output_tokens: int) -> int:
        in_price = max(self.input, self.cached_input or 0.0, self.cache_write or 0.0)
        return round((input_tokens * in_price + output_tokens * self.output) * 1000) + 1


class PriceTable:
    def __init__(self, models: dict[str, Price]) -> None:
        self._exact = {k: v for k, v in models.items() if not _is_pattern(k)}
        # Longest pattern first, so that "gpt-4o-mini-*" beats "gpt-4o-*".
        self._patterns = sorted(((k, v) for k, v in models.items() if _is_pattern(k)), key=lambda kv: -len(kv[0]))

    @classmethod
    def load(cls, override: Path | None = None) -> PriceTable:
        models = _read(BUILTIN)
        if override is not None:
            models.update(_read(override))
        return cls(models)

    def price(self, model: str) -> Price | None:
        if model in self._exact:
            return self._exact[model]
        for pattern, price in self._patterns:
            if fnmatch.fnmatchcase(model, pattern):
                return price
        return None

    def cost_nano(self, model: str, u: Usage) -> int | None:
        p = self.price(model)
        return None if p is None else p.cost_nano(u)


def _is_pattern(name: str) -> bool:
    return any(c in name for c in "*?[")


def _read(path: Path) -> dict[str, Price]:
    try:
        doc: Any = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PriceTableError(f"cannot read price table {path}: {e}") from e
    if not isinstance(doc, dict) or doc.get("version") != 1 or not isinstance(doc.get("models"), dict):
        raise PriceTableError(f"{path}: expected {{'version': 1, 'models': {{...}}}}")
    out: dict[str, Price] = {}
    for name, p in doc["models"].items():
        try:
            out[name] = Price(
                input=float(p["input"]),
                output=float(p.get("output", 0.0)),
                cached_input=None if p.get("cached_input") is None else float(p["cached_input"]),
                cache_write=None if p.get("cache_write") is None else float(p["cache_write"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PriceTableError(f"{path}: bad price for {name!r}: {e}") from e
    return out
