"""Validation of a pushed readout: what a replica accepts to serve, and why it refuses the rest."""

from __future__ import annotations

from leap_core.readout import LinearReadout
from leap_core.readout_format import ReadoutFormatError, ReadoutMismatchError, from_bytes
from leap_core.rls import RLS
from leap_io.push_bundle import read_bundle
from serving.admin import PushRefused


def validate_push(body: bytes, expect: dict, current: LinearReadout | None) -> tuple[LinearReadout, RLS | None]:
    """The readout (and RLS anchor) a push carries, or PushRefused saying why it must not serve.

    `expect` names the model fingerprint, layer and dim of this replica; a readout already serving also
    fixes the target and the output budget M, since RLS and the scheduler work in that target's space.
    """
    readout_bytes, state = read_bundle(body)
    expect = dict(expect)
    if current is not None:
        expect.update(target=current.target, max_tokens=int(current.max_tokens))
    try:
        readout = from_bytes(readout_bytes, expect=expect)
    except ReadoutMismatchError as exc:
        raise PushRefused(f"refused: {exc}", 409) from exc
    except (ReadoutFormatError, ValueError) as exc:
        raise PushRefused(f"refused: not a valid readout: {exc}", 422) from exc
    if state is None:
        return readout, None
    try:
        return readout, RLS.from_state_arrays(readout, state)
    except Exception as exc:
        raise PushRefused(f"refused: RLS state does not fit the readout: {exc}", 422) from exc
