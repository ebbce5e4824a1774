#!/usr/bin/env python3
"""Checks the Helm chart deploy/helm/tessera by rendering it (`helm template`) under several
values sets and inspecting the manifests:

- every object validates strictly against the Kubernetes 1.30 OpenAPI schema (the schemas ship
  inside the `kubernetes-validate` package: nothing is downloaded);
- every pool object carries `app.kubernetes.io/component=<pool>`;
- every container runs as non-root with a read-only root filesystem and no capabilities;
- the etcd endpoints reach every worker and the router;
- an HPA exists for a pool exactly when its autoscaling is enabled, and the Pods metrics of the
  default HPAs are series their pool exports and deploy/README.md's adapter rules expose;
- changing one pool's replicaCount changes that pool's Deployment and nothing else;
- values.schema.json rejects misspelt keys, and impossible combinations fail to render.

Usage: check_chart.py [--helm PATH] [--kube-version 1.30.0]. Prints one line per check and a
final `N passed, M failed`; exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import yaml

try:
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError
except ImportError:  # pragma: no cover - reported as a failure below
    kubernetes_validate = None

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "tessera"
VALUES_DIR = Path(__file__).resolve().parent / "values"
RELEASE = "tsr"
NAMESPACE = "serving"
POOLS = ["router", "encoder", "prefill", "decode"]
WORKERS = ["encoder", "prefill", "decode"]
COMPONENT = "app.kubernetes.io/component"
# Kinds from CRDs, which the Kubernetes schema does not cover; checked by hand below.
CRD_KINDS = {"ServiceMonitor"}


class Chart:
    def __init__(self, helm: str, kube_version: str):
        self.helm = helm
        self.kube_version = kube_version

    def run(self, values_files=(), values=None, sets=()):
        """`helm template`; returns (exit code, stdout, stderr)."""
        cmd = [
            self.helm, "template", RELEASE, str(CHART),
            "--namespace", NAMESPACE,
            "--kube-version", self.kube_version,
        ]
        tmp = None
        for f in values_files:
            cmd += ["-f", str(f)]
        if values is not None:
            tmp = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
            json.dump(values, tmp)
            tmp.close()
            cmd += ["-f", tmp.name]
        for s in sets:
            cmd += ["--set", s]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        finally:
            if tmp is not None:
                os.unlink(tmp.name)
        return p.returncode, p.stdout, p.stderr

    def lint(self, values_files=()):
        cmd = [self.helm, "lint", "--strict", str(CHART)]
        for f in values_files:
            cmd += ["-f", str(f)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, f"helm lint --strict failed:\n{p.stdout}{p.stderr}"

    def notes(self, values_files=()):
        """templates/NOTES.txt as `helm install --dry-run=client` prints it."""
        cmd = [self.helm, "install", RELEASE, str(CHART), "--namespace", NAMESPACE,
               "--dry-run=client"]
        for f in values_files:
            cmd += ["-f", str(f)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            raise AssertionError(f"helm install --dry-run failed: {p.stderr.strip()}")
        assert "NOTES:" in p.stdout, "no NOTES printed"
        return p.stdout.split("NOTES:", 1)[1]

    def render(self, values_files=(), values=None, sets=()):
        code, out, err = self.run(values_files, values, sets)
        if code != 0:
            raise AssertionError(f"helm template failed: {err.strip()}")
        return [d for d in yaml.safe_load_all(out) if d]


def key(obj):
    return (obj["kind"], obj["metadata"]["name"])


def by_kind(objs, kind):
    return [o for o in objs if o["kind"] == kind]


def find(objs, kind, name):
    hits = [o for o in objs if key(o) == (kind, name)]
    assert len(hits) == 1, f"expected one {kind}/{name}, found {len(hits)}"
    return hits[0]


def pool_name(pool):
    return f"{RELEASE}-tessera-{pool}"


def pod_spec(obj):
    if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return obj["spec"]["template"]["spec"]
    if obj["kind"] == "Pod":
        return obj["spec"]
    return None


def env_of(container):
    return {e["name"]: e for e in container.get("env", [])}


def enabled_pools(values_files):
    """The pools the chart's defaults plus these files enable."""
    merged = yaml.safe_load((CHART / "values.yaml").read_text())
    for f in values_files:
        deep_merge(merged, yaml.safe_load(Path(f).read_text()) or {})
    return merged, [p for p in POOLS if merged[p]["enabled"]]


def deep_merge(base, over):
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            deep_merge(base[k], v)
        else:
            base[k] = v
    return base


# --- checks on one rendering ------------------------------------------------------------------

def check_schema(objs, kube_version):
    assert kubernetes_validate is not None, "kubernetes-validate is not installed"
    problems = []
    for o in objs:
        if o["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(o, kube_version, strict=True)
        except SchemaNotFoundError:
            problems.append(f"{o['kind']}/{o['metadata']['name']}: no schema for {o['apiVersion']}")
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            problems.append(f"{o['kind']}/{o['metadata']['name']}: {path}: {e.message}")
    assert not problems, "\n    ".join(["invalid objects:"] + problems)


def check_component_labels(objs, pools):
    """Every object named after a pool carries that pool's component label, on the object, its
    selector and its pod template; every pool has its Deployment and Service."""
    for pool in pools:
        mine = [o for o in objs if o["metadata"]["name"] == pool_name(pool)]
        kinds = {o["kind"] for o in mine}
        assert {"Deployment", "Service"} <= kinds, f"{pool}: only {sorted(kinds)} rendered"
        for o in mine:
            labels = o["metadata"].get("labels", {})
            assert labels.get(COMPONENT) == pool, f"{key(o)} lacks {COMPONENT}={pool}"
            if o["kind"] == "Deployment":
                sel = o["spec"]["selector"]["matchLabels"]
                tpl = o["spec"]["template"]["metadata"]["labels"]
                assert sel.get(COMPONENT) == pool and tpl.get(COMPONENT) == pool, key(o)
                assert all(tpl.get(k) == v for k, v in sel.items()), f"{key(o)}: selector misses pods"
            if o["kind"] in ("Service",):
                assert o["spec"]["selector"].get(COMPONENT) == pool, key(o)
            if o["kind"] in ("PodDisruptionBudget", "ServiceMonitor"):
                assert o["spec"]["selector"]["matchLabels"].get(COMPONENT) == pool, key(o)
    for pool in set(POOLS) - set(pools):
        stray = [key(o) for o in objs if o["metadata"]["name"] == pool_name(pool)]
        assert not stray, f"disabled pool {pool} rendered {stray}"


def check_non_root(objs):
    seen = 0
    for o in objs:
        spec = pod_spec(o)
        if spec is None:
            continue
        pod_sc = spec.get("securityContext", {})
        for c in spec.get("initContainers", []) + spec["containers"]:
            seen += 1
            sc = {**pod_sc, **c.get("securityContext", {})}
            where = f"{key(o)} container {c['name']}"
            assert sc.get("runAsNonRoot") is True, f"{where}: runAsNonRoot is not true"
            assert sc.get("runAsUser", 1) != 0, f"{where}: runs as uid 0"
            csc = c.get("securityContext", {})
            assert csc.get("readOnlyRootFilesystem") is True, f"{where}: writable root filesystem"
            assert csc.get("allowPrivilegeEscalation") is False, f"{where}: privilege escalation"
            assert "ALL" in csc.get("capabilities", {}).get("drop", []), f"{where}: keeps capabilities"
        assert spec.get("automountServiceAccountToken") is False, f"{key(o)}: mounts an API token"
    assert seen, "no containers rendered"


def check_etcd_wiring(objs, pools, expected):
    """TESSERA_ETCD (the daemons' --etcd) and TESSERA_CLUSTER reach every pool container."""
    for pool in pools:
        dep = find(objs, "Deployment", pool_name(pool))
        c = dep["spec"]["template"]["spec"]["containers"][0]
        env = env_of(c)
        assert env.get("TESSERA_ETCD", {}).get("value") == expected, (
            f"{pool}: TESSERA_ETCD={env.get('TESSERA_ETCD')} expected {expected!r}")
        assert env.get("TESSERA_CLUSTER", {}).get("value"), f"{pool}: no TESSERA_CLUSTER"


def check_hpas(objs, merged, pools):
    hpas = {o["metadata"]["name"]: o for o in by_kind(objs, "HorizontalPodAutoscaler")}
    want = {pool_name(p) for p in pools if merged[p]["autoscaling"]["enabled"]}
    assert set(hpas) == want, f"HPAs {sorted(hpas)}, expected {sorted(want)}"
    for pool in pools:
        dep = find(objs, "Deployment", pool_name(pool))
        a = merged[pool]["autoscaling"]
        if a["enabled"]:
            h = hpas[pool_name(pool)]
            assert h["apiVersion"] == "autoscaling/v2"
            ref = h["spec"]["scaleTargetRef"]
            assert (ref["kind"], ref["name"]) == ("Deployment", pool_name(pool)), ref
            assert h["spec"]["minReplicas"] == a["minReplicas"]
            assert h["spec"]["maxReplicas"] == a["maxReplicas"]
            assert h["spec"]["metrics"] == a["metrics"], f"{pool}: metrics differ from values"
            # The HPA owns the replica count: the Deployment must not fight it.
            assert "replicas" not in dep["spec"], f"{pool}: replicas set under an HPA"
        else:
            assert dep["spec"]["replicas"] == merged[pool]["replicaCount"], pool


def check_pool_wiring(objs, merged, pools):
    """Ports, probes, config, model mount and services of each pool."""
    cm = [o for o in by_kind(objs, "ConfigMap") if o["metadata"]["name"].endswith("-engine")]
    assert len(cm) == 1, "one engine ConfigMap"
    cm = cm[0]
    for k in ("TESSERA_MODEL", "TESSERA_PAGE_TOKENS", "TESSERA_SNAPSHOT_INTERVAL"):
        assert k in cm["data"], f"ConfigMap lacks {k}"
    assert cm["data"]["TESSERA_PAGE_TOKENS"] == str(merged["engine"]["pageTokens"])
    if merged["engine"]["device"]:
        assert cm["data"]["TESSERA_DEVICE"] == merged["engine"]["device"]
    model = merged["model"]
    for pool in pools:
        dep = find(objs, "Deployment", pool_name(pool))
        spec = dep["spec"]["template"]["spec"]
        c = spec["containers"][0]
        assert c["command"] == merged[pool]["command"], f"{pool}: command {c['command']}"
        refs = [e["configMapRef"]["name"] for e in c.get("envFrom", []) if "configMapRef" in e]
        assert cm["metadata"]["name"] in refs, f"{pool}: does not read the engine ConfigMap"
        env = env_of(c)
        secret = env["TESSERA_AUTH_SECRET"]["valueFrom"]["secretKeyRef"]
        if merged["auth"]["existingSecret"]:
            assert secret == {"name": merged["auth"]["existingSecret"],
                              "key": merged["auth"]["existingSecretKey"]}, secret
        else:
            find(objs, "Secret", secret["name"])
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        svc = find(objs, "Service", pool_name(pool))
        svc_ports = {p["name"] for p in svc["spec"]["ports"]}
        if pool == "router":
            assert {"http", "grpc"} <= set(ports), ports
            assert svc_ports == {"http", "grpc"}, svc_ports
            assert c["readinessProbe"]["httpGet"]["path"] == "/health"
            assert c["readinessProbe"]["httpGet"]["port"] == "http"
            assert c["livenessProbe"]["grpc"]["port"] == ports["grpc"]
            assert env["TESSERA_HOST"]["value"] == "0.0.0.0"
        else:
            assert {"grpc", "transfer", "metrics"} <= set(ports), ports
            assert svc["spec"].get("clusterIP") == "None", f"{pool}: Service is not headless"
            assert {"grpc", "transfer", "metrics"} <= svc_ports, svc_ports
            assert c["readinessProbe"]["grpc"]["port"] == ports["grpc"]
            assert c["startupProbe"]["grpc"]["port"] == ports["grpc"]
            assert c["livenessProbe"]["httpGet"]["port"] == "metrics"
            # The listener binds (and so registers) the pod IP; metrics are always served.
            assert env["TESSERA_LISTEN"]["value"] == f"$(POD_IP):{ports['grpc']}"
            assert env["TESSERA_TRANSFER_LISTEN"]["value"].endswith(f":{ports['transfer']}")
            assert env["TESSERA_METRICS_LISTEN"]["value"].endswith(f":{ports['metrics']}")
            if pool != "encoder":
                assert env["TESSERA_KV_MEMORY"]["value"] == str(merged[pool]["kvMemory"])
                assert env["TESSERA_MAX_RUNNING"]["value"] == str(merged[pool]["maxRunning"])
            assert spec["terminationGracePeriodSeconds"] > merged[pool]["drainTimeout"], (
                f"{pool}: the grace period does not cover the drain")
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert mounts["model"]["readOnly"] is True, f"{pool}: model mounted writable"
        assert cm["data"]["TESSERA_MODEL"].startswith(mounts["model"]["mountPath"])
        vols = {v["name"]: v for v in spec["volumes"]}
        if model["existingClaim"]:
            pvc = vols["model"]["persistentVolumeClaim"]
            assert pvc == {"claimName": model["existingClaim"], "readOnly": True}, pvc
            assert "initContainers" not in spec
        elif model["hostPath"]:
            assert vols["model"]["hostPath"]["path"] == model["hostPath"]
            assert "initContainers" not in spec
        else:
            assert "emptyDir" in vols["model"]
            init = spec["initContainers"][0]
            assert init["command"] == ["tessera", "init-model"]
            assert cm["data"]["TESSERA_MODEL"] in init["args"]
        if model["dir"]:
            assert cm["data"]["TESSERA_MODEL"].endswith("/" + model["dir"])
        resources = merged[pool].get("resources") or {}
        if resources:
            assert c["resources"] == json.loads(json.dumps(resources)), f"{pool}: resources"
        for field in ("nodeSelector", "tolerations", "affinity"):
            if merged[pool].get(field):
                assert spec[field] == merged[pool][field], f"{pool}: {field}"
        if merged[pool]["podDisruptionBudget"]["enabled"]:
            pdb = find(objs, "PodDisruptionBudget", pool_name(pool))
            assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]


def check_service_monitors(objs, merged, pools):
    sms = {o["metadata"]["name"]: o for o in by_kind(objs, "ServiceMonitor")}
    if not merged["metrics"]["serviceMonitor"]["enabled"]:
        assert not sms, "ServiceMonitors rendered while disabled"
        return
    assert set(sms) == {pool_name(p) for p in pools}, sorted(sms)
    for pool in pools:
        sm = sms[pool_name(pool)]
        assert sm["apiVersion"] == "monitoring.coreos.com/v1"
        for k, v in merged["metrics"]["serviceMonitor"]["labels"].items():
            assert sm["metadata"]["labels"].get(k) == v, f"{pool}: label {k}"
        svc = find(objs, "Service", pool_name(pool))
        selected = sm["spec"]["selector"]["matchLabels"]
        assert all(svc["metadata"]["labels"].get(k) == v for k, v in selected.items()), (
            f"{pool}: ServiceMonitor does not select its Service")
        names = {p["name"] for p in svc["spec"]["ports"]}
        for ep in sm["spec"]["endpoints"]:
            assert ep["port"] in names, f"{pool}: scrapes unknown port {ep['port']}"
            assert ep["path"] == "/metrics"


def check_etcd_objects(objs, merged):
    sts = by_kind(objs, "StatefulSet")
    if not merged["etcd"]["enabled"]:
        assert not sts, "bundled etcd rendered while disabled"
        return
    assert len(sts) == 1
    s = sts[0]
    n = merged["etcd"]["replicaCount"]
    assert s["spec"]["replicas"] == n
    assert s["metadata"]["labels"][COMPONENT] == "etcd"
    args = s["spec"]["template"]["spec"]["containers"][0]["args"]
    cluster = [a for a in args if a.startswith("--initial-cluster=")][0]
    assert cluster.count("=http://") == n, cluster
    assert ("volumeClaimTemplates" in s["spec"]) == merged["etcd"]["persistence"]["enabled"]
    pdbs = [o for o in by_kind(objs, "PodDisruptionBudget") if o["metadata"]["name"] == s["metadata"]["name"]]
    if n > 1:
        assert pdbs and pdbs[0]["spec"]["minAvailable"] == n // 2 + 1, "etcd quorum PDB"


def check_notes(chart, paths, merged, pools):
    text = chart.notes(paths)
    for pool in pools:
        assert pool_name(pool) in text, f"NOTES do not name {pool_name(pool)}"
    for pool in set(POOLS) - set(pools):
        assert pool_name(pool) not in text, f"NOTES name the disabled {pool}"
    assert expected_etcd(merged) in text, "NOTES do not give the etcd endpoints"
    if "router" in pools:
        assert f"svc/{pool_name('router')}" in text, "NOTES do not say how to reach the router"


def expected_etcd(merged):
    e = merged["etcd"]
    if not e["enabled"]:
        return ",".join(e["endpoints"])
    name = f"{RELEASE}-tessera-etcd"
    if e["replicaCount"] == 1:
        return f"{name}.{NAMESPACE}.svc:{e['clientPort']}"
    return ",".join(
        f"{name}-{i}.{name}-headless.{NAMESPACE}.svc:{e['clientPort']}"
        for i in range(e["replicaCount"]))


# --- the suite ------------------------------------------------------------------------------------

SCENARIOS = {
    "defaults": [],
    "autoscaling": ["autoscaling.yaml"],
    "external-etcd": ["external-etcd.yaml"],
    "hostpath-model": ["hostpath-model.yaml"],
    "servicemonitor": ["servicemonitor.yaml"],
    "gpu": ["gpu.yaml"],
    "amd-gpu": ["amd-gpu.yaml"],
    "gpu+autoscaling+servicemonitor": ["gpu.yaml", "autoscaling.yaml", "servicemonitor.yaml"],
}


def tests(chart: Chart):
    """Yields (name, function) pairs."""
    for scenario, files in SCENARIOS.items():
        paths = [VALUES_DIR / f for f in files]
        merged, pools = enabled_pools(paths)
        cache = {}

        def objs(paths=paths, cache=cache):
            if "objs" not in cache:
                cache["objs"] = chart.render(paths)
            return cache["objs"]

        yield f"{scenario}: helm lint --strict", lambda paths=paths: chart.lint(paths)
        yield f"{scenario}: every object validates against Kubernetes {chart.kube_version} (strict)", \
            lambda objs=objs: check_schema(objs(), chart.kube_version)
        yield f"{scenario}: every pool object carries its component label", \
            lambda objs=objs, pools=pools: check_component_labels(objs(), pools)
        yield f"{scenario}: every container runs non-root, read-only, without capabilities", \
            lambda objs=objs: check_non_root(objs())
        yield f"{scenario}: etcd endpoints reach every worker and the router", \
            lambda objs=objs, pools=pools, merged=merged: check_etcd_wiring(objs(), pools, expected_etcd(merged))
        yield f"{scenario}: an HPA per pool exactly when its autoscaling is enabled", \
            lambda objs=objs, merged=merged, pools=pools: check_hpas(objs(), merged, pools)
        yield f"{scenario}: ports, probes, config, secret, model volume and PDB of each pool", \
            lambda objs=objs, merged=merged, pools=pools: check_pool_wiring(objs(), merged, pools)
        yield f"{scenario}: ServiceMonitors match the pools' Services", \
            lambda objs=objs, merged=merged, pools=pools: check_service_monitors(objs(), merged, pools)
        yield f"{scenario}: bundled etcd objects", \
            lambda objs=objs, merged=merged: check_etcd_objects(objs(), merged)
        yield f"{scenario}: NOTES name every pool and the etcd endpoints", \
            lambda paths=paths, merged=merged, pools=pools: check_notes(chart, paths, merged, pools)

    for pool in POOLS:
        yield f"replicaCount of {pool} changes only the {pool} Deployment", \
            lambda pool=pool: check_replicas_isolated(chart, pool)

    yield "one pool's autoscaling adds only that pool's HPA", lambda: check_hpa_isolated(chart)
    yield "the default HPAs' Pods metrics are exported by their pool and exposed by the README's adapter rules", \
        check_default_pods_metrics
    yield "a typo'd pool key in a values file is rejected by the schema", \
        lambda: expect_failure(chart, [VALUES_DIR / "typo-pool-key.yaml"], None, "replicaCont")
    for desc, values, needle in TYPOS:
        yield f"schema rejects {desc}", \
            lambda values=values, needle=needle: expect_failure(chart, [], values, needle)
    for desc, values, needle in IMPOSSIBLE:
        yield f"rendering fails: {desc}", \
            lambda values=values, needle=needle: expect_failure(chart, [], values, needle)
    yield "auth.secret lands in the Secret the pools read", lambda: check_literal_secret(chart)
    yield "the generated secret is random when no install exists", lambda: check_random_secret(chart)


TYPOS = [
    ("a misspelt top-level pool (decoder)", {"decoder": {"replicaCount": 2}}, "decoder"),
    ("a misspelt autoscaling key", {"decode": {"autoscaling": {"enable": True}}}, "enable"),
    ("a misspelt router service port", {"router": {"service": {"htpPort": 80}}}, "htpPort"),
    ("a router-only key on a worker pool", {"prefill": {"servedModelName": "x"}}, "servedModelName"),
    ("a string replica count", {"prefill": {"replicaCount": "two"}}, "replicaCount"),
    ("a malformed kvMemory", {"decode": {"kvMemory": "80GB"}}, "kvMemory"),
]

IMPOSSIBLE = [
    ("no etcd at all", {"etcd": {"enabled": False, "endpoints": []}}, "etcd"),
    ("bundled and external etcd at once", {"etcd": {"endpoints": ["e:2379"]}}, "etcd"),
    ("both a claim and a hostPath for the model",
     {"model": {"existingClaim": "m", "hostPath": "/m"}}, "model"),
    ("a router without decode workers", {"decode": {"enabled": False}}, "decode"),
    ("maxReplicas below minReplicas",
     {"prefill": {"autoscaling": {"enabled": True, "minReplicas": 4, "maxReplicas": 2}}}, "maxReplicas"),
]

# Fixed so that two renderings differ only where the values do.
FIXED = {"auth": {"secret": "fixed-for-comparison"}, "encoder": {"enabled": True}}


def check_replicas_isolated(chart, pool):
    base = {key(o): o for o in chart.render(values=FIXED)}
    values = copy.deepcopy(FIXED)
    values.setdefault(pool, {})["replicaCount"] = 7
    changed = {key(o): o for o in chart.render(values=values)}
    assert set(base) == set(changed), "the set of objects changed"
    diff = sorted(k for k in base if base[k] != changed[k])
    assert diff == [("Deployment", pool_name(pool))], f"changed: {diff}"
    a, b = base[diff[0]], changed[diff[0]]
    assert b["spec"]["replicas"] == 7
    a["spec"].pop("replicas"), b["spec"].pop("replicas")
    assert a == b, "the Deployment changed beyond spec.replicas"


def check_hpa_isolated(chart):
    base = {key(o): o for o in chart.render(values=FIXED)}
    values = copy.deepcopy(FIXED)
    values["decode"] = {"autoscaling": {"enabled": True}}
    changed = {key(o): o for o in chart.render(values=values)}
    added = sorted(set(changed) - set(base))
    assert added == [("HorizontalPodAutoscaler", pool_name("decode"))], added
    assert set(base) - set(changed) == set()
    diff = sorted(k for k in base if base[k] != changed[k])
    assert diff == [("Deployment", pool_name("decode"))], diff
    metric = changed[added[0]]["spec"]["metrics"][0]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "tessera_running_batch"


# Where each worker pool's /metrics series are named (prefill and decode share the runtime's).
METRICS_SOURCES = {
    "encoder": ["encoder-worker/src/lib.rs"],
    "prefill": ["prefill-worker/src/runtime/metrics.rs", "prefill-worker/src/lib.rs"],
    "decode": ["prefill-worker/src/runtime/metrics.rs", "decode-worker/src/lib.rs"],
}


def check_default_pods_metrics():
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (ROOT / "deploy" / "README.md").read_text()
    for pool, sources in METRICS_SOURCES.items():
        text = "".join((ROOT / f).read_text() for f in sources)
        names = [m["pods"]["metric"]["name"] for m in defaults[pool]["autoscaling"]["metrics"]
                 if m["type"] == "Pods"]
        assert names, f"{pool}: no Pods metric among the defaults"
        for name in names:
            assert f'"{name}"' in text, f"{pool}: the workers do not export {name}"
            assert f'as: "{name}"' in readme, f"{pool}: no adapter rule in deploy/README.md exposes {name}"


def expect_failure(chart, files, values, needle):
    code, _, err = chart.run(files, values)
    assert code != 0, "helm template succeeded"
    assert needle in err, f"the error does not name {needle!r}: {err.strip()}"


def check_literal_secret(chart):
    import base64
    objs = chart.render(values={"auth": {"secret": "s3cret"}})
    s = find(objs, "Secret", f"{RELEASE}-tessera-auth")
    assert base64.b64decode(s["data"]["auth-secret"]).decode() == "s3cret"


def check_random_secret(chart):
    one = find(chart.render(), "Secret", f"{RELEASE}-tessera-auth")["data"]["auth-secret"]
    two = find(chart.render(), "Secret", f"{RELEASE}-tessera-auth")["data"]["auth-secret"]
    assert one != two and len(one) >= 48, "the generated secret is not random"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--helm", default=os.environ.get("HELM", str(ROOT / "target" / "helm" / "helm")))
    ap.add_argument("--kube-version", default="1.30.0")
    args = ap.parse_args()
    chart = Chart(args.helm, args.kube_version)
    passed = failed = 0
    for name, fn in tests(chart):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - every failure is reported the same way
            failed += 1
            msg = str(e) if isinstance(e, AssertionError) else traceback.format_exc()
            print(f"FAIL {name}\n    {msg.strip()}")
        else:
            passed += 1
            print(f"ok   {name}")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
