"""The deployment files (docker/, deploy/) agree with the code they deploy.

Static checks only, no docker engine or cluster: every YAML file parses, the Kubernetes manifests
are wired together (probes, Secret, Redis Service, volume, kustomization), every metric the
Grafana dashboard and the alerts query is one the server defines (and every metric it defines is
on the dashboard), every XLSERVE_* variable the files set is a real setting, and the images run
`xlserve serve`.
"""

from __future__ import annotations

import ast
import functools
import json
import re
from pathlib import Path

import pytest
import yaml  # the test extra: pyyaml

Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
DOCKERFILES = [ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.cuda"]
DASHBOARD = DEPLOY / "grafana" / "xlserve-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"

YAML_FILES = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))
METRIC_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")
METRIC_NAME = re.compile(r"\bxlserve_[a-z0-9_]+")


@functools.cache
def load_all(path: Path) -> tuple:
    return tuple(doc for doc in yaml.load_all(path.read_text(), Loader=Loader) if doc is not None)


def k8s_objects() -> list[dict]:
    return [doc for path in sorted(K8S.glob("*.yaml")) if path.name != "kustomization.yaml" for doc in load_all(path)]


def find(kind: str, name: str) -> dict:
    matches = [o for o in k8s_objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


@functools.cache
def defined_metrics() -> frozenset[str]:
    """Names passed to Counter(/Gauge(/Histogram( anywhere under server/ (metrics.py by design)."""
    pattern = re.compile(r"\b(?:Counter|Gauge|Histogram|Summary)\(\s*[\"'](xlserve_[a-z0-9_]+)[\"']")
    names = set()
    for path in (ROOT / "server").rglob("*.py"):
        names.update(pattern.findall(path.read_text()))
    return frozenset(names)


def base_name(name: str, defined: set[str]) -> str:
    if name in defined:
        return name
    for suffix in METRIC_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in defined:
            return name[: -len(suffix)]
    return name


def dashboard_queries(dashboard: dict) -> list[str]:
    queries = []

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("expr", "definition") and isinstance(value, str):
                    queries.append(value)
                elif key == "query" and isinstance(value, (str, dict)):
                    queries.append(value if isinstance(value, str) else value.get("query", ""))
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(dashboard)
    return queries


def alert_queries() -> list[str]:
    (alerts,) = load_all(ALERTS)
    return [rule["expr"] for group in alerts["groups"] for rule in group["rules"]]


def settings_fields() -> set[str]:
    tree = ast.parse((ROOT / "server" / "settings.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Settings")
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def settings_default(field: str):
    tree = ast.parse((ROOT / "server" / "settings.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Settings")
    node = next(n for n in cls.body if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", None) == field)
    return ast.literal_eval(node.value)


# --- parsing


def test_the_deploy_files_exist():
    assert len(YAML_FILES) >= 8
    assert DASHBOARD.is_file() and ALERTS.is_file() and (DEPLOY / "prometheus" / "prometheus.yml").is_file()
    assert all(p.is_file() for p in DOCKERFILES)
    assert (ROOT / ".dockerignore").is_file()


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_yaml_file_parses(path):
    docs = load_all(path)
    assert docs and all(isinstance(d, dict) for d in docs)


def test_kustomization_lists_every_manifest():
    (kustomization,) = load_all(K8S / "kustomization.yaml")
    listed = set(kustomization["resources"])
    present = {p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml"}
    assert listed == present
    for obj in k8s_objects():
        assert {"apiVersion", "kind", "metadata"} <= obj.keys()
        assert "namespace" not in obj["metadata"], "manifests are namespace-less; kubectl -n or kustomize sets it"


# --- the Deployment


def test_deployment_probes_and_shutdown():
    deployment = find("Deployment", "xlserve")
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container["readinessProbe"]["httpGet"]["port"] in port_names
    assert port_names["http"] == 8000
    env = {e["name"]: e for e in container["env"]}
    grace = float(env.get("XLSERVE_SHUTDOWN_GRACE_SECONDS", {}).get("value", settings_default("shutdown_grace_seconds")))
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pause = float(pre_stop[-1]) if pre_stop and pre_stop[0] == "sleep" else 0
    assert pod["terminationGracePeriodSeconds"] > grace + pause
    assert container["resources"]["requests"]["cpu"] and container["resources"]["limits"]["memory"]


def test_deployment_wiring():
    deployment = find("Deployment", "xlserve")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}

    redis_service = find("Service", "xlserve-redis")
    port = redis_service["spec"]["ports"][0]["port"]
    assert re.fullmatch(rf"redis://xlserve-redis:{port}(/\d+)?", env["XLSERVE_REDIS_URL"]["value"])
    redis = find("Deployment", "xlserve-redis")
    assert redis_service["spec"]["selector"].items() <= redis["spec"]["template"]["metadata"]["labels"].items()

    ref = env["XLSERVE_API_KEYS"]["valueFrom"]["secretKeyRef"]
    secret = find("Secret", ref["name"])
    assert ref["key"] in secret.get("stringData", {}) | secret.get("data", {})

    service = find("Service", "xlserve")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()

    state_dir = env["XLSERVE_STATE_DIR"]["value"]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == state_dir)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    find("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])


def test_every_xlserve_variable_is_a_setting():
    fields = settings_fields()
    texts = [p.read_text() for p in YAML_FILES + DOCKERFILES]
    used = {m.lower() for text in texts for m in re.findall(r"\bXLSERVE_([A-Z0-9_]+)\b", text)}
    assert {"state_dir", "redis_url", "api_keys", "device"} <= used
    unknown = sorted(used - fields)
    assert not unknown, f"XLSERVE_* variables that server/settings.py does not define: {unknown}"


# --- images


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_runs_xlserve_serve(path):
    text = path.read_text()
    cmd = [line for line in text.splitlines() if line.startswith("CMD ")]
    assert len(cmd) == 1
    assert json.loads(cmd[0][4:])[:2] == ["xlserve", "serve"]
    assert re.search(r"^USER (?!root|0\b)\S+", text, re.MULTILINE), "the server runs as a non-root user"
    assert re.search(r"^HEALTHCHECK .*\n?.*/health", text, re.MULTILINE)
    assert "STOPSIGNAL SIGTERM" in text
    assert "XLSERVE_STATE_DIR=/var/lib/xlserve/state" in text
    assert re.search(r"^VOLUME .*/var/lib/xlserve/state", text, re.MULTILINE)
    assert re.search(r'^ARG TORCH_SPEC="torch>=2\.4"$', text, re.MULTILINE)


def test_no_urls_in_docker_and_deploy_files():
    """Index and registry locations are the builder's choice (build args), never written down."""
    files = DOCKERFILES + [ROOT / ".dockerignore"] + [p for p in DEPLOY.rglob("*") if p.is_file()]
    for path in files:
        assert not re.search(r"https?://", path.read_text()), path


# --- metrics


def test_metrics_are_found_in_the_source():
    defined = defined_metrics()
    assert {"xlserve_prompt_tokens", "xlserve_time_to_first_token_seconds", "xlserve_session_evictions"} <= defined


def test_dashboard_queries_only_defined_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    defined = defined_metrics()
    queries = dashboard_queries(dashboard)
    assert queries
    queried = {base_name(n, defined) for q in queries for n in METRIC_NAME.findall(q)}
    assert queried and queried <= defined, f"not defined under server/: {sorted(queried - defined)}"


def test_dashboard_shows_every_metric():
    dashboard = json.loads(DASHBOARD.read_text())
    defined = defined_metrics()
    queried = {base_name(n, defined) for q in dashboard_queries(dashboard) for n in METRIC_NAME.findall(q)}
    missing = sorted(defined - queried)
    assert not missing, f"metrics with no panel in {DASHBOARD.relative_to(ROOT)}: {missing}"


def test_dashboard_is_templated():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["model"]["type"] == "query"
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert all(t["datasource"]["uid"] == "${DS_PROMETHEUS}" for t in panel["targets"]), panel["title"]
        # every panel follows the model variable (the replica count is not per model)
        assert any("$model" in t["expr"] for t in panel["targets"]) or "up{" in panel["targets"][0]["expr"], panel["title"]


def test_alerts_query_only_defined_metrics():
    defined = defined_metrics()
    queried = {base_name(n, defined) for q in alert_queries() for n in METRIC_NAME.findall(q)}
    assert queried and queried <= defined, f"not defined under server/: {sorted(queried - defined)}"
