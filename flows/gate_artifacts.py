"""The gate's verdict where a reviewer of the pipeline looks: artifacts of the gate flow's run in Prefect.

Each gate flow run publishes its verdict as a markdown artifact and as a table artifact, under stable keys
so the Prefect UI shows every verdict of the pipeline as the versions of one artifact. Both come from the
report the challenger's MLflow version carries (`registry.gate_report.verdict_report`), so the two pages
say the same thing; the markdown links to the version's MLflow page when the registry is a server.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from registry.gate_report import verdict_report

VERDICT_KEY = "leap-gate-verdict"
"""The markdown artifact of every gate flow run: the verdict report with its title."""
FIGURES_KEY = "leap-gate-figures"
"""The table artifact of every gate flow run: the same report's (figure, value) rows."""


def version_page(tracking_uri: str | None, name: str, version: str) -> str | None:
    """The MLflow UI's page of a model version, for a registry served over HTTP (without any account in
    the address); None for a database or file registry, which has no page."""
    parts = urlsplit(str(tracking_uri or ""))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    host = parts.hostname if parts.port is None else f"{parts.hostname}:{parts.port}"
    base = urlunsplit((parts.scheme, host, parts.path.rstrip("/"), "", ""))
    return f"{base}/#/models/{quote(name, safe='')}/versions/{quote(str(version), safe='')}"


@task(name="publish-gate-verdict", cache_policy=NO_CACHE)
def publish_gate_verdict(name: str, challenger: str, champion: str | None, verdict: Mapping[str, Any],
                         tracking_uri: str | None = None) -> dict[str, str]:
    """Publish `verdict` of `challenger` (against `champion`) as this flow run's markdown and table
    artifacts; returns their ids."""
    report = verdict_report(verdict, champion, subject=f"{name} v{challenger}")
    markdown = report.markdown("## ")
    page = version_page(tracking_uri, name, challenger)
    if page is not None:
        markdown += f"\n\n[{name} v{challenger} in MLflow]({page})"
    markdown_id = create_markdown_artifact(markdown=markdown, key=VERDICT_KEY, description=report.summary())
    table_id = create_table_artifact(table=report.rows, key=FIGURES_KEY, description=report.summary())
    return {"markdown": str(markdown_id), "table": str(table_id)}
