"""The simulator's step loop written out literally, one step and one request at a time, with no shortcuts:
the reference the vectorised `leap_core.simulator.simulate` is checked against (refresh, vLLM's chunked
prefill and adaptive decode slots included; the slots are chosen anew every step here)."""

from __future__ import annotations

import numpy as np

from leap_core.decode_slots import DemandRate
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
    progress = 0  # prompt tokens of the next waiting request already computed (chunked prefill)
    demand, fed = DemandRate(config.demand_tau_s), 0
    while done < n:
        if not resident and arrival[order[next_pos]] > now:
            now = arrival[order[next_pos]]
        if config.slot_rule is not None:
            while fed < n and arrival[order[fed]] <= now:
                demand.add(arrival[order[fed]], predicted[order[fed]])
                fed += 1
            policy.k = _slots(config, demand.rate(now), resident, predicted, generated, prompt)
        decoded = n_refreshed = context = 0
        chosen = set()
        if resident:
            chosen = set(policy.select(predicted[resident], np.array([generated[r] for r in resident]),
                                       np.array([held[r] for r in resident]), arrival[resident],
                                       np.array([waited[r] for r in resident])).tolist())
        admitted, prefill, pairs = [], 0, 0
        if config.chunked_prefill:
            budget = config.max_prefill_tokens_per_step - len(chosen)
            while (next_pos < n and arrival[order[next_pos]] <= now and budget > 0
                   and len(resident) + len(admitted) < config.max_resident):
                request = order[next_pos]
                take = min(prompt[request] - progress, budget)
                budget -= take
                prefill += take
                pairs += take * progress + take * (take + 1) // 2
                if take < prompt[request] - progress:
                    progress += take
                    break
                admitted.append(request)
                progress = 0
                next_pos += 1
        else:
            while (next_pos < n and arrival[order[next_pos]] <= now
                   and len(resident) + len(admitted) < config.max_resident):
                request = order[next_pos]
                if admitted and prefill + prompt[request] > config.max_prefill_tokens_per_step:
                    break
                admitted.append(request)
                prefill += prompt[request]
                next_pos += 1
            pairs = sum(prompt[r] * (prompt[r] + 1) // 2 for r in admitted)
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


def _slots(config: SimConfig, arriving: float, resident: list[int], predicted, generated: dict, prompt) -> int:
    """The rule's slots for this step, from the step model's linear fields, written out per request."""
    if not resident:
        return config.decode_slots
    model, rule = config.step_model, config.slot_rule
    backlog = sum(max(predicted[r] - generated[r], 1.0) for r in resident)
    context = sum(prompt[r] + generated[r] for r in resident) / len(resident)
    per_request = model.per_decode_s + model.per_context_token_s * context
    return min(rule.slots(model.base_s, per_request, rule.demand(arriving, backlog), len(resident)),
               config.decode_slots)
