"""LEAP's serving settings, one pydantic model shared by the scheduler and worker processes.

vLLM hands the same `VllmConfig` to the engine-core process (scheduler) and to every worker, so the
settings travel in `additional_config["leap"]`. Fields not given there fall back to `LEAP_*`
environment variables, so stock `vllm serve --scheduler-cls ...` can be configured without code.
Assignments are validated too (`configure` switches the policy of a running engine).

A policy name says two things: the decode order (`decode_order`: FCFS, or countdown by predicted
remaining length) and where the predicted length comes from (`length_source`):

- "fcfs": arrival order, no prediction used;
- "leap": countdown on the readout's (or a served evaluation predictor's) predictions;
- "oracle": countdown on the true length the client sent (`leap_oracle_length`), for evaluation;
- "client": countdown on the length the client predicted (`leap_predicted_length`);
- a name registered with `register_predictor_policy` (the evaluation heads served with
  `LeapRuntime.serve_predictor`): like "leap", with its name recorded in the feedback rows.

`order` ("countdown" | "gittins", LEAP_ORDER) chooses how the predictor-based policies ("leap" and the
registered ones) rank by their predictions: countdown by predicted remaining length, or the Gittins index
of the remaining length under the serving readout's length distribution (`leap_core.gittins`; countdown
while the readout carries none, see `serving.decode_steps`). "oracle" and "client" always count down.

Refresh (`refresh_at` with `refresh_readout_path`, serving/refresh.py) is off unless both are set.
"""

from __future__ import annotations

import os
import tempfile
from typing import Annotated, Any, Literal, get_args

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

POLICIES = ("fcfs", "leap", "oracle", "client")
Order = Literal["countdown", "gittins"]
ORDERS: tuple[str, ...] = get_args(Order)
_PREDICTOR_POLICIES: set[str] = set()


def register_predictor_policy(name: str) -> str:
    """Allow `name` as a policy: countdown on the predictions of a predictor served under that name."""
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"a policy name is letters, digits, '-' and '_', not {name!r}")
    if name not in POLICIES:
        _PREDICTOR_POLICIES.add(name)
    return name


def _default_champion_location() -> str | None:
    from leap_io.champion import default_location

    return default_location()


def known_policies() -> tuple[str, ...]:
    return (*POLICIES, *sorted(_PREDICTOR_POLICIES))


class LeapConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LEAP_", extra="ignore", validate_assignment=True)

    policy: str = Field("leap", description="fcfs | leap | oracle | client, or a registered evaluation predictor")
    readout_path: str | None = Field(None, description="leap_core readout file served at start")
    rls_state_path: str | None = Field(None, description="RLS anchor (theta, P) saved with the readout")
    layer: int | None = Field(None, description="decoder layer to capture; default: the readout's layer")
    recipe: str | None = Field(None, description="feature recipe to capture (leap_core.recipes), e.g. "
                                                 "last@17+mean@17; default: every candidate of `recipes` and the "
                                                 "readout's recipe together")
    # NoDecode: the environment gives "last@22,last@17+mean@17", not JSON
    recipes: Annotated[tuple[str, ...], NoDecode] = Field(
        (), description="candidate recipes the fit flow chooses among (LEAP_RECIPES, comma-separated): the "
                        "engine captures all of them, so its feedback rows serve every candidate")
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
        0.5, gt=0.0, le=1.0, description="most of the last rls_tenant_window label rows one tenant (leap_tenant) "
                                         "may teach RLS while more than one tenant sends, and most of the weight "
                                         "one tenant carries in the quality figures the drift watch judges; "
                                         "None: no cap (serving/tenant_share.py)")
    rls_tenant_window: int = Field(256, ge=1, description="label rows the tenant cap looks back over")
    fcfs_below_spearman: float | None = Field(
        None, ge=-1.0, le=1.0, description="fall back to FCFS by itself when the live Spearman of prediction "
                                           "against true length drops below this (serving/fcfs_fallback.py); "
                                           "None: only by command")
    fcfs_min_rows: int = Field(128, ge=16, le=256, description="finished requests the live Spearman must be "
                                                              "over before the fallback may act")
    ready_wait_ms: float = Field(200.0, ge=0.0, description="longest wait for a missing prediction")
    feedback_dir: str | None = Field(None, description="folder of feedback segments; None: no feedback")
    segment_max_rows: int = Field(5000, ge=1)
    segment_max_seconds: float = Field(300.0, gt=0.0)
    feedback_url: str | None = Field(None, description="s3://bucket/prefix: closed segments are shipped from "
                                                       "feedback_dir to <prefix>/<replica id>/ and deleted "
                                                       "locally once verified; None: they stay in feedback_dir")
    s3_endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto); None: AWS. "
                                                          "Credentials: the AWS_* variables")
    admin_host: str = "127.0.0.1"
    admin_port: int | None = Field(None, description="admin API port; None: no admin server")
    admin_token: str | None = Field(None, description="admin token; else LEAP_ADMIN_TOKEN_FILE")
    admin_token_file: str | None = None
    channel: str | None = Field(None, description="capture channel address; default from the instance id")
    state_dir: str | None = Field(None, description="folder where every accepted push is kept and restored "
                                                    "from at start; None: pushes are not persisted")
    registry_uri: str | None = Field(None, description="MLflow tracking URI whose champion serves at start "
                                                       "when state_dir holds no push")
    registry_model: str | None = Field(None, description="registered model name; default "
                                                         "leap-readout-<model id>-L<layer>")
    champion_url: str | None = Field(
        default_factory=lambda: _default_champion_location(),
        description="folder or s3://bucket/prefix where promotions publish the champion (leap_io.champion), "
                    "served at start when newer than state_dir's push; default $LEAP_CHAMPION_URL, else "
                    "$LEAP_HOME/champion when LEAP_HOME is set; an empty string: off")
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
    # NoDecode: the environment gives "16,32,64", not JSON; `_checkpoints_from_text` parses it
    refresh_at: Annotated[tuple[int, ...], NoDecode] = Field(
        (), description="generated counts at which a decoding request's remaining length is re-estimated "
                        "(LEAP_REFRESH_AT=16,32,64); empty: countdown on the prefill prediction only")
    refresh_readout_path: str | None = Field(None, description="leap_core readout fitted on decode states to the "
                                                               "remaining length, at the serving layer")

    @field_validator("refresh_at", "recipes", mode="before")
    @classmethod
    def _list_from_text(cls, value: Any) -> Any:
        """"16,32,64" or "last@22,last@17" (the environment's form) as a sequence; other forms go to
        pydantic unchanged."""
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("refresh_at")
    @classmethod
    def _increasing_checkpoints(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(g < 1 for g in value):
            raise ValueError(f"refresh_at counts generated tokens and must be >= 1, got {value}")
        if any(later <= earlier for earlier, later in zip(value, value[1:])):
            raise ValueError(f"refresh_at must be strictly increasing, got {value}")
        return value

    @field_validator("recipe")
    @classmethod
    def _parsed_recipe(cls, value: str | None) -> str | None:
        from leap_core.recipes import Recipe

        return None if value is None else str(Recipe.parse(value))

    @field_validator("recipes")
    @classmethod
    def _parsed_recipes(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        from leap_core.recipes import Recipe

        return tuple(str(Recipe.parse(name)) for name in value)

    @field_validator("feedback_url")
    @classmethod
    def _object_url(cls, value: str | None) -> str | None:
        from leap_io.object_store import parse_s3_url

        return None if value is None or not value.strip() else str(parse_s3_url(value))

    @field_validator("s3_endpoint_url")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        from leap_io.object_store import check_endpoint

        return check_endpoint(value)

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in POLICIES and value not in _PREDICTOR_POLICIES:
            raise ValueError(f"unknown policy {value!r}; expected one of {known_policies()}")
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

    @property
    def decode_order(self) -> Literal["fcfs", "countdown", "gittins"]:
        """The `leap_core.policy.make_policy` name of this policy's decode order: `order` for policies that
        rank by the predictor, countdown for the oracle's and the client's lengths, FCFS for "fcfs"."""
        if self.policy == "fcfs":
            return "fcfs"
        return self.order if self.length_source == "predicted" else "countdown"

    @property
    def length_source(self) -> Literal["none", "predicted", "oracle", "client"]:
        """Where a request's predicted total length comes from under this policy."""
        if self.policy in ("fcfs", "oracle", "client"):
            return "none" if self.policy == "fcfs" else self.policy
        return "predicted"

    @property
    def refresh_configured(self) -> bool:
        """Whether both refresh settings are given; the runtime still checks the readout before it serves."""
        return bool(self.refresh_at) and bool(self.refresh_readout_path)

    def token(self) -> str | None:
        if self.admin_token:
            return self.admin_token
        if self.admin_token_file and os.path.isfile(self.admin_token_file):
            return open(self.admin_token_file).read().strip() or None
        return None


def leap_config_from_vllm(vllm_config: Any) -> LeapConfig:
    """Read LEAP's settings from `additional_config["leap"]`, falling back to the environment."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    values = dict(extra.get("leap", {})) if isinstance(extra, dict) else {}
    return LeapConfig(**values)


def channel_address(vllm_config: Any, config: LeapConfig) -> str:
    """The ipc address workers push captured features to; unique per engine instance."""
    if config.channel:
        return config.channel
    instance = getattr(vllm_config, "instance_id", "") or str(os.getpid())
    return f"ipc://{tempfile.gettempdir()}/leap-capture-{instance}.sock"
