"""The deployment files (docker/, deploy/) agree with the code they deploy.

Static checks only, no docker engine or cluster, but each one against the code itself rather
than against strings written down twice:

- YAML parses and passes yamllint; the Kubernetes manifests, as `kubectl kustomize` renders the
  base and the GPU overlay, validate against the Kubernetes schema (kubernetes-validate, offline)
  and are wired together (probes, generated Secrets, Redis with its password and durability,
  per-pod volume, HPA, NetworkPolicies); the apply fails until the secret files exist; the
  promtool commands deploy/README.md gives pass (the file-SD config, the alert rules), the
  Kubernetes config differs from the file-SD one only in discovery and fails Debian's promtool
  (built without Kubernetes discovery) for that reason alone; Prometheus's pod selection (the
  relabel `keep` rules) really selects the Deployment's pods;
- every XLSERVE_* variable the files set is a field of `Settings` (server/settings.py; unknown
  ones would be ignored silently, extra="ignore") and its value validates;
- probe, health-check and scrape paths are GET routes of the app `build_app` makes, open
  without an API key (the Deployment sets keys; probes and scrapes send none);
- every series the Grafana dashboard and the alerts query is one `Metrics` (server/metrics.py)
  exports, under its exposition name (`_total` for a counter, `_bucket` for a histogram, ...),
  with labels it has and label values the server writes (error types and codes, tiers); every
  metric has a panel, and one splits errors by code; the
  server-error alert counts exactly the error types answered with a 5xx;
- one dependency truth: constraints.txt pins what the venv has, the Makefile and both images
  install every package with it;
- the images copy what pyproject.toml builds from (package-dir folders, readme), run the
  `xlserve` console script with arguments the real CLI parser accepts, on the port they expose
  and probe, with the data directories set explicitly (`WEIGHTS_DIR`/`STATE_DIR` default to
  paths relative to the working directory).
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
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
# xlserve's metrics, and the API process's own process metrics (prometheus_client's process_*)
METRIC_NAME = re.compile(r"\b(?:xlserve|process)_[a-z0-9_]+")
TARGET_LABELS = {"job", "instance", "namespace", "pod"}  # added by the scrape, not by the server


# --- loading


@functools.cache
def load_all(path: Path) -> tuple:
    return tuple(doc for doc in yaml.load_all(path.read_text(), Loader=Loader) if doc is not None)


EXAMPLE_SECRETS = {"api-keys": "example-key-1,example-key-2", "redis-password": "0123456789abcdef"}
SECRETS = K8S / "base" / "secrets"


def kustomize(variant: str = "", with_secrets: bool = True, components: tuple[str, ...] = (),
              edit=None) -> subprocess.CompletedProcess:
    """`kubectl kustomize` of deploy/kubernetes/<variant> on a copy, with example secret files
    (or none) and extra components added to the variant's kustomization; `edit`, when given, is
    called with the copy (its deploy/kubernetes) before the render, to change it as a user would."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (for `kubectl kustomize`) is not installed")
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "kubernetes"
        shutil.copytree(K8S, copy, ignore=shutil.ignore_patterns(*EXAMPLE_SECRETS))
        if with_secrets:
            for name, value in EXAMPLE_SECRETS.items():
                (copy / "base" / "secrets" / name).write_text(value)
        if components:
            kustomization = copy / variant / "kustomization.yaml"
            (doc,) = load_all(kustomization)
            doc["components"] = list(components)
            kustomization.write_text(yaml.safe_dump(doc))
        if edit is not None:
            edit(copy)
        return subprocess.run([kubectl, "kustomize", str(copy / variant)], capture_output=True, text=True, timeout=120)


@functools.cache
def rendered(variant: str = "", components: tuple[str, ...] = ()) -> tuple[dict, ...]:
    result = kustomize(variant, components=components)
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.load_all(result.stdout, Loader=Loader) if doc is not None)


def k8s_objects(variant: str = "") -> tuple[dict, ...]:
    """The objects `kubectl apply -k deploy/kubernetes[/variant]` would create."""
    return rendered(variant)


def find(kind: str, name: str, variant: str = "") -> dict:
    matches = [o for o in k8s_objects(variant) if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def secret_value(ref: dict, variant: str = "") -> str:
    import base64

    secret = find("Secret", ref["name"], variant)
    if ref["key"] in secret.get("stringData", {}):
        return secret["stringData"][ref["key"]]
    return base64.b64decode(secret["data"][ref["key"]]).decode()


def quantity(text: str) -> int:
    """Bytes of a Kubernetes memory quantity ("7Gi", "3584Mi") or a plain number."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    for suffix, scale in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * scale)
    return int(text)


def server_container(variant: str = "") -> tuple[dict, dict, dict]:
    """(Deployment, pod spec, the xlserve container)."""
    deployment = find("Deployment", "xlserve", variant)
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


def error_code_labels() -> set[str]:
    """Every value the `code` label of xlserve_request_errors_total takes: the error registry's
    codes (server/errors.py), and the one for an error without a code."""
    from xlserve.server.errors import error_codes
    from xlserve.server.metrics import NO_CODE

    return set(error_codes()) | {NO_CODE}


def tiers() -> tuple[str, ...]:
    from xlserve.server.cache.manager import TIERS

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
    for name, matchers in re.findall(r"\b((?:xlserve|process)_[a-z0-9_]+)\s*\{([^}]*)\}", query):
        for label, op, value in re.findall(r'([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"', matchers):
            if name in series and label not in series[name] | TARGET_LABELS:
                problems.append(f"{name} has no label {label}")
            if value.startswith("$"):
                continue  # a Grafana variable
            domain = {"type": set(error_types()), "code": error_code_labels(), "tier": set(tiers())}.get(label)
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
    (base,) = load_all(K8S / "base" / "kustomization.yaml")
    listed = set(base["resources"])
    present = {p.name for p in (K8S / "base").glob("*.yaml") if p.name != "kustomization.yaml"}
    assert listed == present
    (top,) = load_all(K8S / "kustomization.yaml")
    assert top["resources"] == ["base"]
    (gpu,) = load_all(K8S / "overlays" / "gpu" / "kustomization.yaml")
    assert gpu["resources"] == ["../../base"]
    for variant in ("", "overlays/gpu"):
        for obj in k8s_objects(variant):
            assert {"apiVersion", "kind", "metadata"} <= obj.keys()
            assert "namespace" not in obj["metadata"], "manifests are namespace-less; kubectl -n or kustomize sets it"
    # the image kustomize rewrites is the one the Deployment runs
    _, _, container = server_container()
    assert container["image"] == "xlserve:0.1.0"
    assert server_container("overlays/gpu")[2]["image"] == "xlserve:0.1.0-cuda"


README = DEPLOY / "README.md"
REGISTRY_IMAGE = "registry.example.com/team/xlserve"  # deploy/README.md's example


def readme_kubernetes_step(number: int) -> str:
    """Step <number> of the commands in deploy/README.md's Kubernetes section (its comment lines)."""
    block = re.search(r"^## Kubernetes\n+```sh\n(.*?)^```", README.read_text(), re.S | re.M)
    assert block, "deploy/README.md has no sh block under ## Kubernetes"
    step = re.search(rf"^# {number}\. (.*?)(?=^# {number + 1}\. |^[^#\n])", block.group(1), re.S | re.M)
    assert step, f"no step {number} in deploy/README.md's Kubernetes commands"
    return step.group(1)


def set_image_names(copy: Path, files: list[str], new_name: str) -> None:
    """What step 1 asks of a user: point the `images:` entries of these kustomizations at a registry."""
    for name in files:
        path = copy / Path(name).relative_to("deploy/kubernetes")
        (doc,) = load_all(path)
        entries = [e for e in doc.get("images", []) if e["name"] == "xlserve"]
        assert entries, f"deploy/README.md's step 1 names {name}, which has no `images:` entry for xlserve"
        for entry in entries:
            entry["newName"] = new_name
        path.write_text(yaml.safe_dump(doc))


def test_following_the_readme_the_gpu_overlay_runs_the_cuda_image_from_the_registry():
    """Step 1 of deploy/README.md points `images:` at your registry; done as it says, the CPU
    deployment runs the CPU image and the GPU overlay the -cuda one, both from that registry. (An
    `images:` rename in the base ran before the overlay's own, which then matched nothing: the GPU
    pods got the CPU image with XLSERVE_DEVICE=cuda and crash-looped.)"""
    files = re.findall(r"deploy/kubernetes/[\w/.-]*kustomization\.yaml", readme_kubernetes_step(1))
    assert files, "step 1 names the kustomization files whose `images:` to edit"

    def images(variant: str) -> list[str]:
        result = kustomize(variant, edit=lambda copy: set_image_names(copy, files, REGISTRY_IMAGE))
        assert result.returncode == 0, result.stderr
        objects = [doc for doc in yaml.load_all(result.stdout, Loader=Loader) if doc is not None]
        (deployment,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "xlserve"]
        return [c["image"] for c in deployment["spec"]["template"]["spec"]["containers"]]

    (cpu,) = images("")
    (gpu,) = images("overlays/gpu")
    assert cpu.startswith(f"{REGISTRY_IMAGE}:") and not cpu.endswith("-cuda"), cpu
    assert gpu.startswith(f"{REGISTRY_IMAGE}:") and gpu.endswith("-cuda"), gpu
    # every `images:` entry for the server's image is in a file step 1 names
    with_images = {str(p.relative_to(ROOT)) for p in K8S.rglob("kustomization.yaml")
                   if any(e["name"] == "xlserve" for e in load_all(p)[0].get("images", []))}
    assert with_images <= set(files), f"step 1 leaves out {sorted(with_images - set(files))}"


def test_the_apply_fails_until_the_secret_files_exist():
    result = kustomize(with_secrets=False)
    assert result.returncode != 0
    assert "secrets/api-keys" in result.stderr or "secrets/redis-password" in result.stderr, result.stderr
    # the files are never committed: git ignores everything in secrets/ but its README and .gitignore
    if shutil.which("git") and (ROOT / ".git").exists():
        tracked = subprocess.run(["git", "ls-files", str(SECRETS)], cwd=ROOT, capture_output=True, text=True).stdout.split()
        assert sorted(Path(t).name for t in tracked) <= [".gitignore", "README.md"]
        for name in EXAMPLE_SECRETS:
            ignored = subprocess.run(["git", "check-ignore", "-q", str(SECRETS / name)], cwd=ROOT)
            assert ignored.returncode == 0, f"git would commit {name}"
    # the base's Secrets are generated from exactly those files
    (base,) = load_all(K8S / "base" / "kustomization.yaml")
    sources = {f.split("=", 1)[1] for g in base["secretGenerator"] for f in g["files"]}
    assert sources == {f"secrets/{name}" for name in EXAMPLE_SECRETS}


@pytest.mark.parametrize("variant, components", [("", ()), ("overlays/gpu", ()), ("", ("components/podmonitor",))],
                         ids=["base", "gpu", "base+podmonitor"])
def test_the_manifests_validate_against_the_kubernetes_schema(variant, components, tmp_path):
    validate = Path(sys.executable).parent / "kubernetes-validate"
    assert validate.exists(), "kubernetes-validate (the test extra) is not installed"
    objects = rendered(variant, components)
    if components:
        assert any(o["kind"] == "PodMonitor" for o in objects)
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(yaml.safe_dump_all(objects))
    # --strict: unknown fields are errors. A CRD's kind (PodMonitor) has no schema offline: a warning
    result = subprocess.run([str(validate), "--strict", "--quiet", str(manifest)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    unvalidated = [line for line in (result.stdout + result.stderr).splitlines() if "Couldn't find schema" in line]
    assert all("PodMonitor" in line for line in unvalidated), unvalidated


def test_yaml_files_pass_yamllint():
    yamllint = Path(sys.executable).parent / "yamllint"
    assert yamllint.exists(), "yamllint (the test extra) is not installed"
    result = subprocess.run([str(yamllint), "-f", "parsable", "-c", str(DEPLOY / ".yamllint.yaml"), str(DEPLOY)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


KUBERNETES_SD_MISSING = "field kubernetes_sd_configs not found in type config.ScrapeConfig"
PROMETHEUS_FILE_SD = DEPLOY / "prometheus" / "prometheus-file-sd.yml"


def documented_promtool_commands() -> list[list[str]]:
    """The promtool commands of deploy/README.md's ```sh blocks, those every promtool takes."""
    text = (DEPLOY / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, re.S)
    lines = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]
    return [shlex.split(line) for line in lines if line.startswith("promtool ")]


def run_promtool(arguments: list[str]) -> subprocess.CompletedProcess:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian's prometheus, which `make test` installs) is not installed")
    return subprocess.run([promtool, *arguments], capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_the_promtool_commands_deploy_readme_gives_pass():
    commands = documented_promtool_commands()
    assert ["promtool", "check", "config", "deploy/prometheus/prometheus-file-sd.yml"] in commands
    assert ["promtool", "check", "rules", "deploy/prometheus/alerts.yml"] in commands
    for command in commands:
        result = run_promtool(command[1:])
        assert result.returncode == 0, (command, result.stdout + result.stderr)


def test_the_kubernetes_config_fails_promtool_only_for_want_of_kubernetes_discovery():
    """deploy/README.md: prometheus.yml needs a promtool with Kubernetes discovery, which
    Debian's lacks; with one it passes, without one it fails with the message the README quotes."""
    assert f"`{KUBERNETES_SD_MISSING}`" in (DEPLOY / "README.md").read_text()
    relative = str(PROMETHEUS.relative_to(ROOT))
    for syntax_only in ([], ["--syntax-only"]):
        result = run_promtool(["check", "config", *syntax_only, relative])
        output = result.stdout + result.stderr
        if result.returncode != 0:
            assert KUBERNETES_SD_MISSING in output, output
            # the only unmarshal error: nothing else in the file is wrong for this promtool
            assert output.count("not found in type") == 1, output


def test_the_file_sd_config_differs_from_the_kubernetes_one_only_in_discovery():
    # copies: load_all's documents are cached and shared with the other tests
    (kubernetes,), (file_sd,) = copy.deepcopy(load_all(PROMETHEUS)), copy.deepcopy(load_all(PROMETHEUS_FILE_SD))
    (kubernetes_job,), (file_sd_job,) = kubernetes.pop("scrape_configs"), file_sd.pop("scrape_configs")
    assert kubernetes == file_sd  # global settings, rule files
    assert kubernetes_job.pop("kubernetes_sd_configs") and kubernetes_job.pop("relabel_configs")
    assert file_sd_job.pop("file_sd_configs")
    assert kubernetes_job == file_sd_job


def test_alert_rules_pass_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian's prometheus, which `make test` installs) is not installed")
    result = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_disk_alert_fires_only_where_the_disk_is_the_last_tier(tmp_path):
    """XlserveDiskTierNearlyFull, through promtool's rule tests: a replica without Redis whose disk
    holds over 90% of its budget fires (new sessions will be refused); a replica with Redis, whose
    disk is a spill cache that fills by design, does not."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian's prometheus, which `make test` installs) is not installed")
    series = {
        "xlserve_session_cache_usage_ratio{tier=\"disk\", instance=\"alone\", job=\"xlserve\"}": "0.95x20",
        "xlserve_session_cache_last_tier{tier=\"disk\", instance=\"alone\", job=\"xlserve\"}": "1x20",
        "xlserve_session_cache_usage_ratio{tier=\"disk\", instance=\"fleet\", job=\"xlserve\"}": "1x20",
        "xlserve_session_cache_last_tier{tier=\"redis\", instance=\"fleet\", job=\"xlserve\"}": "1x20",
    }
    lines = ["rule_files:", f"  - {ALERTS}", "evaluation_interval: 1m", "tests:", "  - interval: 1m",
             "    input_series:"]
    for name, values in series.items():
        lines += [f"      - series: '{name}'", f"        values: '{values}'"]
    lines += ["    alert_rule_test:", "      - eval_time: 15m", "        alertname: XlserveDiskTierNearlyFull",
              "        exp_alerts:", "          - exp_labels:", "              severity: warning",
              "              instance: alone", "            exp_annotations:",
              "              summary: 'The disk tier of alone is over 90% of its budget'",
              "              description: 'Session states fill 95% of XLSERVE_DISK_STATE_BYTES; delete sessions or raise "
              "the budget (and the volume) before new ones are refused.'"]
    test_file = tmp_path / "disk_alert_test.yml"
    test_file.write_text("\n".join(lines).replace("\\\"", "\"") + "\n")
    result = subprocess.run([promtool, "test", "rules", str(test_file)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# --- the Deployment


def test_deployment_probes_and_shutdown():
    deployment, pod, container = server_container()
    port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe, path in (("startupProbe", "/health"), ("livenessProbe", "/health"), ("readinessProbe", "/ready")):
        get = container[probe]["httpGet"]
        assert get["path"] == path, probe  # liveness must not be /ready: a draining pod is alive
        assert_open_get_route(get["path"], probe)
        assert get["port"] in port_names, probe
    from xlserve.server.settings import ServerSettings

    env = {e["name"]: e for e in container["env"]}
    default_grace = ServerSettings.model_fields["shutdown_grace_seconds"].default
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
    names = [e["name"] for e in container["env"]]

    # the Deployment shares sessions through Redis: the images' `pip install .` brings the client
    assert any(re.match(r"redis\b", dep) for dep in pyproject()["project"]["dependencies"])
    redis_service = find("Service", "xlserve-redis")
    port = redis_service["spec"]["ports"][0]["port"]
    # with Redis's password, from the Secret Redis starts with; Kubernetes expands $(VAR) only
    # from variables defined earlier in the list
    assert re.fullmatch(rf"redis://:\$\(REDIS_PASSWORD\)@xlserve-redis:{port}(/\d+)?", env["XLSERVE_REDIS_URL"]["value"])
    assert names.index("REDIS_PASSWORD") < names.index("XLSERVE_REDIS_URL")
    password_ref = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert secret_value(password_ref) == EXAMPLE_SECRETS["redis-password"]
    redis = find("Deployment", "xlserve-redis")
    assert redis_service["spec"]["selector"].items() <= redis["spec"]["template"]["metadata"]["labels"].items()
    (redis_container,) = redis["spec"]["template"]["spec"]["containers"]
    redis_env = {e["name"]: e for e in redis_container["env"]}
    assert redis_env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == password_ref
    assert redis_env["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"] == password_ref  # the probe authenticates
    start = " ".join(redis_container["command"] + redis_container["args"])
    assert "requirepass" in start and "$REDIS_PASSWORD" in start and "exec redis-server" in start
    assert "$(REDIS_PASSWORD)" not in start, "the password stays off redis-server's command line"

    # a pinned Redis image and a stated durability choice
    assert re.fullmatch(r"redis:\d+\.\d+\.\d+(-\w+)?(@sha256:[0-9a-f]{64})?", redis_container["image"])
    config_volume = next(v for v in redis["spec"]["template"]["spec"]["volumes"] if "configMap" in v)
    config = find("ConfigMap", config_volume["configMap"]["name"])["data"]["redis.conf"]
    directives = dict(line.split(None, 1) for line in config.splitlines() if line.strip() and not line.startswith("#"))
    assert directives["appendonly"] == "yes" and directives["maxmemory-policy"] == "noeviction"
    assert directives["save"] == '""', "no snapshots besides the append-only file (a failed one stops every write)"
    # the fork of a rewrite copies the pages written meanwhile: the pod holds maxmemory twice
    maxmemory = quantity(directives["maxmemory"].replace("gb", "Gi").replace("mb", "Mi"))
    assert quantity(redis_container["resources"]["limits"]["memory"]) >= 2 * maxmemory
    probe = " ".join(redis_container["readinessProbe"]["exec"]["command"])
    assert "PONG" in probe, "redis-cli exits 0 on an error reply: the probe reads the answer"
    for pod_spec in (redis["spec"]["template"]["spec"], pod):
        assert pod_spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert directives["appendfsync"] in ("always", "everysec")
    assert "everysec" in config and "always" in config, "redis.conf states both choices and what each loses"
    assert "requirepass" not in directives

    ref = env["XLSERVE_API_KEYS"]["valueFrom"]["secretKeyRef"]
    assert secret_value(ref) == EXAMPLE_SECRETS["api-keys"]

    service = find("Service", "xlserve")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()

    # the disk tier: a ReadWriteOnce volume of each pod's own (Redis holds the truth)
    state_dir = env["XLSERVE_STATE_DIR"]["value"]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == state_dir)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["ephemeral"]["volumeClaimTemplate"]["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert "XLSERVE_REDIS_URL" in env
    assert not [o for o in k8s_objects() if o["kind"] == "PersistentVolumeClaim" and "ReadWriteMany" in o["spec"]["accessModes"]]


def test_the_autoscaler_owns_the_replica_count():
    deployment, _, _ = server_container()
    assert "replicas" not in deployment["spec"], "an apply would reset what the HPA chose"
    (hpa,) = [o for o in k8s_objects() if o["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "xlserve"}
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    (pdb,) = [o for o in k8s_objects() if o["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert pdb["spec"].get("minAvailable", 1) < hpa["spec"]["minReplicas"], "a drain can still move a pod"


def test_network_policies_let_only_the_proxy_in_and_only_the_servers_reach_redis():
    policies = {o["metadata"]["name"]: o["spec"] for o in k8s_objects() if o["kind"] == "NetworkPolicy"}
    server_labels = server_container()[0]["spec"]["template"]["metadata"]["labels"]
    redis = find("Deployment", "xlserve-redis")
    redis_labels = redis["spec"]["template"]["metadata"]["labels"]

    def selects(spec, labels):
        return spec["podSelector"]["matchLabels"].items() <= labels.items()

    (server,) = [p for p in policies.values() if selects(p, server_labels)]
    (redis_policy,) = [p for p in policies.values() if selects(p, redis_labels)]
    assert set(server["policyTypes"]) == {"Ingress", "Egress"}
    # in: ingress-nginx and Prometheus only, on the http port
    sources = [peer for rule in server["ingress"] for peer in rule["from"]]
    assert {peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for peer in sources} == {"ingress-nginx", "prometheus"}
    assert all(port["port"] == "http" for rule in server["ingress"] for port in rule["ports"])
    # out: Redis and DNS only
    destinations = [peer["podSelector"]["matchLabels"] for rule in server["egress"] for peer in rule["to"]]
    assert redis_labels.items() >= destinations[0].items() and destinations[1] == {"k8s-app": "kube-dns"}
    # Redis: in from the server pods only
    (rule,) = redis_policy["ingress"]
    (peer,) = rule["from"]
    assert peer == {"podSelector": {"matchLabels": {k: server_labels[k] for k in peer["podSelector"]["matchLabels"]}}}
    assert "Ingress" in redis_policy["policyTypes"]


@pytest.mark.parametrize("variant", ["", "overlays/gpu"], ids=["base", "gpu"])
def test_no_pod_gets_service_link_variables(variant):
    """Kubernetes gives every container Docker-link variables for every Service in its namespace
    unless its pod says `enableServiceLinks: false`: the Services xlserve and xlserve-redis would
    give XLSERVE_SERVICE_HOST, XLSERVE_PORT_8000_TCP_ADDR, XLSERVE_REDIS_PORT=tcp://...:6379 and
    more, which the server's start-up check of XLSERVE_* names reports as unknown settings. No
    pod here uses them (the server finds Redis by the name in XLSERVE_REDIS_URL)."""
    objects = k8s_objects(variant)
    prefixes = {o["metadata"]["name"].upper().replace("-", "_") for o in objects if o["kind"] == "Service"}
    assert any(prefix.startswith("XLSERVE") for prefix in prefixes)  # why it matters here
    templates = [o for o in objects if "template" in o.get("spec", {})]
    assert {("Deployment", "xlserve"), ("Deployment", "xlserve-redis")} <= {(o["kind"], o["metadata"]["name"]) for o in templates}
    for obj in templates:
        assert obj["spec"]["template"]["spec"].get("enableServiceLinks") is False, f"{obj['kind']} {obj['metadata']['name']}"


def test_the_readme_says_what_the_network_policy_lets_the_servers_reach():
    """The shipped NetworkPolicy lets the server pods reach only the Redis pods here, on the ports
    it lists: the high-availability section's Sentinel and Cluster addresses (other pods, the
    sentinels' port) are blocked until it is changed, and the README says so and what to change."""
    section = re.search(r"^- \*\*High availability\.\*\*(.*?)(?=^- \*\*)", README.read_text(), re.S | re.M)
    assert section, "deploy/README.md has no high-availability item"
    text = " ".join(section.group(1).split())
    (server,) = [o for o in k8s_objects() if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "xlserve-server"]
    allowed = {str(port["port"]) for rule in server["spec"]["egress"] for port in rule.get("ports", [])}
    urls = re.findall(r"`(redis\+\w+://[^`]+)`", text)
    assert urls, "the section gives the Sentinel and Cluster URLs"
    ports = {port for url in urls for port in re.findall(r":(\d+)(?=[,/])", url)}
    blocked = ports - allowed
    assert blocked, "the Sentinel URL's port is one the policy does not list"
    assert "NetworkPolicy" in text and "networkpolicy.yaml" in text, "the section names the policy to change"
    for port in blocked:
        assert port in text.split("NetworkPolicy", 1)[1], f"the section says the policy blocks port {port}"
    redis_rule = server["spec"]["egress"][0]["to"][0]["podSelector"]["matchLabels"]
    assert "component=redis" in text or f"app.kubernetes.io/component: {redis_rule['app.kubernetes.io/component']}" in text


def test_the_gpu_overlay_asks_for_a_gpu_and_runs_on_cuda():
    _, pod, container = server_container("overlays/gpu")
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["XLSERVE_DEVICE"] == "cuda"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    # everything else is the base's: the same env names, probes and volumes
    _, base_pod, base_container = server_container()
    names = [e["name"] for e in container["env"]]
    assert set(names) == {e["name"] for e in base_container["env"]}
    assert names.index("REDIS_PASSWORD") < names.index("XLSERVE_REDIS_URL")  # $(REDIS_PASSWORD) still expands
    assert base_container["readinessProbe"] == container["readinessProbe"] and base_pod["volumes"] == pod["volumes"]


def xlserve_variables() -> dict[str, list[tuple[str, str | None]]]:
    """XLSERVE_* name -> [(where, value or None where it comes from a Secret)], from the
    manifests' container env and the images' ENV."""
    found: dict[str, list] = {}
    for obj in k8s_objects() + k8s_objects("overlays/gpu"):
        spec = obj.get("spec", {}).get("template", {}).get("spec", {})
        for container in spec.get("containers", []):
            for e in container.get("env", []):
                if e["name"].startswith("XLSERVE_"):
                    value = e.get("value")
                    ref = e.get("valueFrom", {}).get("secretKeyRef")
                    if ref is not None:
                        value = secret_value(ref)
                    found.setdefault(e["name"], []).append((f"{obj['kind']} {obj['metadata']['name']}", value))
    for path in DOCKERFILES:
        for key, value in dockerfile_env(dockerfile_instructions(path)).items():
            if key.startswith("XLSERVE_"):
                found.setdefault(key, []).append((path.name, value))
    return found


def test_every_xlserve_variable_is_a_setting_with_a_valid_value(monkeypatch):
    from xlserve.server.settings import Settings

    fields = set(Settings.flat_names())
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
            actual = Settings().flat()[name.removeprefix("XLSERVE_").lower()]  # raises when it does not validate
            assert str(actual) == value.strip() or actual == type(actual)(value), (where, name, value, actual)


# --- nginx


def nginx_seconds(value: str) -> float:
    """nginx's time syntax: a number with a unit (ms, s, m, h, d; seconds without one)."""
    match = re.fullmatch(r"(\d+)(ms|s|m|h|d)?", value)
    assert match, f"not an nginx time: {value!r}"
    scale = {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
    return int(match.group(1)) * scale


def nginx_upstreams(text: str) -> dict[str, dict[str, list[str]]]:
    """upstream name -> {directive: its arguments (of its last occurrence)}."""
    text = re.sub(r"#[^\n]*", "", text)
    upstreams = {}
    for name, body in re.findall(r"\bupstream\s+(\w+)\s*\{([^}]*)\}", text):
        directives = [d.split() for d in body.split(";") if d.strip()]
        upstreams[name] = {d[0]: d[1:] for d in directives}
    return upstreams


def uvicorn_keep_alive_seconds() -> float:
    """How long the server's uvicorn keeps an idle connection: what server/cli.py passes, else
    uvicorn's default."""
    import inspect

    import uvicorn

    source = (ROOT / "server" / "cli.py").read_text()
    if "timeout_keep_alive" in source:
        match = re.search(r"timeout_keep_alive\s*=\s*(\d+(?:\.\d+)?)\b", source)
        assert match, "server/cli.py sets timeout_keep_alive in a way this test does not read: update it"
        return float(match.group(1))
    return inspect.signature(uvicorn.Config).parameters["timeout_keep_alive"].default


def test_nginx_closes_idle_upstream_connections_before_uvicorn_does():
    """A pooled connection nginx reuses just as uvicorn closes it for idleness fails the request
    on it (a POST gets nginx's 502, and with max_fails=1 the replica is taken out). nginx keeps
    idle upstream connections 60 s unless told; uvicorn closes them after its keep-alive timeout
    (5 s): every upstream pool here closes its idle connections first."""
    server_side = uvicorn_keep_alive_seconds()
    configs = sorted((DEPLOY / "nginx").glob("*.conf"))
    assert configs
    pools = 0
    for path in configs:
        for name, directives in nginx_upstreams(path.read_text()).items():
            if "keepalive" not in directives:
                continue
            pools += 1
            assert "keepalive_timeout" in directives, f"{path.name}: upstream {name} keeps idle connections 60 s"
            (timeout,) = directives["keepalive_timeout"]
            assert nginx_seconds(timeout) < server_side, f"{path.name}: upstream {name}: {timeout} >= {server_side} s"
    assert pools, "the shipped config pools upstream connections"
    # ingress-nginx pools them too (60 s unless its ConfigMap says otherwise): the README says
    # what to set there, and no value written down is too long
    readme = README.read_text()
    assert "upstream-keepalive-timeout" in readme
    for path in (README, K8S / "base" / "ingress.yaml"):
        for value in re.findall(r"upstream-keepalive-timeout\W+(\d+)", path.read_text()):
            assert int(value) < server_side, f"{path.name}: upstream-keepalive-timeout {value}"
    assert re.search(r"upstream-keepalive-timeout\W+\d+", readme), "the README gives a value"


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


def test_the_dashboard_tells_errors_of_one_type_apart_by_code():
    """"model not found" and "session not found" are both not_found_error: a panel splits the
    error rate by code as well as type, under the model variable."""
    dashboard = json.loads(DASHBOARD.read_text())
    by_code = [q for q in dashboard_queries(dashboard)
               if "xlserve_request_errors_total" in q and re.search(r"\bby\s*\([^)]*\bcode\b", q)]
    assert by_code, "no panel aggregates xlserve_request_errors_total by code"
    assert all("$model" in q for q in by_code)
    assert {"model_not_found", "session_not_found"} <= error_code_labels()
    assert check_query('xlserve_request_errors_total{code="a free-form string"}')  # only codes the server writes


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
        # every panel of per-model series follows the model variable (the replica count, HTTP
        # responses, tier budgets and the processes are not per model)
        queried = {n for t in panel["targets"] for n in METRIC_NAME.findall(t["expr"])}
        assert queried or "up{" in panel["targets"][0]["expr"], panel["title"]
        per_model = any("model" in exported_series().get(name, ()) for name in queried)
        assert not per_model or any("$model" in t["expr"] for t in panel["targets"]), panel["title"]


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
    needed = {"pyproject.toml", "constraints.txt", pyproject()["project"]["readme"], *setuptools["package-dir"].values()}
    assert set(copies) == needed, f"{path.name} copies {sorted(copies)}; pyproject.toml builds from {sorted(needed)}"
    # each lands where pyproject.toml expects it, relative to the directory `pip install .` runs in
    for source, dest in copies.items():
        landed = Path(workdir) / dest if not dest.startswith("/") else Path(dest)
        landed = landed / Path(source).name if dest.endswith("/") else landed
        assert landed == Path(workdir) / source, (source, dest)
    installs = [rest for word, rest in build if word == "RUN" and re.search(r"\bpip install (-c constraints\.txt )?\.(\s|$)", rest)]
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
    # torch: the version constraints.txt pins (any build of it), which satisfies pyproject's range
    assert re.search(r'^ARG TORCH_SPEC="torch"$', text, re.MULTILINE)
    assert "torch>=2.4" in pyproject()["project"]["dependencies"]


# the one index written down: PyTorch's CPU-only wheels, the CPU image's default (a build arg)
CPU_TORCH_INDEX = 'ARG TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu"'


def test_no_urls_in_docker_and_deploy_files():
    """Index and registry locations are the builder's choice (build args), never written down,
    but for the CPU image's default torch index (the issue asks for the CPU build by default)."""
    assert CPU_TORCH_INDEX in (ROOT / "docker" / "Dockerfile").read_text()
    files = DOCKERFILES + [ROOT / ".dockerignore"] + [p for p in DEPLOY.rglob("*") if p.is_file()]
    for path in files:
        # nginx names its upstream groups as http://<group>: a name, not a location
        text = re.sub(r"proxy_pass http://\$\w+;", "", path.read_text()).replace(CPU_TORCH_INDEX, "")
        assert not re.search(r"https?://", text), path


# --- one dependency truth


def constraint_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name] = version
    return pins


def test_constraints_pin_what_the_environment_has_and_every_runtime_dependency():
    from importlib import metadata

    pins = constraint_pins()
    for requirement in pyproject()["project"]["dependencies"]:
        name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0).lower()
        if ";" in requirement and "win32" in requirement and sys.platform != "win32":
            assert name in pins or sys.platform == "win32"
        assert name in pins, f"{name} is not pinned in constraints.txt"
    assert "sentencepiece" in pins, "serving converted XLNet needs sentencepiece"
    # regenerating gives the same file: constraints.txt is what `make serve` installed here
    result = subprocess.run([sys.executable, str(ROOT / "docker" / "freeze_constraints.py")], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    torch_version = metadata.version("torch")
    if torch_version.split("+")[0] != pins["torch"]:
        pytest.skip(f"this environment has its own torch ({torch_version}): its pins are not the file's")
    assert result.stdout == (ROOT / "constraints.txt").read_text()


def test_make_and_both_images_install_from_the_constraints():
    makefile = (ROOT / "Makefile").read_text()
    assert "CONSTRAINTS := constraints.txt" in makefile
    assert re.search(r"^TORCH_PIN \?= \$\(shell grep '\^torch==' \$\(CONSTRAINTS\)\)$", makefile, re.MULTILINE)
    installs = [line for line in makefile.splitlines() if "pip install" in line]
    # the parity tests' second reference environment (.venv/hf-reference) is pinned by exact
    # versions of its own, installed apart (--target, --no-deps); every other install takes the constraints
    reference = [line for line in installs if "$(HF_REFERENCE_DIR)" in line]
    assert len(reference) == 1 and "--no-deps --target $(HF_REFERENCE_DIR) $(HF_REFERENCE)" in reference[0]
    pins = re.search(r"^HF_REFERENCE := (.+)$", makefile, re.MULTILINE).group(1).split()
    assert pins and all(re.fullmatch(r"[\w.-]+==[\w.]+", pin) for pin in pins), pins
    installs = [line for line in installs if line not in reference]
    assert installs and all(re.search(r"-c \$\((VENV)\)/constraints\.txt|-c \$\(CONSTRAINTS\)", line) for line in installs)
    for path in DOCKERFILES:
        runs = [rest for word, rest in dockerfile_instructions(path) if word == "RUN" and "pip install" in rest]
        assert len(runs) == 2, path.name  # torch, then the package
        assert all("-c constraints.txt" in run for run in runs), path.name
        assert any("TORCH_SPEC" in run for run in runs)
