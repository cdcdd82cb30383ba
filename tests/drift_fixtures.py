"""A serving replica fed real traffic of two domains, for the drift watch's tests.

The replica is a real `LeapRuntime` with its admin server (no engine): requests are real vLLM `Request`
objects, features reach it through the real capture channel, and each request finishes with the
output length the model really produced. Features and lengths are the committed corpus snapshot's
(SmolLM2-135M-Instruct, layer 22, M = 1024): one prompt set's rows are the domain a readout is fitted
on, another set's rows the traffic it meets later.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from tests.runtime_fixtures import MODEL, engine_config, eventually

LAYER, LAYERS, HIDDEN, MAX_TOKENS = 22, 30, 576, 1024
TOKEN = "drift-test-token"


@dataclass
class Domain:
    """One prompt set's rows of the snapshot, in the snapshot's order."""

    name: str
    ids: np.ndarray
    features: np.ndarray
    lengths: np.ndarray

    def part(self, start: int, stop: int) -> Domain:
        return Domain(self.name, self.ids[start:stop], self.features[start:stop], self.lengths[start:stop])


def snapshot_domains(*names: str) -> dict[str, Domain]:
    """The snapshot's layer-22 rows of the named prompt sets (finished by EOS or the budget alike)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from study_harness.snapshot import read_manifest, snapshot_file

    manifest = read_manifest()
    key = next(key for key, corpus in manifest["corpora"].items()
               if corpus.get("layer") == LAYER and corpus.get("dim") == HIDDEN)
    table = pq.read_table(snapshot_file(key), columns=["id", "set", "output_tokens", "feature"])
    domains = {}
    for name in names:
        rows = table.filter(pc.equal(table.column("set"), name))
        features = rows.column("feature").combine_chunks()
        matrix = features.values.to_numpy(zero_copy_only=False).reshape(-1, HIDDEN).astype(np.float32)
        domains[name] = Domain(name, np.asarray(rows.column("id").to_pylist(), dtype=object), matrix,
                               rows.column("output_tokens").to_numpy().astype(np.int64))
    return domains


def replica_config(**leap):
    """`engine_config` for a runtime that captures SmolLM2's layer 22 (576 floats), the snapshot's space."""
    config = engine_config(layer=LAYER, **leap)
    config.model_config.hf_text_config.hidden_size = HIDDEN
    config.model_config.hf_text_config.num_hidden_layers = LAYERS
    return config


def readout_metadata(version: str) -> dict:
    return {"model_id": MODEL, "layer": LAYER, "version": version}


class Traffic:
    """Sends a domain's rows through a runtime as finished requests, each with its true output length."""

    def __init__(self, runtime) -> None:
        from serving.capture.hidden_states import FeatureSender

        self.runtime = runtime
        self.sender = FeatureSender(runtime.config.channel)
        self.sent = 0
        self.step = 0

    def serve(self, domain: Domain, batch: int = 16) -> int:
        """Every row of `domain`, `batch` at a time: admitted, captured, predicted, finished."""
        from vllm import SamplingParams
        from vllm.v1.request import Request, RequestStatus

        runtime = self.runtime
        for start in range(0, len(domain.ids), batch):
            part = domain.part(start, start + batch)
            requests = []
            for row_id in part.ids:
                self.sent += 1
                extra = {"leap_request_id": f"{row_id}-{self.sent}", "leap_domain": domain.name}
                requests.append(Request(f"{row_id}-{self.sent}-00000001", [1, 2, 3, 4],
                                        SamplingParams(max_tokens=MAX_TOKENS, extra_args=extra), None,
                                        arrival_time=time.time()))
            runtime.before_schedule(requests, self.step)  # prefill: tracked
            self.step += 1
            self.sender.send([r.request_id for r in requests], part.features)
            if not eventually(lambda requests=requests: all(r.request_id in runtime.tracker.predictions
                                                            for r in requests)):
                raise AssertionError(f"no prediction for {len(requests)} requests of {domain.name}")
            for request, length in zip(requests, part.lengths):
                request.num_computed_tokens = request.num_prompt_tokens + int(length) - 1
                request.append_output_token_ids([7] * int(length))
                request.status = (RequestStatus.FINISHED_LENGTH_CAPPED if length >= MAX_TOKENS
                                  else RequestStatus.FINISHED_STOPPED)
                runtime.on_finished(request)
        return len(domain.ids)
