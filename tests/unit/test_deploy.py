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
