"""LEAP's settings: the one class that reads `LEAP_*` environment variables.

Every process of the loop (serving plugin, `leap serve`, flows, local stack, registry and push clients)
reads the same variables through `LeapSettings` (`read_settings()`), so each setting has one name, one
type and one default, and a bad value fails at read time naming the variable. No other module reads a
`LEAP_*` variable (tests/test_settings_single_source.py checks it). `ServingSection` is what one serving
process does (`serving.config.LeapConfig` is it as a plain model); `LeapSettings` adds the state folder,
store, registry, gate, fit, canary, drift and stack settings, with unset paths derived from `LEAP_HOME`
as infra/README.md documents.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, Field, PrivateAttr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from leap_core.gate_verdict import MARGIN, P95_BOUND
from leap_io.admin_client import TOKEN_FILE_NAME, AdminTokens, create_token_file, read_token_folder
from leap_io.pidfiles import service_pid
from leap_io.s3_locations import check_endpoint, parse_s3_url

ENV_PREFIX = "LEAP_"
STACK_ADMIN_PORT = 8011
"""The admin port of the local stack's serving replica (the next replicas' are 8012, ...)."""
GATE_BLOCKS = 2
"""Disjoint request blocks the gate replays by default, one a repeat (harness.gate_replay.BLOCKS)."""

POLICIES = ("fcfs", "leap", "oracle", "client")
Order = Literal["countdown", "gittins"]
ORDERS: tuple[str, ...] = get_args(Order)

STACK_FOLDER = "stack"
"""The local stack's pid files, logs and fleet files, under the state folder."""


def _split(value: Any) -> Any:
    """"a,b,c" or a JSON list (the environment's forms) as a list; other forms go to pydantic unchanged."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        return json.loads(text)
    return [item.strip() for item in text.split(",") if item.strip()]


class ServingSection(BaseModel):
    """The settings of one serving process (`serving.config.LeapConfig`)."""

    policy: str = Field("leap", description="fcfs | leap | oracle | client, or a registered evaluation predictor")
    readout_path: str | None = Field(None, description="leap_core readout file served at start")
    rls_state_path: str | None = Field(None, description="RLS anchor (theta, P) saved with the readout")
    layer: int | None = Field(None, description="decoder layer to capture, and the layer the fit flow fits; "
                                                "default: the readout's (serving), the latest seen (fit)")
    recipe: str | None = Field(None, description="feature recipe to capture (leap_core.recipes), e.g. "
                                                 "last@17+mean@17; default: every candidate of `recipes` and the "
                                                 "readout's recipe together")
    # NoDecode: the environment gives "last@22,last@17+mean@17", not JSON
    recipes: Annotated[tuple[str, ...], NoDecode] = Field(
        (), description="candidate feature recipes, comma-separated or a JSON list (e.g. "
                        "'last@17,last@17+mean@17+prompt'): the fit validates those the rows' capture recipe "
                        "covers on the newest training rows and fits the best, and the engine captures all of "
                        "them, so its feedback rows serve every candidate; empty: the capture recipe, no choice")
    capture_all_layers: bool = Field(False, description="capture every decoder layer (layer study, not serving)")
    max_resident: int = Field(512, ge=1, description="R: requests kept resident (vLLM max_num_seqs)")
    decode_slots: int = Field(64, ge=1, description="K: requests decoded per step (the most, when adaptive)")
    adaptive_slots: bool = Field(
        False, description="choose K each step (LEAP_ADAPTIVE_SLOTS, `leap serve --adaptive-slots`): the fewest decode "
                           "slots that keep the engine's measured step time ahead of the demand by slot_margin, all "
                           "of them on a flat step-time curve (leap_core/decode_slots.py); off by default: in the simulator it "
                           "never beat fixed K on this CPU's step-time curve")
    slot_margin: float = Field(1.0, ge=0.0, le=10.0, description="how far the service rate of the chosen K stays "
                                                                "ahead of the demand (1.0: twice the demand)")
    waiting_cap: int = Field(128, ge=1, description="C: steps a resident request may be held out")
    aging: float = Field(0.0, ge=0.0, description="exponential aging strength (0: plain countdown)")
    wait_aging: float = Field(
        0.0, ge=0.0, le=100.0, description="the tail guard (LEAP_WAIT_AGING): aging by every step a request waited "
                                           "over its predicted remaining length, HRRN-style, for either order "
                                           "(0: none; `leap eval tail` and the load study choose it)")
    order: Order = Field(
        "countdown", description="how predictor-based policies rank (LEAP_ORDER): countdown by predicted remaining "
                                 "length, or gittins: the Gittins index of the remaining length under the serving "
                                 "readout's length distribution (countdown while the readout carries none)")
    rls: bool = Field(True, description="correct the readout online from finished requests")
    rls_every: int = Field(8, ge=1, description="finished requests per RLS publish")
    rls_learns_forced_lengths: bool = Field(
        False, description="let RLS learn lengths a request forced (ignore_eos, min_tokens, a max_tokens below the "
                           "readout's budget): only for replays that force recorded true lengths, never for clients")
    rls_forgetting: float = Field(1.0, gt=0.0, le=1.0)
    rls_tenant_max_share: float | None = Field(
        0.5, gt=0.0, le=1.0, description="most of the last rls_tenant_window label rows one tenant (the caller's) "
                                         "may teach RLS while more than one tenant sends, and most of the weight "
                                         "one tenant carries in the quality figures the drift watch judges; "
                                         "None: no cap (serving tenant_share)")
    rls_tenant_window: int = Field(256, ge=1, description="label rows the tenant cap looks back over")
    tenant_keys_file: str | None = Field(
        None, description="JSON file mapping the SHA-256 (hex) of each API key callers send as a bearer token to "
                          "its tenant (serving/caller_tenant.py); the API front end sets that tenant and drops "
                          "any leap_tenant a client sends")
    tenant_header: str | None = Field(
        None, description="HTTP header naming the caller's tenant, set by a trusted gateway that strips it from "
                          "clients (e.g. x-leap-tenant); used when no tenant key matches. Unset: not read")
    fcfs_below_spearman: float | None = Field(
        None, ge=-1.0, le=1.0, description="fall back to FCFS by itself when the live Spearman of prediction "
                                           "against true length drops below this (serving/fcfs_fallback.py); "
                                           "None: only by command")
    fcfs_min_rows: int = Field(128, ge=16, le=256, description="finished requests the live Spearman must be "
                                                              "over before the fallback may act")
    ready_wait_ms: float = Field(200.0, ge=0.0, description="longest wait for a missing prediction")
    feedback_dir: str | None = Field(None, description="folder of feedback segments: a serving process writes "
                                                       "them there (unset: none), the ingest flow reads them "
                                                       "(unset: <home>/feedback)")
    segment_max_rows: int = Field(5000, ge=1)
    segment_max_seconds: float = Field(300.0, gt=0.0)
    feedback_url: str | None = Field(None, description="feedback in object storage, s3://bucket/prefix: closed "
                                                       "segments are shipped from feedback_dir to "
                                                       "<prefix>/<replica id>/ and deleted locally once verified, "
                                                       "and the ingest flow reads them there; None: they stay in "
                                                       "feedback_dir")
    s3_endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto); None: AWS. "
                                                          "Credentials: the AWS_* variables")
    admin_host: str = "127.0.0.1"
    admin_port: int | None = Field(None, ge=0, le=65535,
                                   description="admin API port of a serving process (unset: no admin server); "
                                               "the local stack's replica's and the default push endpoint's "
                                               f"(unset: {STACK_ADMIN_PORT})")
    admin_token: str | None = Field(None, description="admin token; else read from admin_token_file")
    admin_token_file: str | None = Field(None, description="file of the admin token (unset: <home>/admin.token "
                                                           "in the pipeline, created once; none in a serving process)")
    channel: str | None = Field(None, description="capture channel address; default from the instance id")
    state_dir: str | None = Field(None, description="folder where every accepted push is kept and restored "
                                                    "from at start; None: pushes are not persisted")
    registry_uri: str | None = Field(None, description="MLflow tracking URI whose champion serves at start "
                                                       "when state_dir holds no push; unset: none in a serving "
                                                       "process, the pipeline's registry under `leap serve` "
                                                       "(LeapSettings.serving_registry_uri)")
    registry_model: str | None = Field(None, description="registered model name; default "
                                                         "leap-readout-<model id>-L<layer>")
    champion_url: str | None = Field(
        None, description="folder or s3://bucket/prefix where promotions publish the champion (leap_io.champion), "
                          "served at start when newer than state_dir's push; unset: <home>/champion (a serving "
                          "process: only when LEAP_HOME is set); an empty string: off")
    champion_public_key: str | None = Field(
        None, description="PEM file of the Ed25519 public key a published champion must be signed with "
                          "(leap_io.signing; LEAP_CHAMPION_PUBLIC_KEY); None: publications are not checked "
                          "for a signature")
    queue_max: int = Field(65_536, ge=1, description="longest predictor / RLS queue; beyond it items are "
                                                     "dropped and counted")
    finished_memory: int = Field(65_536, ge=1, description="recently finished ids remembered to drop their "
                                                           "late features and predictions")
    orphan_ttl_s: float = Field(120.0, gt=0.0, description="how long a feature or prediction may wait for its "
                                                           "request to become resident")
    @field_validator("recipes", mode="before")
    @classmethod
    def _list_from_text(cls, value: Any) -> Any:
        return _split(value)

    @field_validator("recipe")
    @classmethod
    def _parsed_recipe(cls, value: str | None) -> str | None:
        from leap_core.recipes import Recipe

        return None if value is None else str(Recipe.parse(value))

    @field_validator("recipes")
    @classmethod
    def _parsed_recipes(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        """Each candidate by its canonical name (`leap_core.recipes.Recipe.parse`), once; a bad one fails here."""
        from leap_core.recipes import Recipe

        return tuple(dict.fromkeys(str(Recipe.parse(name)) for name in value))

    @field_validator("feedback_url")
    @classmethod
    def _object_url(cls, value: str | None) -> str | None:
        return None if value is None or not value.strip() else str(parse_s3_url(value))

    @field_validator("s3_endpoint_url")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        return check_endpoint(value)

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in POLICIES:
            raise ValueError(f"unknown policy {value!r}; expected one of {POLICIES}")
        return value

    @field_validator("aging", "order")
    @classmethod
    def _aging_is_countdowns(cls, value: Any, info: ValidationInfo) -> Any:
        """Aging is countdown's alone; checked on either field, so an assignment to one is refused as well."""
        aging = value if info.field_name == "aging" else info.data.get("aging")
        order = value if info.field_name == "order" else info.data.get("order")
        if order == "gittins" and aging:
            raise ValueError(f"aging ({aging}) applies to the countdown order only; the gittins order has none "
                             "(set aging to 0, or order to countdown)")
        return value


class LeapSettings(ServingSection, BaseSettings):
    """Every `LEAP_*` setting: where the loop keeps its state, how it serves, fits, gates and watches."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    # ------------------------------------------------------------------ the state folder and its places
    home: Path = Field(Path(".leap"), description="state folder ($LEAP_HOME), resolved when read")
    duckdb_path: Path | None = Field(None, description="log store (default <home>/leap.duckdb)")
    mlflow_tracking_uri: str | None = Field(
        None, description="default: the stack's MLflow server while it runs, else sqlite under <home>/mlflow")
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
    replicas: int = Field(1, ge=1, description="serving replicas the local stack starts (`leap stack up --fleet`)")
    endpoints: Annotated[list[str] | None, NoDecode] = Field(
        None, description="admin URLs of the serving replicas, comma-separated or a JSON list "
                          "(default: the local stack's admin port; an empty string: push nowhere)")
    admin_tokens_dir: str | None = Field(
        None, description="folder of each replica's own admin token, one file named by its admin address "
                          "(host_port or host), e.g. a mounted Secret; a replica it does not name gets the "
                          "shared token (admin_token, admin_token_file)")

    # ------------------------------------------------------------------ this process
    replica_id: str | None = Field(None, description="this serving replica's id, naming its feedback segments "
                                                     "and their object-storage prefix (default: host and port)")
    capture: bool = Field(False, description="install LEAP's capture in every vLLM worker (serving/plugin.py)")
    allow_unknown_vllm: bool = Field(False, description="start on a vLLM version LEAP was not tested with")
    shared: Path | None = Field(None, description="folder of shared datasets and models (harness.datasets); "
                                                  "default: the checkout's")
    champion_signing_key: str | None = Field(
        None, description="PEM file of the Ed25519 private key promotions sign the champion with "
                          "(leap_io.signing); None: publications are unsigned")

    # ------------------------------------------------------------------ the gate
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
    gate_blocks: int = Field(GATE_BLOCKS, ge=1, description="disjoint blocks of replay_slice held-out requests the "
                                                           "gate replays, repeat r the block r % gate_blocks "
                                                           "(gate_repeats a multiple of it): more distinct "
                                                           "requests in the same time")
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

    # ------------------------------------------------------------------ the fit
    model_fingerprint: str | None = Field(None, description="feature space to fit (default: the latest seen)")
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

    # ------------------------------------------------------------------ the registry and the push client
    mlflow_retries: int = Field(3, ge=0, description="retries of a failed MLflow call (backoff doubling "
                                                     "from mlflow_backoff_s), then the command fails")
    mlflow_backoff_s: float = Field(0.5, ge=0.0, description="first backoff between MLflow retries")
    mlflow_username: str | None = Field(None, description="the MLflow account of a server with authentication "
                                        "(basic-auth, infra/compose.yaml); its password is in mlflow_password_file")
    mlflow_password_file: Path | None = Field(None, description="file holding the MLflow account's password (a "
                                              "compose secret), read each time a registry client is made")
    push_retries: int = Field(3, ge=0, description="retries of a failed push to one replica")
    push_timeout_s: float = Field(30.0, gt=0.0)
    kill_switch_deadline_s: float = Field(120.0, ge=0.0, description="how long `leap fcfs` keeps retrying the "
                                                                    "replicas that did not answer (0: one try)")

    # ------------------------------------------------------------------ canary promotion (flows.canary)
    canary_window_s: float = Field(1800.0, gt=0.0, description="longest a canary waits for its rows before "
                                                               "it is rolled back (fails closed)")
    canary_min_rows: int = Field(64, ge=2, description="labelled rows each group (canaries, rest) needs before "
                                                       "the canary is judged")
    canary_poll_s: float = Field(30.0, gt=0.0, description="seconds between ingests while a canary runs")
    canary_ptl_bound: float = Field(0.05, ge=0.0, description="a canary whose mean PTL is surely more than this "
                                                              "fraction above the rest's is worse")

    # ------------------------------------------------------------------ the drift watch (flows.drift)
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

    # ------------------------------------------------------------------ the local stack
    stack_host: str = "127.0.0.1"
    mlflow_port: int = 5000
    prefect_port: int = 4200
    serving_port: int = 8000

    _given: frozenset[str] | None = PrivateAttr(default=None)

    @field_validator("endpoints", "domains", "targets", mode="before")
    @classmethod
    def _split_list(cls, value: Any) -> Any:
        return _split(value)

    @field_validator("duckdb_path", "gate_prompts", "model_path", "drift_state_path", "mlflow_password_file",
                     "shared", mode="before")
    @classmethod
    def _blank_path_is_unset(cls, value: Any) -> Any:
        """An empty variable leaves a path unset (not the current folder)."""
        return None if isinstance(value, str) and not value.strip() else value

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
    def _blocks_divide_repeats(self) -> LeapSettings:
        if self.gate_repeats % self.gate_blocks:
            raise ValueError(f"gate_blocks ({self.gate_blocks}) must divide gate_repeats ({self.gate_repeats}): "
                             "repeat r replays block r % gate_blocks, and every request as often")
        return self

    @model_validator(mode="after")
    def _derive_paths(self) -> LeapSettings:
        # pydantic-settings validates each assignment below again, which runs this again with the derived
        # fields in `model_fields_set`: what was given is what the first run saw
        if self._given is None:
            self._given = frozenset(self.model_fields_set)
        self.home = Path(self.home).resolve()
        if self.duckdb_path is None:
            self.duckdb_path = self.home / "leap.duckdb"
        if self.feedback_dir is None:
            self.feedback_dir = str(self.home / "feedback")
        if self.drift_state_path is None:
            self.drift_state_path = self.home / "drift" / "watch.json"
        if self.admin_token_file is None:
            self.admin_token_file = str(self.home / TOKEN_FILE_NAME)
        if self.champion_url is None:
            self.champion_url = str(self.home / "champion")
        if self.admin_port is None:
            self.admin_port = STACK_ADMIN_PORT
        if self.endpoints is None:
            self.endpoints = [f"http://{self.stack_host}:{self.admin_port}"]
        self.endpoints = [url.rstrip("/") for url in self.endpoints]
        if self.mlflow_tracking_uri is None:
            self.mlflow_tracking_uri = self._default_tracking_uri()
        return self

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> LeapSettings:
        """The settings `environ` gives (os.environ: as `LeapSettings()`; another mapping: its `LEAP_*` keys
        alone, as ops.fleet_env reads the environment it is about to extend)."""
        if environ is os.environ:
            return cls()
        upper = {key.upper(): value for key, value in environ.items()}
        return cls.model_validate({name: upper[ENV_PREFIX + name.upper()] for name in cls.model_fields
                                   if ENV_PREFIX + name.upper() in upper})

    # ------------------------------------------------------------------ what was given

    def given(self, name: str) -> bool:
        """Whether setting `name` was given (by its variable or a keyword), not left to its default."""
        if name not in type(self).model_fields:
            raise KeyError(f"no setting {name!r}")
        return name in (self._given or frozenset())

    def given_value(self, name: str) -> Any:
        """Setting `name` as given, or None when it was left to its default (a derived one included)."""
        return getattr(self, name) if self.given(name) else None

    def serving_values(self) -> dict[str, Any]:
        """The serving section's settings that were given, for `serving.config.LeapConfig`: a section field
        left unset keeps the serving default, except `champion_url`, <home>/champion when LEAP_HOME is given."""
        values = {name: getattr(self, name) for name in ServingSection.model_fields if self.given(name)}
        if "champion_url" not in values and self.given("home"):
            values["champion_url"] = str(self.home / "champion")
        return values

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

    def serving_registry_uri(self) -> str | None:
        """The registry whose champion `leap serve` serves at start: `registry_uri`, else a given
        `mlflow_tracking_uri`, else the one the pipeline commands (and `leap demo`) write by default: the
        stack's MLflow server while it runs, else the sqlite database under <home>/mlflow once one exists.
        None when there is none: the replica starts with no registry (FCFS until a push)."""
        given = self.registry_uri or self.given_value("mlflow_tracking_uri")
        if given:
            return given
        if service_pid(self.stack_dir, "mlflow") is not None:
            return self.mlflow_server_url
        return self.mlflow_sqlite_uri if (self.mlflow_dir / "mlflow.db").is_file() else None

    def _default_tracking_uri(self) -> str:
        if service_pid(self.stack_dir, "mlflow") is not None:
            return self.mlflow_server_url
        return self.mlflow_sqlite_uri

    def admin_tokens(self) -> AdminTokens:
        """The control plane's token for each replica: its own from `admin_tokens_dir`, else the shared one."""
        own = read_token_folder(self.admin_tokens_dir) if self.admin_tokens_dir else {}
        return AdminTokens(self.token(), own)

    def token(self) -> str:
        """The admin token: `LEAP_ADMIN_TOKEN`, else the token file, created with a random token once."""
        if self.admin_token:
            return self.admin_token
        path = Path(self.admin_token_file)
        if not path.exists():
            create_token_file(path)
        token = path.read_text().strip()
        if not token:
            raise ValueError(f"the admin token file {path} is empty")
        return token


def read_settings() -> LeapSettings:
    """The settings as the environment gives them now; a bad value raises pydantic's ValidationError, which
    names the setting (its variable is LEAP_ and the name in capitals)."""
    return LeapSettings()

