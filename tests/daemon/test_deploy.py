"""The deployment files, checked offline: the Kubernetes manifests against the API's own
schemas (kubernetes-validate bundles them; strict: no field the schema does not know), and
each file's profinfer command against profinfer's own command line."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import kubernetes_validate
import yaml

from profinfer.cli import cli
from test_capabilities import WHY

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFEST = DEPLOY / "kubernetes" / "profinfer.yaml"
# each capability the manifest gives is justified by a run without it that fails
# (test_capabilities.WHY): the list here is that one, not a copy of the manifest's
NEEDED_CAPS = set(WHY)


def _docs():
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def _daemon_args_parse(args: list[str]) -> dict:
    """The daemon command's options as profinfer's own CLI parses them (nothing runs)."""
    assert args[0] == "daemon"
    ctx = cli.commands["daemon"].make_context("daemon", list(args[1:]))
    return ctx.params


def test_manifests_valid_strict():
    docs = _docs()
    assert {d["kind"] for d in docs} == {"Namespace", "ServiceAccount", "DaemonSet", "NetworkPolicy"}
    for d in docs:
        kubernetes_validate.validate(d, kubernetes_validate.latest_version(), strict=True)


def test_only_prometheus_reaches_the_metrics_port():
    """The NetworkPolicy selects the DaemonSet's pods and admits ingress on its metrics port
    alone, from one namespace's pods of one label (no rule open to all); /metrics there
    carries no paths."""
    docs = _docs()
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    (np,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert np["metadata"]["namespace"] == ds["metadata"]["namespace"]
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert np["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert "Ingress" in np["spec"]["policyTypes"]
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    port_names = {p.get("name"): p["containerPort"] for p in c["ports"]}
    listen_port = int(_daemon_args_parse(c["args"])["listen"].rsplit(":", 1)[1])
    (rule,) = np["spec"]["ingress"]
    assert [port_names.get(p["port"], p["port"]) for p in rule["ports"]] == [listen_port]
    for peer in rule["from"]:
        assert "ipBlock" not in peer
        assert peer["namespaceSelector"]["matchLabels"] and peer["podSelector"]["matchLabels"]
    assert _daemon_args_parse(c["args"])["labels"] in ("no-paths", "minimal")


def test_daemonset_not_privileged_and_each_capability_explained():
    ds = next(d for d in _docs() if d["kind"] == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["privileged"] is False and sc["capabilities"]["drop"] == ["ALL"]
    assert set(sc["capabilities"]["add"]) == NEEDED_CAPS
    text = MANIFEST.read_text()
    for cap in NEEDED_CAPS:       # each with a comment saying why
        assert re.search(rf"^\s*- {cap}\s+#\s*\S", text, re.M), cap
    assert c["resources"]["requests"] and c["resources"]["limits"]
    params = _daemon_args_parse(c["args"])
    port = int(params["listen"].rsplit(":", 1)[1])
    assert c["ports"][0]["containerPort"] == port
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/healthz"
    ann = ds["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) == port
    assert params["allow_remote"]          # listening on every address needs the flag


def test_systemd_unit_and_containerfile_commands_parse():
    unit = (DEPLOY / "systemd" / "profinfer.service").read_text()
    exec_start = next(l.split("=", 1)[1] for l in unit.splitlines() if l.startswith("ExecStart="))
    args = shlex.split(exec_start)
    assert args[0].endswith("/profinfer")
    params = _daemon_args_parse(args[1:])
    assert params["listen"].startswith("127.0.0.1:")
    caps = next(l.split("=", 1)[1].split() for l in unit.splitlines() if l.startswith("AmbientCapabilities="))
    assert {c.removeprefix("CAP_") for c in caps} == NEEDED_CAPS
    bounding = next(l.split("=", 1)[1].split() for l in unit.splitlines() if l.startswith("CapabilityBoundingSet="))
    assert set(bounding) == set(caps)
    for cap in caps:        # each with a line saying why
        assert re.search(rf"^#\s+{cap}\s+\S", unit, re.M), cap
    container = (DEPLOY / "Containerfile").read_text()
    cmd = re.search(r'^CMD \[(.*)\]$', container, re.M).group(1)
    _daemon_args_parse([a.strip().strip('"') for a in cmd.split(",")])
