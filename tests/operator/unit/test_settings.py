"""Unit: the kopf settings the operator applies (watch timeouts, server-side pod filtering)."""
import kopf
from kopf._cogs.structs.references import Resource

from sampler_operator import settings


def test_watch_timeouts_and_names(monkeypatch):
    monkeypatch.setenv("SAMPLER_OPERATOR_WATCH_SERVER_TIMEOUT", "120")
    cfg = settings.OperatorConfig.from_env()
    st = kopf.OperatorSettings()
    settings.apply(st, cfg)
    assert st.watching.server_timeout == 120 and st.watching.client_timeout == 132  # client > server
    assert st.watching.connect_timeout == 30
    assert st.persistence.finalizer == "sampler.rl.dev/finalizer"


def test_only_our_pods_are_watched():
    st = kopf.OperatorSettings()
    settings.apply(st, settings.OperatorConfig())
    pods = Resource(group="", version="v1", plural="pods", kind="Pod", namespaced=True)
    crs = Resource(group="sampler.rl.dev", version="v1alpha1", plural="samplerreplicas", kind="SamplerReplica")
    assert st.watching.label_selectors.collect(pods) == ["app.kubernetes.io/managed-by=sampler-operator"]
    assert st.watching.label_selectors.collect(crs) == []
    # The gateways' routing Leases only (the pool's loop wakes on their acknowledgements), filtered
    # by the API server: not every node's heartbeat.
    leases = Resource(group="coordination.k8s.io", version="v1", plural="leases", kind="Lease", namespaced=True)
    assert st.watching.label_selectors.collect(leases) == ["sampler.rl.dev/gateway"]


def test_test_seams_are_off_by_default_and_the_setting_is_strict(monkeypatch):
    import pytest
    monkeypatch.delenv("SAMPLER_OPERATOR_ALLOW_TEST_SEAMS", raising=False)
    assert settings.OperatorConfig.from_env().allow_test_seams is False
    for raw, want in (("true", True), ("1", True), ("false", False), ("", False)):
        monkeypatch.setenv("SAMPLER_OPERATOR_ALLOW_TEST_SEAMS", raw)
        assert settings.OperatorConfig.from_env().allow_test_seams is want
    monkeypatch.setenv("SAMPLER_OPERATOR_ALLOW_TEST_SEAMS", "maybe")
    with pytest.raises(ValueError, match="SAMPLER_OPERATOR_ALLOW_TEST_SEAMS"):
        settings.OperatorConfig.from_env()


def test_the_metrics_port_is_a_port_or_zero_and_refused_otherwise(monkeypatch):
    import pytest
    monkeypatch.delenv("SAMPLER_OPERATOR_METRICS_PORT", raising=False)
    monkeypatch.delenv("SAMPLER_OPERATOR_METRICS_HOST", raising=False)
    cfg = settings.OperatorConfig.from_env()
    assert (cfg.metrics_host, cfg.metrics_port) == ("0.0.0.0", 0)   # off unless set (the chart sets it)
    monkeypatch.setenv("SAMPLER_OPERATOR_METRICS_PORT", "9090")
    monkeypatch.setenv("SAMPLER_OPERATOR_METRICS_HOST", "127.0.0.1")
    cfg = settings.OperatorConfig.from_env()
    assert (cfg.metrics_host, cfg.metrics_port) == ("127.0.0.1", 9090)
    for bad in ("http", "-1", "70000"):
        monkeypatch.setenv("SAMPLER_OPERATOR_METRICS_PORT", bad)
        with pytest.raises(ValueError, match="SAMPLER_OPERATOR_METRICS_PORT"):
            settings.OperatorConfig.from_env()
