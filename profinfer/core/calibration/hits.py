"""The probe-hit vocabulary, named once: the kinds of trap a hit takes, which collectors count
(their cost counts' `hits_<kind>`, a recording's `cost:hits_<kind>`), and each kind's price as
probecost measures it (its key, a recording's `trap:<key>`)."""
from __future__ import annotations

from enum import Enum


class Hit(str, Enum):
    EMULATED = "emulated"       # the probed instruction emulated by the kernel
    STEPPED = "stepped"         # the probed instruction single-stepped out of line
    RETURN = "return"           # a return probe: what it costs beyond the entry trap it shares

    @property
    def count_key(self) -> str:
        """A collector's count of these hits (cost_counts())."""
        return f"hits_{self.value}"

    @property
    def price_key(self) -> str:
        """The price of one, as probecost measures it (ns)."""
        return PRICE_KEYS[self.value]


PRICE_KEYS = {"emulated": "emulated_ns", "stepped": "stepped_ns", "return": "uretprobe_extra_ns"}
TRAP_KEYS = tuple(PRICE_KEYS.values())      # probecost's measurement, each kind's price


def no_hits() -> dict[str, int]:
    """The cost counts' hits, each kind at 0."""
    return {h.count_key: 0 for h in Hit}


def trap_ns(hits: dict[str, int], prices: dict[str, float]) -> float:
    """What the hits trapped: hits by kind ("emulated", ...), prices as probecost gives them."""
    return sum(hits.get(h.value, 0) * prices[h.price_key] for h in Hit)
