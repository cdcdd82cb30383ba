"""The simulator's step loop written out literally, one step and one request at a time, with no shortcuts:
the reference the vectorised `leap_core.simulator.simulate` is checked against (refresh included)."""

from __future__ import annotations

import numpy as np

from leap_core.policy import make_policy
from leap_core.simulator import SimConfig


def reference_simulate(arrival, prompt, out, predicted, config: SimConfig, refreshed=None):
    """(first token time, finish time, most consecutive steps held out) per request."""
    n = len(arrival)
    predicted = np.array(predicted, dtype=float)
    points = list(config.refresh_at)
    order = sorted(range(n), key=lambda i: (arrival[i], i))
    policy = make_policy(config.policy, config.decode_slots, config.waiting_cap, config.aging,
                         distribution=config.distribution, wait_aging=config.wait_aging)
    first, finish, max_held = np.full(n, np.nan), np.full(n, np.nan), np.zeros(n, dtype=int)
    generated, held, waited = {}, {}, {}
    resident: list[int] = []
    now, next_pos, done = arrival[order[0]], 0, 0
    while done < n:
        if not resident and arrival[order[next_pos]] > now:
            now = arrival[order[next_pos]]
        admitted, prefill = [], 0
        while (next_pos < n and arrival[order[next_pos]] <= now
               and len(resident) + len(admitted) < config.max_resident):
            request = order[next_pos]
            if admitted and prefill + prompt[request] > config.max_prefill_tokens_per_step:
                break
            admitted.append(request)
            prefill += prompt[request]
            next_pos += 1
        decoded = n_refreshed = context = 0
        if resident:
            chosen = set(policy.select(predicted[resident], np.array([generated[r] for r in resident]),
                                       np.array([held[r] for r in resident]), arrival[resident],
                                       np.array([waited[r] for r in resident])).tolist())
            for slot, request in enumerate(resident):
                if slot in chosen:
                    context += prompt[request] + generated[request]
                    generated[request] += 1
                    held[request] = 0
                    decoded += 1
                    g = generated[request]
                    if g in points and g < out[request] and np.isfinite(refreshed[request][points.index(g)]):
                        predicted[request] = g + refreshed[request][points.index(g)]
                        n_refreshed += 1
                else:
                    held[request] += 1
                    waited[request] += 1
                    max_held[request] = max(max_held[request], held[request])
        pairs = sum(prompt[r] * (prompt[r] + 1) // 2 for r in admitted)
        now += config.step_model.step_seconds(decoded, prefill, context, pairs) + n_refreshed * config.refresh_cost_s
        for request in admitted:
            first[request] = now
            generated[request], held[request], waited[request] = 1, 0, 0
            resident.append(request)
        for request in [r for r in resident if generated[r] == out[r]]:
            finish[request] = now
            resident.remove(request)
            done += 1
    return first, finish, max_held
