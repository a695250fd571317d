"""The deployment files (docker/, deploy/) agree with the code they deploy.

Static checks only, no docker engine or cluster, but each one against the code itself rather
than against strings written down twice:

- YAML parses; the Kubernetes manifests are wired together (probes, Secret, Redis Service,
  volume, kustomization), and Prometheus's pod selection (the relabel `keep` rules) really
  selects the Deployment's pods;
- every XLSERVE_* variable the files set is a field of `Settings` (server/settings.py; unknown
  ones would be ignored silently, extra="ignore") and its value validates;
- probe, health-check and scrape paths are GET routes of the app `build_app` makes, open
  without an API key (the Deployment sets keys; probes and scrapes send none);
- every series the Grafana dashboard and the alerts query is one `Metrics` (server/metrics.py)
  exports, under its exposition name (`_total` for a counter, `_bucket` for a histogram, ...),
  with labels it has and label values the server writes; every metric has a panel; the
  server-error alert counts exactly the error types answered with a 5xx;
- the images copy what pyproject.toml builds from (package-dir folders, readme), run the
  `xlserve` console script with arguments the real CLI parser accepts, on the port they expose
  and probe, with the data directories set explicitly (`WEIGHTS_DIR`/`STATE_DIR` default to
  paths relative to the working directory).
"""

from __future__ import annotations

import fnmatch
import functools
import json
import os
import re
import shlex
from pathlib import Path

import pytest
import yaml  # the test extra: pyyaml

try:
    import tomllib  # Python 3.11+
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
DOCKERFILES = [ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.cuda"]
DASHBOARD = DEPLOY / "grafana" / "xlserve-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"

YAML_FILES = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))
METRIC_NAME = re.compile(r"\bxlserve_[a-z0-9_]+")
TARGET_LABELS = {"job", "instance", "namespace", "pod"}  # added by the scrape, not by the server


# --- loading


@functools.cache
def load_all(path: Path) -> tuple:
    return tuple(doc for doc in yaml.load_all(path.read_text(), Loader=Loader) if doc is not None)


def k8s_objects() -> list[dict]:
    return [doc for path in sorted(K8S.glob("*.yaml")) if path.name != "kustomization.yaml" for doc in load_all(path)]


def find(kind: str, name: str) -> dict:
    matches = [o for o in k8s_objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def server_container() -> tuple[dict, dict, dict]:
    """(Deployment, pod spec, the xlserve container)."""
    deployment = find("Deployment", "xlserve")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return deployment, pod, container


@functools.cache
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    instructions, current = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not current):
            continue
        current += " " + stripped.rstrip("\\").strip() if current else stripped.rstrip("\\").strip()
        if not stripped.endswith("\\"):
            word, _, rest = current.partition(" ")
            instructions.append((word.upper(), rest.strip()))
            current = ""
    return instructions


def dockerfile_stages(path: Path) -> list[list[tuple[str, str]]]:
    stages = []
    for instruction in dockerfile_instructions(path):
        if instruction[0] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(instruction)
    return stages


def dockerfile_env(instructions: list[tuple[str, str]]) -> dict[str, str]:
    env = {}
    for word, rest in instructions:
        if word == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def exec_form(rest: str) -> list[str]:
    value = json.loads(rest)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), rest
    return value


# --- what the code says


@functools.cache
def app():
    """The app `xlserve serve` runs, built but not started (no engine, no models loaded)."""
    from xlserve.server.app import build_app
    from xlserve.server.settings import Settings

    return build_app(Settings(models="none-loaded"))


def is_get_route(path: str) -> bool:
    """Whether the app's router dispatches GET `path` to an endpoint (starlette's own matching;
    a route for the path with other methods only is a PARTIAL match, answered 405)."""
    from starlette.routing import Match

    scope = {"type": "http", "path": path, "method": "GET", "root_path": "", "headers": [], "query_string": b""}
    return any(route.matches(scope)[0] == Match.FULL for route in app().router.routes)


def open_paths() -> frozenset[str]:
    from xlserve.server.api.admission import OPEN_PATHS

    return OPEN_PATHS


def assert_open_get_route(path: str, what: str) -> None:
    assert is_get_route(path), f"{what}: {path} is not a GET route of the app"
    assert path in open_paths(), f"{what}: {path} needs an API key (not in the admission's OPEN_PATHS)"


@functools.cache
def exported_series() -> dict[str, frozenset[str]]:
    """Series name -> label names, from a real exposition of `Metrics` with one child of every
    metric (a labelled metric with no children exports nothing)."""
    from xlserve.server.metrics import Metrics

    metrics = Metrics()
    for metric in vars(metrics).values():
        labelnames = getattr(metric, "_labelnames", None)
        if labelnames is None:
            continue
        child = metric.labels(**{name: "x" for name in labelnames}) if labelnames else metric
        for method in ("inc", "observe", "set"):
            if hasattr(child, method):
                getattr(child, method)(1)
                break
    series: dict[str, set[str]] = {}
    for line in metrics.render().decode().splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s", line)
        assert m, line
        labels = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', m.group(2) or ""))
        series.setdefault(m.group(1), set()).update(labels)
    return {name: frozenset(labels) for name, labels in series.items()}


@functools.cache
def metric_families() -> dict[str, str]:
    """Family name -> type, of every metric `Metrics` defines."""
    from xlserve.server.metrics import Metrics

    return {family.name: family.type for family in Metrics().registry.collect()}


def family_of(series: str) -> str:
    families = metric_families()
    if series in families:
        return series
    for suffix in ("_total", "_created", "_bucket", "_count", "_sum"):
        if series.endswith(suffix) and series[: -len(suffix)] in families:
            return series[: -len(suffix)]
    return series


@functools.cache
def error_types() -> dict[str, int]:
    """Error type -> HTTP status, of every error the API answers (server/api/errors.py)."""
    from xlserve.server.api import errors

    types = {}
    pending = [errors.APIError]
    while pending:
        cls = pending.pop()
        types[cls.type] = cls.status
        pending += cls.__subclasses__()
    for kind in errors.ERROR_KINDS.values():
        types[kind.type] = kind.status
    return types


def tiers() -> tuple[str, ...]:
    from xlserve.server.cache import TIERS

    return tuple(TIERS)


# --- queries


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


def alert_rules() -> list[dict]:
    (alerts,) = load_all(ALERTS)
    return [rule for group in alerts["groups"] for rule in group["rules"]]


def check_query(query: str) -> list[str]:
    """What is wrong with a PromQL query (or Grafana label_values()) against the exported series."""
    series = exported_series()
    problems = []
    without_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', query)
    used = set(METRIC_NAME.findall(without_strings))
    for name in sorted(used - series.keys()):
        same_family = sorted(s for s in series if family_of(s) == family_of(name))
        problems.append(f"{name} is not an exported series (its family exports: {same_family or 'nothing'})")
    known = {n for n in used if n in series}
    labels_here = set().union(*(series[n] for n in known)) if known else set()
    # label matchers: the metric has the label, and the values are ones the server writes
    for name, matchers in re.findall(r"(xlserve_[a-z0-9_]+)\s*\{([^}]*)\}", query):
        for label, op, value in re.findall(r'([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"', matchers):
            if name in series and label not in series[name] | TARGET_LABELS:
                problems.append(f"{name} has no label {label}")
            if value.startswith("$"):
                continue  # a Grafana variable
            domain = {"type": set(error_types()), "tier": set(tiers())}.get(label)
            if domain is not None:
                values = value.split("|") if op in ("=~", "!~") else [value]
                problems += [f"{label}={v!r} is never written (the server's: {sorted(domain)})"
                             for v in values if v not in domain]
    # aggregation labels exist on a metric of the query
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", without_strings):
        for label in (x.strip() for x in group.split(",") if x.strip()):
            if known and label not in labels_here | TARGET_LABELS:
                problems.append(f"no metric in the query has the label {label} it aggregates by")
    for name, label in re.findall(r"label_values\(\s*(xlserve_[a-z0-9_]+)\s*,\s*(\w+)\s*\)", query):
        if name in series and label not in series[name]:
            problems.append(f"label_values: {name} has no label {label}")
    return problems


# --- parsing


def test_the_route_check_tells_routes_from_other_paths():
    assert is_get_route("/v1/models") and not is_get_route("/v1/completions") and not is_get_route("/nope")


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
    # the image kustomize rewrites is the one the Deployment runs
    _, _, container = server_container()
    names = {image["name"] for image in kustomization["images"]}
    assert container["image"].split(":")[0] in names


# --- the Deployment


def test_deployment_probes_and_shutdown():
    deployment, pod, container = server_container()
    assert deployment["spec"]["replicas"] == 2
    port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe, path in (("startupProbe", "/health"), ("livenessProbe", "/health"), ("readinessProbe", "/ready")):
        get = container[probe]["httpGet"]
        assert get["path"] == path, probe  # liveness must not be /ready: a draining pod is alive
        assert_open_get_route(get["path"], probe)
        assert get["port"] in port_names, probe
    from xlserve.server.settings import Settings

    env = {e["name"]: e for e in container["env"]}
    default_grace = Settings.model_fields["shutdown_grace_seconds"].default
    grace = float(env.get("XLSERVE_SHUTDOWN_GRACE_SECONDS", {}).get("value", default_grace))
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pause = float(pre_stop[-1]) if pre_stop and pre_stop[0] == "sleep" else 0
    assert pod["terminationGracePeriodSeconds"] > grace + pause
    assert container["resources"]["requests"]["cpu"] and container["resources"]["limits"]["memory"]


def test_deployment_runs_the_image_command_on_the_image_port():
    _, _, container = server_container()
    assert "command" not in container and "args" not in container, "the Deployment runs the image's CMD"
    port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
    for path in DOCKERFILES:
        cmd = next(exec_form(rest) for word, rest in dockerfile_stages(path)[-1] if word == "CMD")
        assert port_names["http"] == int(cmd[cmd.index("--port") + 1]), path.name
    service = find("Service", "xlserve")
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(port_names) | set(port_names.values())


def test_deployment_wiring():
    deployment, pod, container = server_container()
    env = {e["name"]: e for e in container["env"]}

    # the Deployment shares sessions through Redis: the images' `pip install .` brings the client
    assert any(re.match(r"redis\b", dep) for dep in pyproject()["project"]["dependencies"])
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


def xlserve_variables() -> dict[str, list[tuple[str, str | None]]]:
    """XLSERVE_* name -> [(where, value or None where it comes from a Secret)], from the
    manifests' container env and the images' ENV."""
    found: dict[str, list] = {}
    for obj in k8s_objects():
        spec = obj.get("spec", {}).get("template", {}).get("spec", {})
        for container in spec.get("containers", []):
            for e in container.get("env", []):
                if e["name"].startswith("XLSERVE_"):
                    value = e.get("value")
                    ref = e.get("valueFrom", {}).get("secretKeyRef")
                    if ref is not None:
                        secret = find("Secret", ref["name"])
                        value = secret.get("stringData", {}).get(ref["key"])
                    found.setdefault(e["name"], []).append((f"{obj['kind']} {obj['metadata']['name']}", value))
    for path in DOCKERFILES:
        for key, value in dockerfile_env(dockerfile_instructions(path)).items():
            if key.startswith("XLSERVE_"):
                found.setdefault(key, []).append((path.name, value))
    return found


def test_every_xlserve_variable_is_a_setting_with_a_valid_value(monkeypatch):
    from xlserve.server.settings import Settings

    fields = set(Settings.model_fields)
    variables = xlserve_variables()
    used = {name.removeprefix("XLSERVE_").lower() for name in variables}
    assert {"state_dir", "redis_url", "api_keys", "device", "weights_dir"} <= used
    unknown = sorted(used - fields)
    assert not unknown, f"XLSERVE_* variables that server/settings.py does not define (ignored silently): {unknown}"
    # every value, read from the environment as the server reads it, validates
    for name, places in variables.items():
        for where, value in places:
            if value is None:
                continue
            for other in [k for k in os.environ if k.startswith("XLSERVE_")]:
                monkeypatch.delenv(other)
            monkeypatch.setenv(name, value)
            actual = getattr(Settings(), name.removeprefix("XLSERVE_").lower())  # raises when it does not validate
            assert str(actual) == value.strip() or actual == type(actual)(value), (where, name, value, actual)


# --- Prometheus


def test_prometheus_selects_the_deployment_pods_on_an_open_metrics_path():
    (config,) = load_all(PROMETHEUS)
    for rule_file in config["rule_files"]:
        assert (PROMETHEUS.parent / rule_file).is_file(), rule_file
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "xlserve"]
    assert_open_get_route(job["metrics_path"], "scrape metrics_path")

    # the pod as service discovery describes it (labels and annotations sanitised to [a-z0-9_])
    deployment, _, container = server_container()
    template = deployment["spec"]["template"]["metadata"]

    def sanitise(name: str) -> str:
        return re.sub(r"[^a-zA-Z0-9_]", "_", name)

    port = next(p for p in container["ports"] if p["name"] == "http")
    meta = {f"__meta_kubernetes_pod_label_{sanitise(k)}": v for k, v in template["labels"].items()}
    meta |= {f"__meta_kubernetes_pod_annotation_{sanitise(k)}": v for k, v in template.get("annotations", {}).items()}
    meta |= {"__meta_kubernetes_pod_container_port_name": port["name"], "__metrics_path__": job["metrics_path"]}
    for rule in job["relabel_configs"]:
        value = rule.get("separator", ";").join(meta.get(label, "") for label in rule["source_labels"])
        matched = re.fullmatch(rule.get("regex", "(.*)"), value)
        action = rule.get("action", "replace")
        if action == "keep":
            assert matched, f"Prometheus drops the xlserve pods: {rule} on {value!r}"
        elif action == "drop":
            assert not matched, f"Prometheus drops the xlserve pods: {rule} on {value!r}"
        elif action == "replace" and matched:
            meta[rule["target_label"]] = matched.expand(rule.get("replacement", r"\1").replace("$1", r"\1"))
    assert_open_get_route(meta["__metrics_path__"], "the pod's prometheus.io/path")
    assert int(template["annotations"]["prometheus.io/port"]) == port["containerPort"]


def test_alerts_query_only_exported_series():
    rules = alert_rules()
    assert rules and all(rule["expr"] for rule in rules)
    problems = {rule["alert"]: check_query(rule["expr"]) for rule in rules}
    problems = {alert: p for alert, p in problems.items() if p}
    assert not problems, problems


def test_the_server_error_alert_counts_every_5xx_error_type():
    (rule,) = [r for r in alert_rules() if r["alert"] == "XlserveHighServerErrorRate"]
    (matcher,) = re.findall(r'xlserve_request_errors_total\{type=~"([^"]*)"\}', rule["expr"])
    server_errors = {t for t, status in error_types().items() if status >= 500}
    assert set(matcher.split("|")) == server_errors


# --- Grafana


def test_dashboard_queries_only_exported_series():
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [q for q in dashboard_queries(dashboard) if q != "prometheus"]  # the datasource variable's type
    assert queries and any(METRIC_NAME.search(q) for q in queries)
    problems = {q: check_query(q) for q in queries}
    problems = {q: p for q, p in problems.items() if p}
    assert not problems, problems


def test_dashboard_shows_every_metric():
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {family_of(n) for q in dashboard_queries(dashboard) for n in METRIC_NAME.findall(q)}
    missing = sorted(set(metric_families()) - queried)
    assert not missing, f"metrics with no panel in {DASHBOARD.relative_to(ROOT)}: {missing}"


def test_every_metric_is_defined_in_metrics_py():
    """`Metrics` is the one place metrics are made (the checks above rely on it): no other module
    under server/ creates a Prometheus metric."""
    pattern = re.compile(r"\b(?:Counter|Gauge|Histogram|Summary)\(\s*[\"']")
    elsewhere = [p.relative_to(ROOT) for p in (ROOT / "server").rglob("*.py")
                 if p.name != "metrics.py" and pattern.search(p.read_text())]
    assert not elsewhere
    assert {"xlserve_prompt_tokens", "xlserve_time_to_first_token_seconds", "xlserve_session_evictions"} <= set(metric_families())


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


# --- images


def test_dockerignore_keeps_what_the_images_copy():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]

    def ignored(path: str) -> bool:
        return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path, p.removeprefix("**/")) for p in patterns)

    for path in DOCKERFILES:
        for word, rest in dockerfile_instructions(path):
            if word == "COPY" and not rest.startswith("--from"):
                *sources, _ = shlex.split(rest)
                assert not [s for s in sources if ignored(s.rstrip("/"))], (path.name, rest)
    for kept_out in (".venv", ".git", "tests", "state"):
        assert ignored(kept_out), kept_out


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_the_build_stage_copies_what_pyproject_builds_from(path):
    build, _ = dockerfile_stages(path)
    workdir = next(rest for word, rest in build if word == "WORKDIR")
    copies = {}
    for word, rest in build:
        if word == "COPY":
            *sources, dest = shlex.split(rest)
            for source in sources:
                copies[source.rstrip("/")] = dest
    setuptools = pyproject()["tool"]["setuptools"]
    needed = {"pyproject.toml", pyproject()["project"]["readme"], *setuptools["package-dir"].values()}
    assert set(copies) == needed, f"{path.name} copies {sorted(copies)}; pyproject.toml builds from {sorted(needed)}"
    # each lands where pyproject.toml expects it, relative to the directory `pip install .` runs in
    for source, dest in copies.items():
        landed = Path(workdir) / dest if not dest.startswith("/") else Path(dest)
        landed = landed / Path(source).name if dest.endswith("/") else landed
        assert landed == Path(workdir) / source, (source, dest)
    installs = [rest for word, rest in build if word == "RUN" and re.search(r"\bpip install \.(\s|$)", rest)]
    assert len(installs) == 1, "one regular (non-editable) install of the package"
    assert "-e" not in shlex.split(installs[0])


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_runs_xlserve_serve(path, monkeypatch):
    text = path.read_text()
    final = dockerfile_stages(path)[-1]
    (cmd,) = [exec_form(rest) for word, rest in final if word == "CMD"]
    # the console script pyproject.toml installs, found on the venv's PATH
    assert cmd[0] in pyproject()["project"]["scripts"]
    assert pyproject()["project"]["scripts"][cmd[0]] == "xlserve.server.cli:main"
    env = dockerfile_env(final)
    venv = next(m.group(1) for word, rest in dockerfile_stages(path)[0] if word == "RUN"
                for m in [re.search(r"-m venv (\S+)", rest)] if m)
    assert f"{venv}/bin" in env["PATH"].split(":")

    # the real CLI parses the CMD as `serve`, on the exposed port
    from xlserve.server import cli

    seen = []
    monkeypatch.setattr(cli, "cmd_serve", seen.append)
    try:
        cli.main(cmd[1:])
    except SystemExit as error:  # argparse refuses it
        pytest.fail(f"`xlserve` refuses the image's CMD {cmd} (exit {error.code})")
    (args,) = seen
    assert args.command == "serve" and args.host == "0.0.0.0"
    (exposed,) = [int(rest) for word, rest in final if word == "EXPOSE"]
    assert args.port == exposed

    # data directories: the package defaults are relative to the working directory, so the image
    # names both; the weights are the ones it copies, the state is the volume it declares
    copies = {shlex.split(rest)[0]: shlex.split(rest)[-1] for word, rest in final
              if word == "COPY" and not rest.startswith("--from")}
    assert env["XLSERVE_WEIGHTS_DIR"] == copies["weights"].rstrip("/")
    assert env["XLSERVE_STATE_DIR"] == "/var/lib/xlserve/state"
    (volume,) = [exec_form(rest) for word, rest in final if word == "VOLUME"]
    assert env["XLSERVE_STATE_DIR"] in volume
    assert any(word == "RUN" and f"mkdir -p {env['XLSERVE_STATE_DIR']}" in rest for word, rest in final)
    assert env["XLSERVE_DEVICE"] == ("cuda" if path.name.endswith(".cuda") else "cpu")

    # health check: /health on the port the server listens on, as code that compiles
    (health,) = [rest for word, rest in final if word == "HEALTHCHECK"]
    probe = exec_form(health[health.index("CMD") + 3:].strip())
    assert probe[:2] == ["python", "-c"]
    compile(probe[2], "HEALTHCHECK", "exec")
    assert f"'127.0.0.1', {args.port}" in probe[2]
    path_checked = re.search(r"request\('GET', '([^']+)'\)", probe[2]).group(1)
    assert_open_get_route(path_checked, "HEALTHCHECK")

    assert re.search(r"^USER (?!root|0\b)\S+", text, re.MULTILINE), "the server runs as a non-root user"
    assert "STOPSIGNAL SIGTERM" in text
    assert re.search(r'^ARG TORCH_SPEC="torch>=2\.4"$', text, re.MULTILINE)
    # the torch the image installs first satisfies the package's own requirement
    assert "torch>=2.4" in pyproject()["project"]["dependencies"]


def test_no_urls_in_docker_and_deploy_files():
    """Index and registry locations are the builder's choice (build args), never written down."""
    files = DOCKERFILES + [ROOT / ".dockerignore"] + [p for p in DEPLOY.rglob("*") if p.is_file()]
    for path in files:
        # nginx names its upstream groups as http://<group>: a name, not a location
        text = re.sub(r"proxy_pass http://\$\w+;", "", path.read_text())
        assert not re.search(r"https?://", text), path
