"""Reading a registered readout back: the readout file and the RLS state stored inside its model, alone
or as the push bundle a replica takes (`leap_io.push_bundle`)."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry import rls_file as rls_file_format
from registry.model import READOUT_FILE, RLS_STATE_FILE

if TYPE_CHECKING:
    from mlflow.entities.model_registry import ModelVersion

    from leap_core.readout import LinearReadout
    from leap_core.rls import RLS


class LoadingMixin:
    """Loading readouts and RLS states by version or alias (part of `registry.client.ReadoutRegistry`)."""

    client: Any
    tracking_uri: str

    def _resolve(self, name: str, alias_or_version: str | int) -> ModelVersion:
        text = str(alias_or_version)
        if text.isdigit():
            return self.client.get_model_version(name, text)
        return self.client.get_model_version_by_alias(name, text)

    def _download_model_file(self, name: str, alias_or_version: str | int, file_name: str,
                             folder: str) -> Path | None:
        import mlflow.artifacts

        source = self._resolve(name, alias_or_version).source
        artifact_dir = f"{source}/artifacts"
        listed = {Path(info.path).name for info in self.client.retry(
            lambda: mlflow.artifacts.list_artifacts(artifact_uri=artifact_dir, tracking_uri=self.tracking_uri),
            f"listing {artifact_dir}")}
        if file_name not in listed:
            return None
        return Path(self.client.retry(
            lambda: mlflow.artifacts.download_artifacts(artifact_uri=f"{artifact_dir}/{file_name}",
                                                        dst_path=folder, tracking_uri=self.tracking_uri),
            f"downloading {file_name} of {name}@{alias_or_version}"))

    def load_readout(self, name: str, alias_or_version: str | int,
                     expect: Mapping[str, Any] | None = None) -> LinearReadout:
        """The readout of a version or alias, validated against `expect` (model fingerprint, layer,
        ...) so a readout fitted on another model or layer is refused instead of mis-scheduling."""
        from leap_core.readout_format import from_bytes

        with tempfile.TemporaryDirectory(prefix="leap-readout-") as tmp:
            path = self._download_model_file(name, alias_or_version, READOUT_FILE, tmp)
            if path is None:
                raise FileNotFoundError(f"{name}@{alias_or_version} has no {READOUT_FILE}")
            return from_bytes(path.read_bytes(), expect=None if expect is None else dict(expect))

    def load_rls_state(self, name: str, alias_or_version: str | int,
                       readout: LinearReadout | None = None,
                       expect: Mapping[str, Any] | None = None) -> RLS | None:
        """The RLS corrector stored with a version (None when it was logged without one)."""
        from leap_core.rls import RLS

        with tempfile.TemporaryDirectory(prefix="leap-rls-") as tmp:
            path = self._download_model_file(name, alias_or_version, RLS_STATE_FILE, tmp)
            if path is None:
                return None
            arrays = rls_file_format.load(path)
        if readout is None:
            readout = self.load_readout(name, alias_or_version, expect=expect)
        return RLS.from_state_arrays(readout, arrays)

    def push_bundle(self, name: str, alias_or_version: str | int, *, force: bool = False,
                    expect: Mapping[str, Any] | None = None) -> tuple[bytes, str]:
        """The push bundle of a version or alias (its readout, refused unless it records `expect`, and
        its RLS state) and the readout's version, which the replica that takes it reports.

        `force` lets the bundle replace a newer readout on a replica (replicas refuse to go back to an
        older version otherwise): set for a rollback and for putting the previous champion back.
        """
        from leap_core.readout_format import to_bytes
        from leap_io.push_bundle import make_bundle

        readout = self.load_readout(name, alias_or_version, expect=expect)
        rls = self.load_rls_state(name, alias_or_version, readout=readout)
        bundle = make_bundle(to_bytes(readout), rls.state_arrays() if rls is not None else None, force=force)
        return bundle, str(readout.metadata.get("version", ""))
