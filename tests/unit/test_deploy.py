"""The deploy files agree with the code: compose parses, chart values fit their schema and the
settings the chart renders are settings kvkeeper accepts. (No Docker engine or helm runs here.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from proxy.settings import load_settings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CHART = DEPLOY / "helm" / "kvkeeper"


def test_compose_wires_kvkeeper_to_redis_and_vllm() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"redis", "vllm", "kvkeeper"}
    kvk = services["kvkeeper"]
    assert kvk["environment"]["KVKEEPER_REDIS_URL"].startswith("redis://redis:")
    assert kvk["command"][:2] == ["serve", "--port"]
    assert "--engine-events" in kvk["command"]
    vllm_args = " ".join(services["vllm"]["command"])
    for flag in (
        "--enable-prefix-caching",
        "sha256_cbor",
        "--enable-prompt-tokens-details",
        "enable_kv_cache_events",
    ):
        assert flag in vllm_args
    assert (
        services["vllm"]["environment"]["PYTHONHASHSEED"]
        == kvk["environment"]["KVKEEPER_RETENTION__HASH_SEED"]
    )


def test_dockerfile_copies_every_package() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    for pkg in ("proxy", "adapters", "policy", "loadgen"):
        assert f"COPY {pkg} {pkg}" in text
    assert 'ENTRYPOINT ["kvkeeper"]' in text


def test_chart_values_match_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.validate(values, schema)
    bad = {**values, "engines": [{"url": "vllm:8000"}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_chart_config_keys_are_kvkeeper_settings() -> None:
    """Render the ConfigMap's settings by hand from values.yaml and load them as Settings."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    template = (CHART / "templates" / "configmap.yaml").read_text()
    keys = set(re.findall(r"^\s+(\w+):", template.split("kvkeeper.yaml: |", 1)[1], re.M))
    assert {
        "budget_share",
        "safety_fraction",
        "hash_seed",
        "max_ttl_s",
        "max_sessions_per_tenant",
    } <= keys
    settings = load_settings(
        engines=values["engines"],
        retention={
            "budget_share": values["retention"]["budgetShare"],
            "safety_fraction": values["retention"]["safetyFraction"],
            "hash_seed": values["retention"]["hashSeed"],
        },
        limits={
            "max_ttl_s": values["limits"]["maxTtlS"],
            "max_sessions_per_tenant": values["limits"]["maxSessionsPerTenant"],
        },
    )
    assert settings.engines[0].events == values["engines"][0]["events"]


def test_chart_lmcache_tier_per_engine() -> None:
    """An engine's optional ``lmcache`` block: the schema checks it, and the keys the ConfigMap
    renders it to are kvkeeper's ``OffloadTierSpec`` fields."""
    jsonschema = pytest.importorskip("jsonschema")
    from proxy.settings import OffloadTierSpec

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    tier = {
        "coordinatorUrl": "http://lmcache-0.lmcache:9000",
        "serverUrl": "http://lmcache-0.lmcache:8080",
        "modelName": "meta-llama/Llama-3.1-8B-Instruct",
        "chunkSize": 256,
    }
    engine = {**values["engines"][0], "lmcache": tier}
    jsonschema.validate({**values, "engines": [engine]}, schema)
    for broken in ({k: v for k, v in tier.items() if k != "modelName"}, {**tier, "chunk": 1}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**values, "engines": [{**engine, "lmcache": broken}]}, schema)

    template = (CHART / "templates" / "configmap.yaml").read_text()
    block = template.split("lmcache:", 1)[1].split("{{- end }}", 1)[0]
    rendered = dict(re.findall(r"^\s+(\w+): \{\{ \.(\w+)", block, re.M))
    assert set(rendered) == set(OffloadTierSpec.model_fields)
    settings = load_settings(
        engines=[{"url": engine["url"], "lmcache": {k: tier[v] for k, v in rendered.items()}}],
        retention={
            "tier_pin_share": values["retention"]["tierPinShare"],
            "tier_pin_anchors": values["retention"]["tierPinAnchors"],
        },
    )
    spec = settings.engines[0].lmcache
    assert spec is not None and spec.model_name == tier["modelName"] and spec.chunk_size == 256
    assert "tier_pin_share" in template and "tier_pin_anchors" in template
