"""The fleet stack (`leap stack up --fleet`): PostgreSQL, S3, MLflow and Prefect on them, a process work
pool with two workers and N serving replicas.

It runs on loopback the same parts the production shape runs on managed services (docs/infra.md), so
the fleet's behaviour can be exercised on one machine. The layout is written to
`<home>/stack/fleet.json` so later `leap stack` commands act on the same services, and the variables a
flow needs to reach the fleet to `<home>/stack/fleet.env`, which the `leap` command applies while the
fleet runs (`ops.fleet_env`; variables already set win).
"""

from __future__ import annotations

import json
import math
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from leap_io.durable import write_text_durably
from ops import servers
from ops.fleet_env import ENV_FILE, LAYOUT_FILE

if TYPE_CHECKING:
    from flows.settings import PipelineSettings
    from ops.service import Service

POOL = "leap"
WORKERS = 2
RETRAIN_DEPLOYMENT = "hourly"
RETRAIN_CRON = "0 * * * *"
DATABASES = ("mlflow", "prefect", "leap")
REPO_ROOT = Path(__file__).resolve().parents[1]
REPLICA_KV_CACHE_GIB = "1"
"""KV cache of each CPU replica (GiB): several vLLM CPU engines share this machine's memory."""
_ROLLING_GAUGES = {"leap:rolling_spearman": "spearman", "leap:rolling_mae_tokens": "mae"}
"""A replica's live figures: its per-domain gauges' series over every request (`domain="all"`)."""
_COUNTS = {"leap:finished_requests_total": "finished", "leap:predictions_total": "predictions"}


@dataclass(frozen=True)
class FleetLayout:
    """Where the fleet's services listen; fixed at `up --fleet` and kept in `<home>/stack/fleet.json`."""

    replicas: int
    postgres_port: int
    s3_port: int
    bucket: str = "leap"
    pool: str = POOL
    workers: int = WORKERS

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"replicas must be >= 0, not {self.replicas}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, not {self.workers}")
        if len(self.bucket) < 3:
            raise ValueError(f"bucket names need at least 3 characters, not {self.bucket!r}")


def layout_path(settings: PipelineSettings) -> Path:
    return settings.stack_dir / LAYOUT_FILE


def env_path(settings: PipelineSettings) -> Path:
    return settings.stack_dir / ENV_FILE


def read_layout(settings: PipelineSettings) -> FleetLayout | None:
    """The recorded layout, or None when the stack of this home is not a fleet (or the file is unreadable)."""
    try:
        data = json.loads(layout_path(settings).read_text())
        return FleetLayout(**{key: data[key] for key in FleetLayout.__dataclass_fields__ if key in data})
    except (OSError, ValueError, TypeError, KeyError):
        return None


def plan_layout(settings: PipelineSettings, replicas: int) -> FleetLayout:
    """The layout for `replicas`: the recorded ports are kept (the env file's URLs stay valid), new ones
    are free ports of the loopback interface."""
    previous = read_layout(settings)
    host = settings.stack_host
    postgres_port = previous.postgres_port if previous else servers.free_port(host)
    s3_port = previous.s3_port if previous else servers.free_port(host)
    layout = FleetLayout(replicas=replicas, postgres_port=postgres_port, s3_port=s3_port)
    ports = [settings.mlflow_port, settings.prefect_port, postgres_port, s3_port]
    for index in range(replicas):
        ports += replica_ports(settings, index)
    if len(set(ports)) != len(ports):
        raise ValueError(f"the fleet's ports collide ({sorted(ports)}): with {replicas} replicas the serving "
                         f"ports {settings.serving_port}+i and admin ports {settings.admin_port}+i must not "
                         f"overlap each other or the MLflow/Prefect ports")
    return layout


def write_layout(settings: PipelineSettings, layout: FleetLayout) -> None:
    settings.stack_dir.mkdir(parents=True, exist_ok=True)
    write_text_durably(layout_path(settings), json.dumps(asdict(layout), indent=2) + "\n")
    lines = [f"{key}={value}" for key, value in fleet_environment(settings, layout).items()]
    # it carries the AWS_* credentials: readable by this user alone
    write_text_durably(env_path(settings), "\n".join(lines) + "\n", mode=0o600)


def forget_layout(settings: PipelineSettings) -> None:
    layout_path(settings).unlink(missing_ok=True)
    env_path(settings).unlink(missing_ok=True)


# ---------------------------------------------------------------------------- addresses

def replica_id(index: int) -> str:
    return f"serving-{index}"


def replica_ports(settings: PipelineSettings, index: int) -> list[int]:
    """(OpenAI port, admin port) of replica `index`: the stack's ports plus the index."""
    return [settings.serving_port + index, settings.admin_port + index]


def admin_url(settings: PipelineSettings, index: int) -> str:
    return f"http://{settings.stack_host}:{settings.admin_port + index}"


def store_url(settings: PipelineSettings, layout: FleetLayout) -> str:
    return servers.postgres_url(layout.postgres_port, "leap", settings.stack_host)


def s3_endpoint(settings: PipelineSettings, layout: FleetLayout) -> str:
    return f"http://{settings.stack_host}:{layout.s3_port}"


def fleet_environment(settings: PipelineSettings, layout: FleetLayout) -> dict[str, str]:
    """The variables under which flows and CLI commands use the fleet (what `fleet.env` holds)."""
    endpoint = s3_endpoint(settings, layout)
    return {
        "LEAP_STORE_URL": store_url(settings, layout),
        "LEAP_FEEDBACK_URL": f"s3://{layout.bucket}/feedback",
        "LEAP_REPLICAS": str(max(layout.replicas, 1)),
        "LEAP_ENDPOINTS": ",".join(admin_url(settings, index) for index in range(layout.replicas)),
        "LEAP_MLFLOW_TRACKING_URI": settings.mlflow_server_url,
        "PREFECT_API_URL": settings.prefect_api_url,
        **servers.s3_environment(endpoint),
    }


# ---------------------------------------------------------------------------- preparing services

def _ensure_databases(settings: PipelineSettings, layout: FleetLayout) -> None:
    for name in DATABASES:
        servers.create_database(layout.postgres_port, name, settings.stack_host)


def _ensure_bucket(settings: PipelineSettings, layout: FleetLayout) -> None:
    import boto3
    from botocore.exceptions import ClientError

    environment = servers.s3_environment(s3_endpoint(settings, layout))
    client = boto3.client("s3", endpoint_url=s3_endpoint(settings, layout),
                          aws_access_key_id=environment["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=environment["AWS_SECRET_ACCESS_KEY"],
                          region_name=environment["AWS_DEFAULT_REGION"])
    try:
        client.create_bucket(Bucket=layout.bucket)
    except ClientError as error:
        if error.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise


def ensure_pool(api_url: str, pool: str = POOL) -> None:
    """Create the process work pool `pool` unless it exists."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            try:
                client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
            except ObjectAlreadyExists:
                pass


def register_deployment(api_url: str, flow: Any, name: str, pool: str = POOL, *, cron: str | None = None,
                        concurrency_limit: int | None = 1, parameters: Mapping[str, Any] | None = None) -> str:
    """Register `flow` as deployment `name` on the work pool `pool`, at most `concurrency_limit` runs at
    once (further runs wait for a slot; None: no limit); returns the deployment id.

    The entrypoint is the flow's module path, which a worker imports from the installed project, so
    the deployment needs no code storage: every worker runs the code of the environment it runs in.
    """
    from prefect.deployments.runner import EntrypointType
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if concurrency_limit is not None and concurrency_limit < 1:
        raise ValueError(f"concurrency_limit must be >= 1 or None, not {concurrency_limit}")
    with temporary_settings({PREFECT_API_URL: api_url}):
        deployment = flow.to_deployment(name=name, cron=cron, concurrency_limit=concurrency_limit,
                                        parameters=dict(parameters or {}),
                                        entrypoint_type=EntrypointType.MODULE_PATH)
        return str(deployment.apply(work_pool_name=pool))


def _prepare_pool(settings: PipelineSettings) -> None:
    from flows.pipeline import retrain_flow

    ensure_pool(settings.prefect_api_url)
    register_deployment(settings.prefect_api_url, retrain_flow, RETRAIN_DEPLOYMENT, cron=RETRAIN_CRON)


# ---------------------------------------------------------------------------- health

def postgres_answers(port: int, host: str) -> bool:
    import psycopg

    try:
        with psycopg.connect(host=host, port=port, user=servers.PG_USER, dbname="postgres", connect_timeout=2):
            return True
    except psycopg.Error:
        return False


def pool_workers(api_url: str, pool: str = POOL) -> dict[str, str]:
    """{worker name: status} of the pool's workers as the Prefect server reports them ({} if unreachable)."""
    try:
        response = httpx.post(f"{api_url}/work_pools/{pool}/workers/filter", json={}, timeout=5.0)
    except httpx.HTTPError:
        return {}
    if response.status_code != 200:
        return {}
    try:
        return {str(item["name"]): str(item.get("status", "")) for item in response.json()}
    except (ValueError, TypeError, KeyError):
        return {}


def worker_name(index: int) -> str:
    return f"leap-worker-{index}"


# ---------------------------------------------------------------------------- services

def fleet_specs(settings: PipelineSettings, layout: FleetLayout) -> dict[str, Service]:
    """Every service of the fleet, in start order; `after` names what must answer before one starts."""
    from ops.service import Service

    host = settings.stack_host
    pgdata = settings.stack_dir / "pgdata"
    endpoint = s3_endpoint(settings, layout)
    s3_env = servers.s3_environment(endpoint)
    flows_env = fleet_environment(settings, layout)
    done: dict[str, bool] = {}

    def once(key: str, work: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            if not done.get(key):
                work()
                done[key] = True
        return run

    def both(*steps: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            for step in steps:
                step()
        return run

    def init_data() -> None:
        servers.init_postgres(pgdata)

    def token() -> None:
        settings.token()  # the replicas and the push flow must read the same token file

    databases = once("databases", lambda: _ensure_databases(settings, layout))
    bucket = once("bucket", lambda: _ensure_bucket(settings, layout))
    pool = once("pool", lambda: _prepare_pool(settings))

    specs: dict[str, Service] = {
        "postgres": Service(
            "postgres", servers.postgres_command(pgdata, layout.postgres_port, host),
            url=servers.postgres_url(layout.postgres_port, "postgres", host),
            health_url=f"postgresql://{host}:{layout.postgres_port}", ports=(layout.postgres_port,),
            start_timeout_s=60.0, check=lambda: postgres_answers(layout.postgres_port, host),
            user=servers.postgres_user(), stop_signal=signal.SIGINT,  # fast shutdown: the clients stop first
            prepare=init_data),
        "s3": Service(
            "s3", servers.s3_command(layout.s3_port, host), url=endpoint, health_url=endpoint,
            ports=(layout.s3_port,), start_timeout_s=60.0),
        "mlflow": Service(
            "mlflow",
            servers.mlflow_command(servers.postgres_url(layout.postgres_port, "mlflow", host),
                                   f"s3://{layout.bucket}/mlflow", settings.mlflow_port, host),
            url=settings.mlflow_server_url, health_url=f"{settings.mlflow_server_url}/health",
            ports=(settings.mlflow_port,), start_timeout_s=120.0, after=("postgres", "s3"),
            env={**servers.MLFLOW_ENVIRONMENT, "MLFLOW_S3_ENDPOINT_URL": endpoint, **s3_env},
            prepare=both(databases, bucket)),
        "prefect": Service(
            "prefect",
            [servers.program("prefect"), "server", "start", "--host", host, "--port", str(settings.prefect_port)],
            url=f"http://{host}:{settings.prefect_port}", health_url=f"{settings.prefect_api_url}/health",
            ports=(settings.prefect_port,), start_timeout_s=120.0, after=("postgres",),
            env={"PREFECT_HOME": str(settings.home / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                 "PREFECT_API_URL": settings.prefect_api_url,
                 "PREFECT_API_DATABASE_CONNECTION_URL": servers.postgres_url(
                     layout.postgres_port, "prefect", host, driver="postgresql+asyncpg")},
            prepare=databases),
    }
    worker_env = {**flows_env, "PREFECT_HOME": str(settings.home / "prefect"),
                  "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "LEAP_HOME": str(settings.home),
                  "LEAP_ADMIN_TOKEN_FILE": str(settings.admin_token_file),
                  # the worker's flow runs import the project (and a deployment's module) from here
                  "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    for index in range(layout.workers):
        name = worker_name(index)
        specs[f"worker-{index}"] = Service(
            f"worker-{index}",
            [servers.program("prefect"), "worker", "start", "--pool", layout.pool, "--type", "process", "--name", name],
            url=f"{settings.prefect_api_url}/work_pools/{layout.pool}", health_url=f"prefect-worker:{name}",
            ports=(), start_timeout_s=120.0, after=("prefect",), env=worker_env, cwd=REPO_ROOT,
            check=lambda name=name: pool_workers(settings.prefect_api_url, layout.pool).get(name) == "ONLINE",
            prepare=both(databases, token, pool))
    for index in range(layout.replicas):
        serving_port, admin_port = replica_ports(settings, index)
        rid = replica_id(index)
        argv = [servers.program("leap"), "serve", "--host", host, "--port", str(serving_port),
                "--admin-port", str(admin_port), "--feedback-dir", str(settings.feedback_dir),
                "--max-model-len", str(settings.max_model_len)]
        if settings.model_path is not None:
            argv += ["--model", str(settings.model_path)]
        specs[rid] = Service(
            rid, argv, url=f"http://{host}:{serving_port}/v1", health_url=f"http://{host}:{serving_port}/health",
            ports=(serving_port, admin_port), start_timeout_s=900.0, after=("mlflow", "s3"),
            admin_url=admin_url(settings, index),
            env={"LEAP_HOME": str(settings.home), "LEAP_ADMIN_TOKEN_FILE": str(settings.admin_token_file),
                 "LEAP_REPLICA_ID": rid, "LEAP_STATE_DIR": str(settings.stack_dir / rid),
                 "LEAP_FEEDBACK_URL": flows_env["LEAP_FEEDBACK_URL"], **s3_env,
                 # a replica that starts with no push kept takes the registry's champion
                 "LEAP_REGISTRY_URI": settings.mlflow_server_url,
                 "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", REPLICA_KV_CACHE_GIB)},
            prepare=both(bucket, token))
    return specs


# ---------------------------------------------------------------------------- replica readouts

def parse_gauges(text: str, replica: str = "", version: str = "") -> dict[str, Any]:
    """The live figures in a replica's /metrics text: `spearman` and `mae` of the serving readout over its
    last 256 finished requests since its current anchor (the `domain="all"` series of
    `leap:rolling_spearman` / `leap:rolling_mae_tokens`; the MAE weighs tenants under the replica's
    `rls_tenant_max_share`; None before any such request, or for a Spearman under two), and `by_domain` as
    the drift watch reads them (`flows.drift.parse_quality`)."""
    from prometheus_client.parser import text_string_to_metric_families

    from flows.drift import ALL, MetricsError, parse_quality

    figures: dict[str, Any] = {"spearman": None, "mae": None}
    rolling: dict[str, float] = {}
    counts: dict[str, int] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in _ROLLING_GAUGES and sample.labels.get("domain") == ALL:
                    rolling[_ROLLING_GAUGES[sample.name]] = float(sample.value)
                elif sample.name in _COUNTS and math.isfinite(sample.value):
                    counts[_COUNTS[sample.name]] = int(sample.value)
        observations = parse_quality(text, replica, version, now=0.0)
    except (MetricsError, ValueError, TypeError) as error:
        return {**figures, "metrics_error": f"{type(error).__name__}: {error}"}
    figures.update({key: counts.get(key) for key in _COUNTS.values()})
    # the "all" series exist from the first finished predicted request since the anchor
    figures.update({key: _finite(value) for key, value in rolling.items()})
    if observations:
        figures["by_domain"] = {o.domain: {"spearman": _finite(o.spearman), "mae": _finite(o.mae),
                                           "anchor_mae": _finite(o.anchor_mae), "rows": o.rows}
                                for o in observations}
    return figures


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def replica_report(url: str, token: str, name: str = "", timeout: float = 3.0) -> dict[str, Any]:
    """What one replica's admin API says: its readout version and live figures; errors are reported, not
    raised, so one replica that does not answer leaves the others' report intact."""
    from leap_io.admin_client import READOUT_PATH, AdminClient

    report: dict[str, Any] = {"admin_url": url, "admin_up": False, "version": None, "spearman": None, "mae": None}
    admin = AdminClient(url, token, timeout)
    try:
        readout = admin.readout()
        metrics = admin.metrics()
    except httpx.HTTPError as error:
        report["error"] = f"{type(error).__name__}: {error}"
        return report
    report["admin_up"] = readout.status_code == 200
    try:
        described = readout.json()
    except ValueError:
        described = None
    if isinstance(described, dict):
        report["version"] = described.get("version")
        report["source"] = described.get("source")
    else:
        report["error"] = f"{READOUT_PATH} answered {readout.status_code} without a JSON object"
    if metrics.status_code == 200:
        report.update(parse_gauges(metrics.text, name, str(report["version"] or "")))
    else:
        report["metrics_error"] = f"/metrics answered {metrics.status_code}"
    return report
