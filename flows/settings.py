"""Settings of the pipeline flows, the local stack and the push client, read from `LEAP_*` variables.

The names are shared with the serving process on purpose (`LEAP_HOME`, `LEAP_FEEDBACK_DIR`,
`LEAP_ADMIN_TOKEN_FILE`, `LEAP_LAYER`), so one environment configures both sides of the loop. Paths
left unset derive from the state folder; the MLflow URI points at the local stack's server while it
runs and at the sqlite file otherwise, so flows and the UI see the same registry either way.
"""

from __future__ import annotations

import json
import os
import secrets
import uuid
from pathlib import Path
from typing import Literal, Annotated, Any

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from harness.gate_replay import BLOCKS
from leap_core.gate_verdict import MARGIN, P95_BOUND
from leap_io.durable import fsync_dir, write_text_durably
from leap_io.paths import STACK_FOLDER, state_dir
from leap_io.pidfiles import service_pid


class PipelineSettings(BaseSettings):
    """Where the pipeline keeps its state, whom it pushes to and how strict its gate is."""

    model_config = SettingsConfigDict(env_prefix="LEAP_", extra="ignore")

    home: Path = Field(default_factory=state_dir, description="state folder ($LEAP_HOME)")
    duckdb_path: Path | None = Field(None, description="log store (default <home>/leap.duckdb)")
    mlflow_tracking_uri: str | None = Field(
        None, description="default: the stack's MLflow server while it runs, else sqlite under <home>/mlflow")
    feedback_dir: Path | None = Field(None, description="feedback segments (default <home>/feedback)")
    store_url: str | None = Field(
        None, description="the log store: None keeps the DuckDB file (duckdb_path, one writer at a time); "
                          "a postgresql+psycopg:// URL is a store several ingest workers write at once")
    feedback_retention_days: float | None = Field(
        None, ge=0, description="remove a feedback segment this many days after all its rows were ingested "
                                "(store.retention; unreadable, failed and changed segments are kept); None: keep all")
    feature_compact_below_rows: int | None = Field(
        20_000, ge=1, description="after each ingest into the DuckDB file, rewrite its feature files holding "
                                  "fewer rows than this into files of about 200,000 rows (store.compaction); "
                                  "None: never")
    registry_keep_versions: int | None = Field(
        20, ge=1, description="after each retrain, delete the registered versions (and their runs' artifacts) "
                              "that no alias names and that are not among the newest N (registry.retention); "
                              "None: keep all")
    ingest_workers: int = Field(
        2, ge=1, description="segments ingested at once by the ingest flow's mapped tasks on a PostgreSQL "
                             "store (the DuckDB file takes one writer: its ingest stays sequential)")
    feedback_url: str | None = Field(
        None, description="feedback in object storage, s3://bucket/prefix (each replica writes under "
                          "<prefix>/<replica id>/); None: the local feedback_dir")
    s3_endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint (MinIO, moto); None: AWS. Credentials: the AWS_* variables")
    replicas: int = Field(1, ge=1, description="serving replicas the local stack starts (`leap stack up --fleet`)")
    champion_url: str | None = Field(
        None, description="where promotions publish the champion for replicas that start later "
                          "(leap_io.champion): a folder or s3://bucket/prefix; default <home>/champion")
    endpoints: Annotated[list[str] | None, NoDecode] = Field(
        None, description="admin URLs of the serving replicas, comma-separated or a JSON list "
                          "(default: the local stack's admin port; an empty string: push nowhere)")
    admin_token: str | None = Field(None, description="admin token; else read from admin_token_file")
    admin_token_file: Path | None = Field(None, description="default <home>/admin.token, created once")

    gate_margin: float = Field(MARGIN, ge=0.0, lt=1.0,
                               description="challenger mean PTL must be this fraction below the bar's")
    gate_p95_bound: float = Field(P95_BOUND, gt=0.0,
                                  description="challenger P95 PTL of the longest quartile over the bar's: worse when "
                                              "its bootstrap interval lies above this")
    gate_repeats: int = Field(2, ge=1, description="replays of each arm, fresh arrivals each, order reversed "
                                                "each repeat (harness/gate_replay.py)")
    gate_on_no_difference: Literal["keep", "noninferior"] = Field(
        "keep", description="what an interval that shows no difference does: keep the champion, or promote a "
                            "challenger non-inferior within gate_noninferiority")
    gate_noninferiority: float = Field(0.02, ge=0.0, lt=1.0, description="how much slower (mean PTL ratio - 1) "
                                                                      "the interval's upper end may be for "
                                                                      "a non-inferior challenger")
    gate_shadow_min_rows: int = Field(64, ge=2, description="labelled rows a challenger held in shadow needs "
                                                            "before its live figures join the verdict "
                                                            "(flows/shadow.py)")
    replay_slice: int = Field(64, ge=4, description="requests a block of the gate replays under each arm")
    gate_blocks: int = Field(BLOCKS, ge=1, description="disjoint blocks of replay_slice held-out requests the gate "
                                                      "replays, repeat r the block r % gate_blocks (gate_repeats a "
                                                      "multiple of it): more distinct requests in the same time")
    replay_rate: float = Field(4.0, gt=0.0, description="Poisson arrivals per second of the gate replay when "
                                                       "gate_load is unset")
    gate_load: float | None = Field(1.2, gt=0.0, description="the gate's arrivals as a fraction of the engine's "
                                                            "FCFS capacity on the replayed requests (step clock)")
    gate_decode_slots: int = Field(8, ge=1, description="K of the gate's engine: the slice must queue for slots "
                                                       "for schedules to differ (harness/gate_replay.py)")
    replay_seed: int = 0
    gate_prompts: Path | None = Field(None, description="JSONL prompts of the gate (default: shipped prompts)")
    model_path: Path | None = Field(None, description="serving model folder (default: the prepared SmolLM2)")
    max_model_len: int = Field(4096, ge=64)

    model_fingerprint: str | None = Field(None, description="feature space to fit (default: the latest seen)")
    layer: int | None = None
    max_tokens: int | None = Field(None, ge=1, description="output budget M (default: the champion's, "
                                                           "else the largest max_tokens in the window)")
    train_window_hours: float | None = Field(None, gt=0.0, description="fit on the last N hours; None: all")
    train_max_rows: int | None = Field(
        200_000, ge=2, description="fit on at most about the newest N rows of the window (rows sharing the "
                                   "oldest kept arrival time all come along), so a fit's cost stops growing "
                                   "with history; None: the whole window")
    domains: Annotated[list[str] | None, NoDecode] = None
    min_rows: int = Field(200, ge=2)
    test_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    alpha: str = Field("auto", description="ridge penalty, or 'auto' for cross-validation")
    target: str = Field("sqrt", description="regression target of the readout (leap_core.targets.TARGETS)")
    targets: Annotated[list[str] | None, NoDecode] = Field(
        None, description="candidate regression targets, comma-separated or a JSON list (e.g. 'sqrt,log,rank,softbin'): "
                          "chosen with the recipe by the same validation while no champion fixes the target "
                          "(serving keeps the champion's); None: `target`, no choice")
    fit_anchor: Literal["none", "champion"] = Field(
        "none", description="'champion': the fit corrects the champion's RLS state with the window's rows "
                            "(one ridge solve on both) instead of fitting on the window alone")
    recipes: Annotated[list[str] | None, NoDecode] = Field(
        None, description="candidate feature recipes, comma-separated or a JSON list (e.g. "
                          "'last@17,last@17+mean@17+prompt'): the fit validates those the rows' capture "
                          "recipe covers on the newest training rows and fits the best; None: the capture "
                          "recipe, no choice")

    # read by registry.client.ReadoutRegistry from the same variables, so every process agrees
    mlflow_retries: int = Field(3, ge=0, description="retries of a failed MLflow call (backoff doubling "
                                                     "from mlflow_backoff_s), then the command fails")
    mlflow_backoff_s: float = Field(0.5, ge=0.0, description="first backoff between MLflow retries")
    mlflow_username: str | None = Field(None, description="the MLflow account of a server with authentication "
                                        "(basic-auth, infra/compose.yaml); its password is in mlflow_password_file")
    mlflow_password_file: Path | None = Field(None, description="file holding the MLflow account's password (a "
                                              "compose secret), read each time a registry client is made")
    push_retries: int = Field(3, ge=0, description="retries of a failed push to one replica")
    push_timeout_s: float = Field(30.0, gt=0.0)

    # canary promotion (flows.canary): N replicas first, compared with the rest over one window
    canary_window_s: float = Field(1800.0, gt=0.0, description="longest a canary waits for its rows before "
                                                               "it is rolled back (fails closed)")
    canary_min_rows: int = Field(64, ge=2, description="labelled rows each group (canaries, rest) needs before "
                                                       "the canary is judged")
    canary_poll_s: float = Field(30.0, gt=0.0, description="seconds between ingests while a canary runs")
    canary_ptl_bound: float = Field(0.05, ge=0.0, description="a canary whose mean PTL is surely more than this "
                                                              "fraction above the rest's is worse")

    # the drift watch (flows.drift): when live quality calls for a retrain, an RLS reset or a rollback
    drift_margin: float = Field(0.25, gt=0.0, description="retrain when live MAE exceeds the champion's "
                                "validation MAE by this fraction (and roll back when the champion's anchor "
                                "MAE exceeds the previous champion's live one by it)")
    drift_rls_margin: float = Field(0.10, ge=0.0, description="reset a replica's RLS to its anchor when the "
                                    "corrected readout's MAE exceeds the anchor's by this fraction")
    drift_window: int = Field(3, ge=1, description="consecutive observations that must all show it")
    drift_min_rows: int = Field(64, ge=2, description="finished requests each observation must be over")
    drift_cooldown_s: float = Field(3600.0, ge=0.0, description="no second retrain (reset of one replica, "
                                    "rollback) within this many seconds of the last")
    drift_rollback_gate: bool = Field(True, description="a fleet-wide rollback first replays the gate: the "
                                      "previous champion (as challenger) against the champion, and rolls back "
                                      "only when it is no slower within gate_noninferiority and spares long "
                                      "requests")
    drift_scrape_timeout_s: float = Field(5.0, gt=0.0)
    drift_history: int = Field(64, ge=1, description="observations kept per replica and domain")
    drift_state_path: Path | None = Field(None, description="the watch's state (default <home>/drift/watch.json)")
    drift_retrain_deployment: str | None = Field(
        None, description="run this retrain deployment (e.g. leap-retrain/hourly) on drift, under its "
                          "concurrency limit; None: the retrain flow runs in the watch")
    drift_interval_s: float = Field(300.0, gt=0.0, description="seconds between watches (`leap watch`)")

    stack_host: str = "127.0.0.1"
    mlflow_port: int = 5000
    prefect_port: int = 4200
    serving_port: int = 8000
    admin_port: int = 8011

    @field_validator("endpoints", "domains", "recipes", "targets", mode="before")
    @classmethod
    def _split_list(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [item.strip() for item in text.split(",") if item.strip()]

    @field_validator("recipes", mode="after")
    @classmethod
    def _parse_recipes(cls, value: list[str] | None) -> list[str] | None:
        """Each candidate by its canonical name (`leap_core.recipes.Recipe.parse`); a bad one fails here."""
        if value is None:
            return None
        from leap_core.recipes import Recipe

        names = list(dict.fromkeys(str(Recipe.parse(item)) for item in value))
        return names or None

    @field_validator("target", mode="after")
    @classmethod
    def _known_target(cls, value: str) -> str:
        from leap_core.targets import check_target

        return check_target(value)

    @field_validator("targets", mode="after")
    @classmethod
    def _known_targets(cls, value: list[str] | None) -> list[str] | None:
        from leap_core.targets import check_target

        return list(dict.fromkeys(check_target(str(item)) for item in value)) or None if value is not None else None

    @model_validator(mode="after")
    def _blocks_divide_repeats(self) -> PipelineSettings:
        if self.gate_repeats % self.gate_blocks:
            raise ValueError(f"gate_blocks ({self.gate_blocks}) must divide gate_repeats ({self.gate_repeats}): "
                             "repeat r replays block r % gate_blocks, and every request as often")
        return self

    @model_validator(mode="after")
    def _derive_paths(self) -> PipelineSettings:
        self.home = Path(self.home).resolve()
        if self.duckdb_path is None:
            self.duckdb_path = self.home / "leap.duckdb"
        if self.feedback_dir is None:
            self.feedback_dir = self.home / "feedback"
        if self.drift_state_path is None:
            self.drift_state_path = self.home / "drift" / "watch.json"
        if self.admin_token_file is None:
            self.admin_token_file = self.home / "admin.token"
        if self.champion_url is None:
            self.champion_url = str(self.home / "champion")
        if self.endpoints is None:
            self.endpoints = [f"http://{self.stack_host}:{self.admin_port}"]
        self.endpoints = [url.rstrip("/") for url in self.endpoints]
        if self.mlflow_tracking_uri is None:
            self.mlflow_tracking_uri = self._default_tracking_uri()
        return self

    # ------------------------------------------------------------------ derived places

    @property
    def mlflow_dir(self) -> Path:
        return self.home / "mlflow"

    @property
    def alias_lock_path(self) -> Path:
        """The file lock every alias writer of this host takes (next to the sqlite registry)."""
        return self.mlflow_dir / "aliases.lock"

    @property
    def alias_lock_location(self) -> str:
        """The lock every alias writer takes: in the PostgreSQL log store when the fleet shares one (an
        advisory lock every host reaches, `registry.locking.PostgresAliasLock`), else `alias_lock_path`."""
        if self.store_url and self.store_url.startswith(("postgresql://", "postgresql+psycopg://")):
            return self.store_url
        return str(self.alias_lock_path)

    @property
    def promotion_journal_dir(self) -> Path:
        """Where a promotion or rollback in flight records what it did, for whoever must undo it."""
        return self.home / "promotions"

    @property
    def mlflow_sqlite_uri(self) -> str:
        return f"sqlite:///{self.mlflow_dir / 'mlflow.db'}"

    @property
    def mlflow_server_url(self) -> str:
        return f"http://{self.stack_host}:{self.mlflow_port}"

    @property
    def prefect_api_url(self) -> str:
        return f"http://{self.stack_host}:{self.prefect_port}/api"

    @property
    def stack_dir(self) -> Path:
        return self.home / STACK_FOLDER

    def _default_tracking_uri(self) -> str:
        if service_pid(self.stack_dir, "mlflow") is not None:
            return self.mlflow_server_url
        return self.mlflow_sqlite_uri

    def resolved_model_path(self) -> Path:
        if self.model_path is not None:
            return Path(self.model_path)
        from harness.model_prep import DEFAULT_MODEL_ID

        return self.home / "models" / DEFAULT_MODEL_ID

    def token(self) -> str:
        """The admin token: `LEAP_ADMIN_TOKEN`, else the token file, created with a random token once."""
        if self.admin_token:
            return self.admin_token
        path = Path(self.admin_token_file)
        if not path.exists():
            _create_token_file(path)
        token = path.read_text().strip()
        if not token:
            raise ValueError(f"the admin token file {path} is empty")
        return token


def _create_token_file(path: Path) -> None:
    """A random admin token at `path`, readable by its owner alone from the first byte on.

    The token is written whole under another name and linked in: a reader never sees a half-written
    token, and of two processes creating it at once the first one's token stands (a link, unlike a
    rename, never replaces a file that exists).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    aside = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}")
    write_text_durably(aside, secrets.token_urlsafe(32), mode=0o600)
    try:
        os.link(aside, path)
    except FileExistsError:
        pass
    finally:
        aside.unlink()
    fsync_dir(path.parent)
