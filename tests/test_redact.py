"""Credentials never reach what a replica shows or logs."""

from __future__ import annotations

import time

import pytest

from leap_io.redact import redact_text, redact_url


def test_a_message_that_quotes_a_url_loses_its_password():
    message = "MlflowException: API request to http://leap:hunter2@mlflow:5000/api failed; retry postgresql://a:b@db"
    assert redact_text(message) == ("MlflowException: API request to http://leap:***@mlflow:5000/api failed; "
                                    "retry postgresql://a:***@db")


@pytest.mark.parametrize(("location", "shown"), [
    ("postgresql+psycopg://leap:hunter2@db:5432/leap", "postgresql+psycopg://leap:***@db:5432/leap"),
    ("http://admin:p%40ss@mlflow:5000", "http://admin:***@mlflow:5000"),
    ("https://s3.example/b/k?X-Amz-Signature=abc&X-Amz-Credential=AK&part=2",
     "https://s3.example/b/k?X-Amz-Signature=***&X-Amz-Credential=***&part=2"),
    ("http://mlflow:5000?token=t0ps3cret", "http://mlflow:5000?token=***"),
    ("http://user@mlflow:5000/", "http://user@mlflow:5000/"),
    ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
    ("s3://leap-feedback/replica-1", "s3://leap-feedback/replica-1"),
    ("/var/lib/leap/champion", "/var/lib/leap/champion"),
])
def test_passwords_and_secret_parameters_are_masked_and_the_rest_kept(location, shown):
    assert redact_url(location) == shown


def test_a_replica_shows_and_logs_its_registry_without_the_password(caplog):
    from serving.config import LeapConfig
    from serving.readout.service import ReadoutService
    from serving.readout.sources import ReadoutSources
    from serving.telemetry import Telemetry
    from serving.tracking import RequestTracker

    class Unreachable:  # the registry source the entry point would open; this one cannot reach its server
        def __init__(self, uri: str) -> None:
            raise ConnectionError(f"cannot reach {uri}")

    telemetry = Telemetry()
    config = LeapConfig(registry_uri="http://leap:hunter2@127.0.0.1:1")
    service = ReadoutService(config, {"layer": 1, "dim": 8}, RequestTracker(telemetry), telemetry).start()
    try:
        sources = ReadoutSources(service, telemetry, "m", 1, Unreachable)
        with caplog.at_level("WARNING"):
            sources.start()
            deadline = time.monotonic() + 10
            while sources.registry_status["state"] == "loading" and time.monotonic() < deadline:
                time.sleep(0.02)
        assert sources.registry_status["state"] == "failed"
        assert sources.registry_status["uri"] == "http://leap:***@127.0.0.1:1"
        assert "leap:***@127.0.0.1:1" in caplog.text and "hunter2" not in caplog.text
        assert "hunter2" not in repr(sources.describe()) and "ConnectionError" in sources.registry_status["error"]
    finally:
        service.close()
