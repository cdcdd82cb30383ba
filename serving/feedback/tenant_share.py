"""How much of what RLS learns one tenant may supply.

RLS corrects the serving readout with every honest label (`leap_io.labels`), so a tenant that sends most
of the traffic would decide most of the correction, and a flooding tenant could steer it for everyone.
`TenantShare` lets one tenant supply at most `max_share` of the last `window` learned rows while more than
one tenant is in the window; its rows beyond that are counted, not learned. A tenant is the request's
`leap_tenant` extra, so this protects tenants from each other only where a gateway sets it.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence

import numpy as np


class TenantShare:
    """Admits a row to RLS unless its tenant already supplied `max_share` x `window` of the rows admitted
    from the last `window` rows seen, while those rows came from more than one tenant."""

    def __init__(self, max_share: float | None, window: int) -> None:
        if max_share is not None and not 0.0 < max_share <= 1.0:
            raise ValueError(f"max_share is a fraction in (0, 1], not {max_share}")
        if window < 1:
            raise ValueError(f"window counts rows, at least 1, not {window}")
        self.max_share, self.window = max_share, int(window)
        self._recent: deque[tuple[str, bool]] = deque()  # (tenant, admitted) of the last `window` rows seen
        self._seen: Counter[str] = Counter()
        self._admitted: Counter[str] = Counter()

    def admit(self, tenant: str | None) -> bool:
        """Whether this tenant's row may teach RLS now (every row seen joins the window)."""
        key = tenant or ""
        admitted = (self.max_share is None or not (set(self._seen) - {key})
                    or self._admitted[key] + 1 <= self.max_share * self.window)
        self._recent.append((key, admitted))
        self._seen[key] += 1
        self._admitted[key] += admitted
        if len(self._recent) > self.window:
            oldest, was_admitted = self._recent.popleft()
            self._seen[oldest] -= 1
            self._admitted[oldest] -= was_admitted
            if not self._seen[oldest]:
                del self._seen[oldest], self._admitted[oldest]
        return admitted


def capped_weights(tenants: Sequence[str | None], max_share: float | None) -> np.ndarray:
    """Row weights (summing to 1) under which no tenant carries more than `max_share` of the total.

    Each tenant's weight is its share of the rows, except that a tenant above `max_share` is cut to
    it and the weight it loses goes to the others in proportion to their shares (water-filling,
    repeated until no tenant exceeds the cap); a tenant's weight is spread evenly over its rows. With
    one tenant, or no cap, every row weighs the same. Where the cap cannot hold (fewer than
    1 / `max_share` tenants) every tenant weighs the same. Rows without a tenant are one tenant.
    """
    keys = ["" if tenant is None else tenant for tenant in tenants]
    if not keys:
        return np.zeros(0)
    counts = Counter(keys)
    if max_share is None or len(counts) == 1:
        return np.full(len(keys), 1.0 / len(keys))
    if len(counts) * max_share < 1.0:
        weight = {tenant: 1.0 / len(counts) for tenant in counts}
    else:
        share = {tenant: n / len(keys) for tenant, n in counts.items()}
        capped: set[str] = set()
        scale = 1.0
        while len(capped) < len(counts):
            free = [t for t in counts if t not in capped]
            scale = (1.0 - max_share * len(capped)) / sum(share[t] for t in free)
            over = {t for t in free if scale * share[t] > max_share * (1 + 1e-12)}
            if not over:
                break
            capped |= over
        weight = {t: max_share if t in capped else scale * share[t] for t in counts}
    return np.array([weight[key] / counts[key] for key in keys])
