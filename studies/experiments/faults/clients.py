"""Scenarios 1-3 of the fault suite: hostile clients and hostile pushes against one live replica.

Each function takes a `Replica` (a running `leap serve` and its clients), sends what a careless or
hostile client could send, and returns the suite's result dict. None of them changes what the replica
serves: every refusal is checked against the readout's anchor (base version and generation, which a
push or restore changes and an RLS publish does not), and each ends with a good request served.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from experiments.faults.serve import (
    MAX_TOKENS_BUDGET,
    Admin,
    ServeProcess,
    bundle_of,
    completed,
    fault_readout,
    npy_bytes,
    openai_body,
    openai_path,
    openai_request,
    raw_http,
    with_array,
    with_array_value,
    with_length_distribution,
    zip_bomb,
)
from leap_io.admin_client import READOUT_PATH, AdminClient


@dataclass
class Replica:
    """A running replica and what the scenarios share about it."""

    serve: ServeProcess
    admin: Admin
    model: str
    described: dict
    client: httpx.Client
    pushed: list[str] = field(default_factory=list)  # versions this suite pushed and the replica took
    workdir: Any = None

    def good_request(self, tag: str, endpoint: str = "chat", max_tokens: int = 8) -> bool:
        body = openai_body(self.model, endpoint, 0, max_tokens, {"leap_request_id": f"fault-good-{tag}"})
        return completed(*openai_request(self.client, self.serve.url, body, endpoint))

    def alive(self) -> bool:
        return self.serve.serving()


def result(scenario: str, started: float, survived: bool, detail: str, **figures: Any) -> dict[str, Any]:
    return {"scenario": scenario, "survived": bool(survived), "seconds": round(time.monotonic() - started, 2),
            **figures, "detail": detail}


def not_run(scenario: str, reason: str) -> dict[str, Any]:
    return {"scenario": scenario, "survived": False, "seconds": 0.0, "ran": False, "detail": f"not run: {reason}"}


# ---------------------------------------------------------------------------- 1. bad vllm_xargs

BAD_XARGS: tuple[tuple[str, str], ...] = (
    # (case, the raw JSON text of `vllm_xargs`): JSON has no NaN, but Python's parser (the middleware's
    # and vLLM's) accepts the NaN / Infinity literals, and 1e400 parses as inf
    ("not_a_dict_string", '"leap_oracle_length=5"'),
    ("not_a_dict_number", "42"),
    ("not_a_dict_list", '[{"leap_oracle_length": 5}]'),
    ("not_a_dict_bool", "true"),
    ("oracle_string", '{"leap_oracle_length": "100"}'),
    ("oracle_bool", '{"leap_oracle_length": true}'),
    ("oracle_nan_literal", '{"leap_oracle_length": NaN}'),
    ("oracle_infinity_literal", '{"leap_oracle_length": -Infinity}'),
    ("oracle_1e400_is_inf", '{"leap_oracle_length": 1e400}'),
    ("oracle_huge", '{"leap_oracle_length": 1e300}'),
    ("oracle_negative", '{"leap_oracle_length": -5}'),
    ("oracle_object", '{"leap_oracle_length": {"value": 1}}'),
    ("oracle_list", '{"leap_oracle_length": [1, 2]}'),
    ("oracle_nan_string", '{"leap_oracle_length": "NaN"}'),
    ("oracle_null_and_bad", '{"leap_oracle_length": null, "leap_tenant": 7}'),
    ("predicted_negative", '{"leap_predicted_length": -1}'),
    ("predicted_huge_integer", '{"leap_predicted_length": 123456789012345678901234567890}'),
    ("arrival_far_future", '{"leap_planned_arrival": 1e12}'),
    ("arrival_negative", '{"leap_planned_arrival": -1}'),
    ("request_id_number", '{"leap_request_id": 123}'),
    ("request_id_empty", '{"leap_request_id": ""}'),
    ("request_id_too_long", '{"leap_request_id": "' + "x" * 300 + '"}'),
    ("request_id_object", '{"leap_request_id": {"id": "a"}}'),
    ("domain_list", '{"leap_domain": []}'),
    ("tenant_bool", '{"leap_tenant": false}'),
    ("unknown_leap_key", '{"leap_priority": 1}'),
    ("bare_prefix_key", '{"leap_": 1}'),
    ("key_spelt_with_escapes", '{"\\u006ceap_oracle_length": "x"}'),
    ("good_key_beside_bad", '{"leap_request_id": "ok-1", "leap_oracle_length": -3}'),
)


def _body_text(model: str, endpoint: str, xargs_json: str) -> bytes:
    base = openai_body(model, endpoint, 1, 4)
    text = json.dumps(base)
    return (text[:-1] + ', "vllm_xargs": ' + xargs_json + "}").encode()


def bad_vllm_xargs(replica: Replica) -> dict[str, Any]:
    """Every bad `vllm_xargs` on both OpenAI endpoints is a 400 from the middleware; the replica serves on."""
    started = time.monotonic()
    before = replica.admin.anchor()
    _, health_before = replica.admin.health()
    engine_bad_before = sum(health_before.get("counters", {}).get("bad_request_extras", {}).values())
    statuses: Counter[int] = Counter()
    wrong: dict[str, Any] = {}
    by_middleware = 0
    sent = 0
    for endpoint in ("chat", "completions"):
        for case, xargs in BAD_XARGS:
            sent += 1
            name = f"{endpoint}:{case}"
            try:
                response = replica.client.post(f"{replica.serve.url}{openai_path(endpoint)}",
                                               content=_body_text(replica.model, endpoint, xargs),
                                               headers={"Content-Type": "application/json"})
            except httpx.HTTPError as exc:
                wrong[name] = f"no answer: {type(exc).__name__}: {exc}"
                statuses[-1] += 1
                continue
            statuses[response.status_code] += 1
            text = response.text
            if response.status_code != 400:
                wrong[name] = f"{response.status_code}: {text[:160]}"
            elif "invalid vllm_xargs" in text:
                by_middleware += 1
        # not JSON at all, and a JSON body that is not an object: vLLM's own 4xx, the server carries on
        for case, raw in (("not_json", b"{this is not json"), ("json_array", b"[1, 2, 3]")):
            sent += 1
            try:
                response = replica.client.post(f"{replica.serve.url}{openai_path(endpoint)}", content=raw,
                                               headers={"Content-Type": "application/json"})
                statuses[response.status_code] += 1
                if not 400 <= response.status_code < 500:
                    wrong[f"{endpoint}:{case}"] = f"{response.status_code}: {response.text[:160]}"
            except httpx.HTTPError as exc:
                wrong[f"{endpoint}:{case}"] = f"no answer: {exc}"
    good = {endpoint: replica.good_request(f"xargs-{endpoint}", endpoint) for endpoint in ("chat", "completions")}
    alive = replica.alive()
    after = replica.admin.anchor()
    _, health_after = replica.admin.health()
    engine_bad_after = sum(health_after.get("counters", {}).get("bad_request_extras", {}).values())
    cases = 2 * len(BAD_XARGS)
    survived = not wrong and by_middleware == cases and all(good.values()) and alive and after == before
    detail = (f"{cases} bad vllm_xargs (both endpoints): {by_middleware} answered 400 by the middleware; "
              f"{sent - cases} non-JSON bodies answered 4xx; good request after: {good}; alive: {alive}")
    if wrong:
        detail += f"; unexpected: {dict(list(wrong.items())[:6])}"
    return result("bad_vllm_xargs", started, survived, detail, requests_sent=sent, refused_by_middleware=by_middleware,
                  statuses={str(k): v for k, v in sorted(statuses.items())}, unexpected=wrong,
                  good_request_after=good, engine_bad_extras_counted=engine_bad_after - engine_bad_before,
                  readout_unchanged=after == before, requests_lost=sum(not ok for ok in good.values()))


# ---------------------------------------------------------------------------- 2. malformed admin requests

def _post(path: str, headers: str, body: bytes = b"") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: leap\r\n{headers}Connection: close\r\n\r\n".encode() + body


def admin_cases(token: str, limit: int) -> list[tuple[str, bytes, bool, tuple[int, ...]]]:
    """(case, raw bytes, half-close after sending, accepted statuses)."""
    auth = f"Authorization: Bearer {token}\r\n"
    readout = READOUT_PATH
    json_body = b'{"version": "v999", "coef": [1, 2, 3], "layer": 1}'
    garbage = bytes(range(256)) * 8
    return [
        ("push_without_token", _post(readout, "Content-Length: 5\r\n", b"hello"), False, (401,)),
        ("push_with_wrong_token", _post(readout, "Authorization: Bearer not-the-token\r\nContent-Length: 5\r\n",
                                        b"hello"), False, (401,)),
        ("push_with_basic_auth", _post(readout, "Authorization: Basic bGVhcDpsZWFw\r\nContent-Length: 5\r\n",
                                       b"hello"), False, (401,)),
        ("push_with_token_prefix_only", _post(readout, f"Authorization: Bearer {token[:-1]}\r\nContent-Length: 5\r\n",
                                              b"hello"), False, (401,)),
        ("flush_without_token", _post("/leap/feedback/flush", "Content-Length: 0\r\n"), False, (401,)),
        ("no_content_length", _post(readout, auth), False, (411,)),
        ("chunked_body", _post(readout, auth + "Transfer-Encoding: chunked\r\n", b"5\r\nhello\r\n0\r\n\r\n"),
         False, (411,)),
        ("content_length_text", _post(readout, auth + "Content-Length: abc\r\n"), False, (400,)),
        ("content_length_negative", _post(readout, auth + "Content-Length: -5\r\n"), False, (400,)),
        ("content_length_float", _post(readout, auth + "Content-Length: 1e3\r\n"), False, (400,)),
        ("content_length_25_digits", _post(readout, auth + "Content-Length: " + "9" * 25 + "\r\n"), False, (400,)),
        ("content_length_zero", _post(readout, auth + "Content-Length: 0\r\n"), False, (400,)),
        ("declared_body_over_the_cap", _post(readout, auth + f"Content-Length: {limit + 1}\r\n"), False, (413,)),
        ("declared_body_of_a_tib", _post(readout, auth + f"Content-Length: {1 << 40}\r\n"), False, (413,)),
        ("truncated_body", _post(readout, auth + "Content-Length: 4096\r\n", b"PK\x03\x04" + b"\0" * 96), True,
         (400,)),
        ("garbage_body", _post(readout, auth + f"Content-Length: {len(garbage)}\r\n", garbage), False, (422,)),
        ("json_body", _post(readout, auth + f"Content-Length: {len(json_body)}\r\n" +
                            "Content-Type: application/json\r\n", json_body), False, (422,)),
        ("zip_of_text", _post(readout, auth + "Content-Length: 22\r\n", b"PK\x05\x06" + b"\0" * 18), False, (422,)),
        ("unknown_post_path", _post("/leap/readout/../admin", auth + "Content-Length: 0\r\n"), False, (404,)),
        ("unknown_get_path", b"GET /leap/../../etc/passwd HTTP/1.1\r\nHost: leap\r\nConnection: close\r\n\r\n",
         False, (404,)),
        ("not_http", b"GARBAGE\r\n\r\n", False, (400,)),
        ("bad_http_version", b"GET /leap/readout HTTP/1.1x\r\nHost: leap\r\n\r\n", False, (400,)),
        ("request_line_70k", b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: leap\r\n\r\n", False, (414, None)),
        ("too_many_headers", b"GET /leap/readout HTTP/1.1\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(120))
         + b"\r\n", False, (431, None)),
        ("header_line_70k", b"GET /leap/readout HTTP/1.1\r\nX-Big: " + b"b" * 70_000 + b"\r\n\r\n", False, (431, 400, None)),
    ]


def _stalled_body(port: int, token: str, results: dict) -> None:
    """Declare 100 bytes, send 10 and wait: the replica must answer 408 at its socket timeout."""
    head = _post("/leap/readout", f"Authorization: Bearer {token}\r\nContent-Length: 100\r\n", b"PK" + b"x" * 8)
    began = time.monotonic()
    answer = raw_http(port, head, timeout=45.0)
    results["stalled_body"] = (answer.status, round(time.monotonic() - began, 1))


def malformed_admin(replica: Replica, slow: bool = True) -> dict[str, Any]:
    """Every malformed admin request is a 4xx; the replica serves on and its readout does not change."""
    from serving.admin.api import body_limit

    started = time.monotonic()
    before = replica.admin.anchor()
    limit = body_limit(type("T", (), {"dim": int(replica.described["dim"])})(), None)
    port = replica.serve.admin_port
    background: dict[str, Any] = {}
    stall = None
    if slow:  # holds one handler slot for the socket timeout (30 s) while everything else goes on
        stall = threading.Thread(target=_stalled_body, args=(port, replica.admin.token, background), daemon=True)
        stall.start()
    answers: dict[str, Any] = {}
    wrong: dict[str, Any] = {}
    for case, data, half_close, accepted in admin_cases(replica.admin.token, limit):
        answer = raw_http(port, data, half_close=half_close)
        answers[case] = answer.status
        if answer.status not in accepted:
            wrong[case] = {"status": answer.status, "expected": list(accepted), "error": answer.error,
                           "body": answer.body[:160].decode(errors="replace")}
    # a flood: 40 clients at once against 8 handler slots, each answered 200 or 503 (busy), none dropped
    flood: Counter[str] = Counter()

    def hit() -> None:
        try:
            flood[str(AdminClient(replica.admin.url, replica.admin.token, timeout=30).readout().status_code)] += 1
        except httpx.HTTPError as exc:
            flood[type(exc).__name__] += 1

    threads = [threading.Thread(target=hit) for _ in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    if set(flood) - {"200", "503"} or not flood.get("200"):
        wrong["flood_of_40"] = dict(flood)
    if stall is not None:
        stall.join(60)
        status, seconds = background.get("stalled_body", (None, None))
        answers["stalled_body"] = status
        if status != 408:
            wrong["stalled_body"] = {"status": status, "seconds": seconds, "expected": [408]}
    health_status, _ = replica.admin.health()
    after = replica.admin.anchor()
    good = replica.good_request("after-admin")
    alive = replica.alive()
    survived = not wrong and after == before and alive and good and health_status == 200
    detail = (f"{len(answers)} malformed admin requests, {len(answers) - len(wrong)} answered as expected (4xx); "
              f"40-client flood: {dict(flood)}; readout unchanged: {after == before}; health {health_status}; "
              f"good request after: {good}")
    if wrong:
        detail += f"; unexpected: {wrong}"
    return result("malformed_admin", started, survived, detail, requests_sent=len(answers) + 40, answers=answers,
                  unexpected=wrong, flood=dict(flood), readout_before=list(before), readout_after=list(after),
                  requests_lost=0 if good else 1)


# ---------------------------------------------------------------------------- 3. hostile pushes

def push_cases(replica: Replica) -> list[tuple[str, bytes, str, tuple[int, ...]]]:
    """(case, body, query, accepted statuses) of pushes that must be refused."""
    from leap_core.readout_format import to_bytes
    from leap_io.push_bundle import make_bundle

    described = replica.described
    serving = replica.admin.readout()
    current = str(serving.get("version", ""))
    number = int(current[1:].split("+")[0]) if current.startswith("v") and current[1:].split("+")[0].isdigit() else 10
    good, rls = fault_readout(described, f"v{number + 50}", seed=101)
    good_bytes = to_bytes(good)
    state = rls.state_arrays()
    older, older_rls = fault_readout(described, f"v{number - 1}", seed=102)
    other, other_rls = fault_readout(described, f"v{number + 51}", seed=103)

    def variant(**metadata: Any) -> bytes:
        readout, _ = fault_readout(described, f"v{number + 52}", seed=104)
        readout.metadata.update(metadata)
        return to_bytes(readout)

    wide, _ = fault_readout({**described, "dim": int(described["dim"]) + 1}, f"v{number + 53}", seed=105)
    log_target, _ = fault_readout(described, f"v{number + 54}", seed=106)
    log_target.target = "log"
    short_budget, _ = fault_readout(described, f"v{number + 55}", seed=107)
    short_budget.max_tokens = 64
    spread, _ = fault_readout(described, f"v{number + 56}", seed=108)
    spread_bytes = to_bytes(with_length_distribution(spread))

    def set_at(index: int, value: float):
        def edit(values: np.ndarray) -> np.ndarray:
            values.reshape(-1)[index] = value
            return values
        return edit

    bad_state = dict(state)
    bad_state["theta"] = state["theta"].copy()
    bad_state["theta"][0] = float("inf")
    nan_p = dict(state)
    nan_p["P"] = state["P"].copy()
    nan_p["P"][1, 1] = float("nan")
    huge_state = dict(state)
    huge_state["b"] = state["b"].astype("float64").copy()
    huge_state["b"][2] = 1e300
    return [
        ("bomb_rls_P_claims_538MB", zip_bomb("rls_P.npy", (8200, 8200), readout_bytes=good_bytes), "", (413,)),
        ("bomb_rls_A_claims_3_2GB", zip_bomb("rls_A.npy", (20000, 20000), inflate_bytes=16 << 20,
                                             readout_bytes=good_bytes), "", (413, 422)),
        ("bomb_inflates_to_1GiB", zip_bomb("rls_P.npy", (11586, 11586), readout_bytes=good_bytes), "", (413,)),
        ("bomb_readout_coef_24MB", zip_bomb("coef.npy", (3_000_000,)), "", (413,)),
        ("bomb_readout_inside_bundle", make_bundle(zip_bomb("coef.npy", (3_000_000,)), None), "", (413,)),
        ("readout_coef_nan", with_array_value(good_bytes, "coef", float("nan")), "", (422,)),
        ("readout_mean_inf", with_array_value(good_bytes, "mean", float("inf")), "", (422,)),
        ("readout_coef_1e39_float64", with_array_value(good_bytes, "coef", 1e39), "", (422,)),
        ("readout_intercept_1e39", with_array_value(good_bytes, "intercept", 1e39, index=0), "", (422,)),
        ("readout_scale_denormal", with_array_value(good_bytes, "scale", 1e-40), "", (422,)),
        ("readout_slope_overflows_float32", with_array_value(with_array_value(good_bytes, "coef", 1e35, 2),
                                                            "scale", 1e-5, 2), "", (422,)),
        ("nan_readout_forced", with_array_value(good_bytes, "coef", float("nan")), "?force=1", (422,)),
        ("rls_theta_inf", make_bundle(good_bytes, bad_state), "", (422,)),
        ("rls_P_nan", make_bundle(good_bytes, nan_p), "", (422,)),
        ("rls_b_1e300", make_bundle(good_bytes, huge_state), "", (422,)),
        ("rls_state_of_another_readout", make_bundle(good_bytes, other_rls.state_arrays()), "", (422,)),
        ("rls_object_array", _object_member_bundle(good_bytes), "", (422,)),
        ("older_version_bundle", bundle_of(older, older_rls), "", (409,)),
        ("older_version_bare", to_bytes(older), "", (409,)),
        ("wrong_layer", variant(layer=int(described["layer"]) - 1), "", (409,)),
        ("wrong_fingerprint", variant(model_fingerprint="sha256:" + "0" * 64), "", (409,)),
        ("wrong_dim", to_bytes(wide), "", (409,)),
        ("wrong_target", to_bytes(log_target), "", (409,)),
        ("wrong_max_tokens", to_bytes(short_budget), "", (409,)),
        ("distribution_edges_nan", with_array(spread_bytes, "length_edges", set_at(0, float("nan"))), "", (422,)),
        ("distribution_length_past_budget", with_array(spread_bytes, "length_samples",
                                                       set_at(-1, MAX_TOKENS_BUDGET + 1)), "", (422,)),
        ("distribution_lengths_unsorted", with_array(spread_bytes, "length_samples", lambda v: v[::-1].copy()),
         "", (422,)),
        ("distribution_sizes_miscount", with_array(spread_bytes, "length_bin_sizes", set_at(0, 10**6)), "", (422,)),
        ("distribution_float_sizes", with_array(spread_bytes, "length_bin_sizes", lambda v: v.astype(np.float64)),
         "", (422,)),
        ("not_a_readout", b"PK\x03\x04 definitely not a zip", "", (422,)),
        ("npz_without_readout", make_bundle(b"", {"theta": state["theta"]}), "", (422,)),
        ("numpy_file_not_zip", npy_bytes(state["theta"]), "", (422,)),
    ]


def _object_member_bundle(readout_bytes: bytes) -> bytes:
    import io
    import zipfile

    import numpy as np

    member = io.BytesIO()
    np.lib.format.write_array(member, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("readout_bytes.npy", npy_bytes(np.frombuffer(readout_bytes, dtype=np.uint8)))
        archive.writestr("rls_theta.npy", member.getvalue())
    return buffer.getvalue()


def hostile_pushes(replica: Replica) -> dict[str, Any]:
    """Bombs, non-finite and overflowing weights, foreign and older readouts: each refused with its
    status, and the readout serving before serves after (same base version, same generation)."""
    started = time.monotonic()
    before = replica.admin.anchor()
    build_started = time.monotonic()
    cases = push_cases(replica)
    build_s = time.monotonic() - build_started
    answers: dict[str, Any] = {}
    wrong: dict[str, Any] = {}
    sizes = {}
    changed = []
    for case, body, query, accepted in cases:
        sizes[case] = len(body)
        try:
            response = replica.admin.push(body, query)
            status, text = response.status_code, response.text
        except httpx.HTTPError as exc:
            status, text = None, f"{type(exc).__name__}: {exc}"
        answers[case] = status
        if status not in accepted:
            wrong[case] = {"status": status, "expected": list(accepted), "body": text[:200]}
        if replica.admin.anchor() != before:
            changed.append(case)
    good = replica.good_request("after-pushes")
    after = replica.admin.anchor()
    alive = replica.alive()
    survived = not wrong and not changed and after == before and good and alive
    detail = (f"{len(cases)} hostile pushes (largest body {max(sizes.values()) / 1e6:.1f} MB, one inflating to 1 GiB), "
              f"{len(cases) - len(wrong)} refused with the expected status; serving {before[0]} "
              f"(generation {before[1]}) before and {after[0]} (generation {after[1]}) after; good request after: {good}")
    if wrong:
        detail += f"; unexpected: {wrong}"
    if changed:
        detail += f"; the readout changed after: {changed}"
    return result("hostile_pushes", started, survived, detail, pushes=len(cases), answers=answers, unexpected=wrong,
                  readout_changed_after=changed, body_bytes=sizes, build_s=round(build_s, 2),
                  readout_before=list(before), readout_after=list(after), requests_lost=0 if good else 1)
