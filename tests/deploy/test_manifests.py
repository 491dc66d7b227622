"""deploy/: the Kubernetes manifests, the Dockerfiles and the systemd units.

Nothing here starts a container or a cluster (there is no container engine or
cluster where these run). What is checked:

- every kustomization (base and each overlay) renders with ``kubectl kustomize``, and
  every rendered object, and every raw manifest file, validates in strict mode
  (unknown fields are errors) against the Kubernetes schemas bundled with
  kubernetes-validate (``KUBE_VERSION``);
- the rendered objects make sense together: probes on every container, on declared
  ports; scrape annotations on every pod, on its metrics port; non-root, read-only
  containers; Service selectors and target ports that hit a pod; addresses in the
  command lines that name a Service and port that exist; the store's /dev/shm and
  memory sized above its DRAM tier; GPUs only in the gpu overlay; the conductor
  replicated with leader election on etcd and a budget that keeps one up;
- every ``crescent`` command line (containers, systemd ExecStart with its example
  EnvironmentFile) is accepted by the real CLI parser (``kvstore.cli.build_parser``),
  which catches typo'd subcommands, flags and values;
- the Dockerfiles use known instructions, pin their base images to exact versions,
  run as a non-root user with ``crescent`` as the entrypoint, and install the torch
  pyproject.toml pins;
- ``systemd-analyze verify`` accepts every unit.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]' (kubernetes-validate)")

from kvstore.cli import build_parser  # noqa: E402
from kvstore.config import parse_size  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
SYSTEMD = DEPLOY / "systemd"
DOCKER = DEPLOY / "docker"

# The newest Kubernetes release whose schemas kubernetes-validate==1.37.0 bundles.
KUBE_VERSION = "1.37.0"
# The oldest release the manifests are meant for: native gRPC probes are GA since 1.27.
KUBE_MIN_VERSION = "1.27.0"

KUSTOMIZATIONS = ["base", "overlays/cpu-demo", "overlays/gpu"]
IMAGE_TAG = {"base": "0.1.0-cpu", "overlays/cpu-demo": "0.1.0-cpu", "overlays/gpu": "0.1.0-cuda"}
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
# Values for the downward-API variables the command lines use, when parsing them.
FIELD_REF_DUMMIES = {"status.podIP": "10.0.0.7", "metadata.name": "crescent-store-0"}


# ---------------------------------------------------------------- helpers


@functools.lru_cache(maxsize=None)
def _render(kustomization: str) -> tuple:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not found: cannot render the kustomizations")
    out = subprocess.run([kubectl, "kustomize", str(K8S / kustomization)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, f"kubectl kustomize {kustomization} failed:\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def render(kustomization: str) -> list[dict]:
    return [json.loads(json.dumps(d)) for d in _render(kustomization)]  # a fresh copy per caller


def kn(obj: dict) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def workloads(objs: list[dict]) -> list[dict]:
    return [o for o in objs if o["kind"] in WORKLOAD_KINDS]


def containers(workload: dict) -> list[dict]:
    return workload["spec"]["template"]["spec"]["containers"]


def is_crescent(container: dict) -> bool:
    return container["image"].split(":")[0] == "crescent"


def container_ports(container: dict) -> tuple[set[int], set[str]]:
    ports = container.get("ports", [])
    return {p["containerPort"] for p in ports}, {p["name"] for p in ports if "name" in p}


def validate(obj: dict, version: str = KUBE_VERSION) -> None:
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{kn(obj)} does not validate against Kubernetes {version}: {path}: {exc.message}")


def strict_parser() -> argparse.ArgumentParser:
    """The real ``crescent`` parser, refusing abbreviated flags (argparse accepts any unique
    prefix by default: a manifest should spell the flag the docs name)."""
    parser = build_parser()
    todo = [parser]
    while todo:
        p = todo.pop()
        p.allow_abbrev = False
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += list(action.choices.values())
    return parser


def parse_cli(argv: list[str], where: str):
    """Parse ``argv`` (no program name) with the real ``crescent`` parser; fail with its message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return strict_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{where}: `crescent {shlex.join(argv)}` is refused by the CLI (exit {exc.code}):\n"
                    f"{err.getvalue()}")


def container_argv(container: dict, where: str) -> list[str]:
    """The container's crescent arguments with Kubernetes' $(VAR) expansion done, every
    variable resolved from the container's own env (literal values, downward API)."""
    assert container.get("command") == ["crescent"], f"{where}: command must be [crescent], " \
                                                     f"got {container.get('command')}"
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = FIELD_REF_DUMMIES[e["valueFrom"]["fieldRef"]["fieldPath"]]

    def expand(arg: str) -> str:
        def one(m: re.Match) -> str:
            assert m.group(1) in env, f"{where}: $({m.group(1)}) in args is not in the container's env " \
                                      f"(Kubernetes would pass it on literally)"
            return env[m.group(1)]
        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, str(arg))

    return [expand(a) for a in container.get("args", [])]


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def k8s_quantity(q: str | int) -> int:
    """Bytes of a Kubernetes memory quantity (binary suffixes, plain numbers)."""
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(q))
    assert m, f"unexpected quantity {q!r}"
    return int(m.group(1)) * {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[m.group(2)]


def all_crescent_containers():
    for k in KUSTOMIZATIONS:
        for w in workloads(render(k)):
            for c in containers(w):
                if is_crescent(c):
                    yield k, w, c


def manifest_files() -> list[Path]:
    """Every manifest file under deploy/k8s that is a whole object (not a kustomization,
    not a patch: patches are partial and are checked in the renderings)."""
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml" and not p.name.startswith("patch-"))


# ---------------------------------------------------------------- schema validation


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
@pytest.mark.parametrize("version", [KUBE_VERSION, KUBE_MIN_VERSION])
def test_rendering_validates_strictly(kustomization, version):
    objs = render(kustomization)
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "StatefulSet", "Service"} <= kinds, kinds
    for obj in objs:
        validate(obj, version)


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_raw_manifest_validates_strictly(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs, f"{path} holds no object"
    for obj in docs:
        validate(obj)


def test_every_manifest_file_is_used():
    """A file the kustomization does not name is never applied: a silent mistake."""
    for kfile in K8S.rglob("kustomization.yaml"):
        k = yaml.safe_load(kfile.read_text())
        named = {(kfile.parent / r).resolve() for r in k.get("resources", [])}
        named |= {(kfile.parent / p["path"]).resolve() for p in k.get("patches", []) if "path" in p}
        for p in kfile.parent.glob("*.yaml"):
            if p.name != "kustomization.yaml":
                assert p.resolve() in named, f"{p.relative_to(REPO)} is not named in {kfile.relative_to(REPO)}"


def test_validation_is_strict():
    """Guard for the checks above: an unknown field must be an error, not a warning."""
    bad = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
           "spec": {"ports": [{"port": 80, "targetPrt": 80}]}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBE_VERSION, strict=True)


# ---------------------------------------------------------------- workloads


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_probes_on_declared_ports(kustomization):
    for w in workloads(render(kustomization)):
        for c in containers(w):
            where = f"{kustomization}: {kn(w)} container {c['name']}"
            numbers, names = container_ports(c)
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                assert probe, f"{where} has no {kind}"
                handler = next((h for h in ("grpc", "httpGet", "tcpSocket", "exec") if h in probe), None)
                assert handler, f"{where}: {kind} has no handler"
                if handler == "exec":
                    continue
                port = probe[handler]["port"]
                assert port in numbers or port in names, f"{where}: {kind} probes port {port}, " \
                                                         f"not a containerPort {sorted(numbers)}"
            if is_crescent(c) and c["name"] != "gateway":
                # Every gRPC process serves grpc.health.v1 on its gRPC port (the --listen port).
                listen_port = int(flag(container_argv(c, where), "--listen").rsplit(":", 1)[1])
                for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                    assert c[kind].get("grpc", {}).get("port") == listen_port, \
                        f"{where}: {kind} must be a grpc probe on the --listen port {listen_port}"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_scrape_annotations_on_metrics_ports(kustomization):
    for w in workloads(render(kustomization)):
        where = f"{kustomization}: {kn(w)}"
        ann = w["spec"]["template"]["metadata"].get("annotations", {})
        assert ann.get("prometheus.io/scrape") == "true", f"{where}: no prometheus.io/scrape: 'true'"
        assert ann.get("prometheus.io/path", "").startswith("/"), f"{where}: no prometheus.io/path"
        port = int(ann.get("prometheus.io/port", "0"))
        declared = set().union(*(container_ports(c)[0] for c in containers(w)))
        assert port in declared, f"{where}: prometheus.io/port {port} is not a containerPort {sorted(declared)}"
        for c in containers(w):
            if is_crescent(c):
                argv = container_argv(c, where)
                served = flag(argv, "--metrics-port") or flag(argv, "--listen").rsplit(":", 1)[1]  # gateway: /metrics
                assert int(served) == port, f"{where}: scraped on {port}, metrics served on {served}"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_security_context(kustomization):
    for w in workloads(render(kustomization)):
        pod = w["spec"]["template"]["spec"]
        psc = pod.get("securityContext", {})
        assert not pod.get("hostPID") and not pod.get("hostIPC"), kn(w)
        for c in containers(w):
            where = f"{kustomization}: {kn(w)} container {c['name']}"
            sc = {**psc, **c.get("securityContext", {})}
            assert sc.get("runAsNonRoot") is True, f"{where}: runAsNonRoot is not true"
            assert int(sc.get("runAsUser", 0)) > 0, f"{where}: no fixed non-root runAsUser"
            assert sc.get("allowPrivilegeEscalation") is False, f"{where}: allowPrivilegeEscalation"
            assert sc.get("readOnlyRootFilesystem") is True, f"{where}: root filesystem is writable"
            assert not sc.get("privileged"), f"{where}: privileged"
            assert "ALL" in sc.get("capabilities", {}).get("drop", []), f"{where}: capabilities not dropped"
            assert set(sc.get("capabilities", {}).get("add", [])) <= {"IPC_LOCK"}, f"{where}: extra capabilities"
            if is_crescent(c):
                assert sc["runAsUser"] == 10001, f"{where}: the image's user is uid 10001"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_resources_and_images(kustomization):
    for w in workloads(render(kustomization)):
        for c in containers(w):
            where = f"{kustomization}: {kn(w)} container {c['name']}"
            res = c.get("resources", {})
            assert {"cpu", "memory"} <= set(res.get("requests", {})), f"{where}: no cpu/memory requests"
            assert "memory" in res.get("limits", {}), f"{where}: no memory limit"
            assert k8s_quantity(res["limits"]["memory"]) >= k8s_quantity(res["requests"]["memory"]), where
            name, _, tag = c["image"].rpartition(":")
            assert name and tag and tag != "latest", f"{where}: image {c['image']} is not pinned to a tag"
            if is_crescent(c):
                assert tag == IMAGE_TAG[kustomization], f"{where}: image {c['image']}"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_gpus_only_in_the_gpu_overlay(kustomization):
    for w in workloads(render(kustomization)):
        for c in containers(w):
            where = f"{kustomization}: {kn(w)} container {c['name']}"
            res = c.get("resources", {})
            gpus = res.get("limits", {}).get("nvidia.com/gpu")
            engine = is_crescent(c) and container_argv(c, where)[0] == "engine"
            if kustomization == "overlays/gpu" and engine:
                assert gpus is not None and int(gpus) >= 1, f"{where}: no nvidia.com/gpu limit"
                assert res.get("requests", {}).get("nvidia.com/gpu", gpus) == gpus, \
                    f"{where}: a GPU request must equal its limit"
                assert flag(container_argv(c, where), "--device") == "cuda", f"{where}: not --device cuda"
            else:
                assert gpus is None and "nvidia.com/gpu" not in res.get("requests", {}), f"{where} asks for a GPU"
                if is_crescent(c):
                    assert flag(container_argv(c, where), "--device") in (None, "cpu"), where


def test_every_crescent_command_line_parses():
    seen = set()
    for k, w, c in all_crescent_containers():
        where = f"{k}: {kn(w)} container {c['name']}"
        argv = container_argv(c, where)
        ns = parse_cli(argv, where)
        seen.add(ns.command if ns.command != "engine" else f"engine {ns.role}")
    assert seen == {"conductor", "store", "engine prefill", "engine decode", "gateway"}, seen


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_ports_in_command_lines_are_declared(kustomization):
    for w in workloads(render(kustomization)):
        for c in containers(w):
            if not is_crescent(c):
                continue
            where = f"{kustomization}: {kn(w)} container {c['name']}"
            argv = container_argv(c, where)
            numbers, _ = container_ports(c)
            host, _, port = flag(argv, "--listen").rpartition(":")
            assert host == "0.0.0.0", f"{where}: --listen {host} is not reachable from other pods"
            used = {int(port)} | {int(flag(argv, f)) for f in ("--metrics-port", "--data-port") if f in argv}
            assert used == numbers, f"{where}: the process listens on {sorted(used)}, " \
                                    f"containerPorts are {sorted(numbers)}"
            if argv[0] in ("store", "engine"):
                assert flag(argv, "--advertise-host") == FIELD_REF_DUMMIES["status.podIP"], \
                    f"{where}: must advertise $(POD_IP) (a wildcard listen address is not reachable)"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_services_select_pods_and_ports(kustomization):
    objs = render(kustomization)
    pods = [(w["spec"]["template"]["metadata"]["labels"], containers(w)) for w in workloads(objs)]
    for w in workloads(objs):
        sel = w["spec"]["selector"]["matchLabels"]
        assert sel.items() <= w["spec"]["template"]["metadata"]["labels"].items(), f"{kn(w)}: selector"
    for svc in (o for o in objs if o["kind"] == "Service"):
        sel = svc["spec"]["selector"]
        hits = [cs for labels, cs in pods if sel.items() <= labels.items()]
        assert len(hits) == 1, f"{kustomization}: {kn(svc)} selects {len(hits)} workloads"
        numbers, names = set(), set()
        for c in hits[0]:
            n, m = container_ports(c)
            numbers |= n
            names |= m
        for p in svc["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            assert target in numbers or target in names, f"{kustomization}: {kn(svc)} targets port {target}"
    for pdb in (o for o in objs if o["kind"] == "PodDisruptionBudget"):
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert any(sel.items() <= labels.items() for labels, _ in pods), f"{kn(pdb)} selects nothing"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_addresses_name_services_that_exist(kustomization):
    """--conductor, --store, --prefill, --decode name a Service (or a StatefulSet pod
    through its headless Service) of this rendering, on a port it exposes."""
    objs = render(kustomization)
    services = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
    sets = {o["metadata"]["name"]: o for o in objs if o["kind"] == "StatefulSet"}
    for w in workloads(objs):
        for c in containers(w):
            if not is_crescent(c):
                continue
            where = f"{kustomization}: {kn(w)} container {c['name']}"
            argv = container_argv(c, where)
            addrs = [flag(argv, f) for f in ("--conductor", "--store") if f in argv]
            for f in ("--prefill", "--decode"):
                if f in argv:
                    i = argv.index(f) + 1
                    while i < len(argv) and not argv[i].startswith("--"):
                        addrs.append(argv[i])
                        i += 1
            for addr in addrs:
                host, _, port = addr.rpartition(":")
                labels = host.split(".")
                svc = services.get(labels[-1] if len(labels) == 2 else labels[0])
                assert svc is not None and len(labels) <= 2, f"{where}: {addr} is not a Service of this rendering"
                assert int(port) in {p["port"] for p in svc["spec"]["ports"]}, f"{where}: {addr}: no such port"
                if len(labels) == 2:  # pod.headless-service: a StatefulSet pod that exists
                    assert svc["spec"].get("clusterIP") == "None", f"{where}: {addr}: the Service is not headless"
                    owner, _, ordinal = labels[0].rpartition("-")
                    sts = sets.get(owner)
                    assert sts is not None and sts["spec"]["serviceName"] == labels[1], f"{where}: {addr}"
                    assert int(ordinal) < sts["spec"].get("replicas", 1), f"{where}: {addr}: no such pod"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_store_memory_covers_its_dram_tier(kustomization):
    (sts,) = [o for o in render(kustomization) if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "crescent-store"]
    (c,) = containers(sts)
    argv = container_argv(c, kn(sts))
    dram = parse_size(flag(argv, "--dram"))
    shm = [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "shm"][0]["emptyDir"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts.get("/dev/shm") == "shm" and shm.get("medium") == "Memory", "/dev/shm must be a memory emptyDir"
    limit = k8s_quantity(shm["sizeLimit"])
    assert dram < limit <= dram * 1.25, f"{kustomization}: /dev/shm {shm['sizeLimit']} vs --dram {flag(argv, '--dram')}"
    assert k8s_quantity(c["resources"]["requests"]["memory"]) > dram, "the arena is charged to the container"
    assert k8s_quantity(c["resources"]["limits"]["memory"]) > limit
    # The disk tier lives on the volume claim, and the claim holds --disk-size.
    disk = flag(argv, "--disk")
    (mount,) = [m for m in c["volumeMounts"] if disk.startswith(m["mountPath"].rstrip("/") + "/")
                or disk == m["mountPath"]]
    (claim,) = [t for t in sts["spec"]["volumeClaimTemplates"] if t["metadata"]["name"] == mount["name"]]
    assert k8s_quantity(claim["spec"]["resources"]["requests"]["storage"]) > parse_size(flag(argv, "--disk-size"))
    drain = float(flag(argv, "--drain-s") or 0)
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain + 30


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_conductor_replicas_elect_a_leader(kustomization):
    """Two or more replicas are safe only with leader election: each must be given etcd (a Service of
    the same rendering), advertise its pod IP (what followers hand out), and a budget keeps one up."""
    objs = render(kustomization)
    (d,) = [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "crescent-conductor"]
    assert d["spec"]["replicas"] >= 2
    (c,) = d["spec"]["template"]["spec"]["containers"]
    argv = c["args"]
    etcd = flag(argv, "--etcd")
    assert etcd, "conductor replicas without --etcd would each schedule on half the members"
    services = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
    host, _, port = etcd.rpartition(":")
    assert host in services and int(port) in {p["port"] for p in services[host]["spec"]["ports"]}
    assert flag(argv, "--advertise-host") == "$(POD_IP)"
    (pdb,) = [o for o in objs if o["kind"] == "PodDisruptionBudget" and o["metadata"]["name"] == "crescent-conductor"]
    assert pdb["spec"].get("minAvailable") == 1


def test_gpu_overlay_autoscalers():
    objs = render("overlays/gpu")
    deployments = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Deployment"}
    hpas = {o["spec"]["scaleTargetRef"]["name"]: o for o in objs if o["kind"] == "HorizontalPodAutoscaler"}
    assert set(hpas) == {"crescent-prefill", "crescent-decode"}
    for name, hpa in hpas.items():
        role = name.removeprefix("crescent-")
        assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment" and name in deployments
        (m,) = hpa["spec"]["metrics"]
        assert m["type"] == "External"
        assert m["external"]["metric"] == {"name": "crescent_conductor_recommended_replicas",
                                           "selector": {"matchLabels": {"role": role}}}
        assert m["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
        # The autoscaler owns the count: a replicas field would be reset on each apply.
        assert "replicas" not in deployments[name]["spec"], f"{name}: replicas set beside an autoscaler"


# ---------------------------------------------------------------- Dockerfiles

DOCKERFILE_INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
                           "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL", "MAINTAINER"}


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, backslash continuations joined."""
    out, pending = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word, rest.strip()))
    assert not pending, f"{path}: ends inside a continued line"
    return out


DOCKERFILES = sorted(DOCKER.glob("Dockerfile.*"))


def test_dockerfiles_exist():
    assert {p.name for p in DOCKERFILES} == {"Dockerfile.cpu", "Dockerfile.cuda"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile(path):
    ins = dockerfile_instructions(path)
    for word, _ in ins:
        assert word in DOCKERFILE_INSTRUCTIONS, f"{path.name}: unknown instruction {word!r}"
    args = {}
    for word, rest in ins:
        if word == "FROM":
            break
        if word == "ARG" and "=" in rest:
            k, _, v = rest.partition("=")
            args[k] = v
    stages = set()
    froms = [rest for word, rest in ins if word == "FROM"]
    assert froms, f"{path.name}: no FROM"
    for rest in froms:
        parts = rest.split()
        image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], parts[0])
        if image not in stages:
            repo, _, tag = image.rpartition(":")
            assert repo and "/" not in tag, f"{path.name}: FROM {image} has no tag"
            assert tag != "latest" and re.match(r"\d+\.\d+\.\d+", tag), \
                f"{path.name}: FROM {image}: pin an exact version tag (major.minor.patch)"
        if len(parts) == 3 and parts[1].upper() == "AS":
            stages.add(parts[2])
    # The final stage runs as a fixed non-root user, with crescent as the entrypoint.
    final = ins[max(i for i, (w, _) in enumerate(ins) if w == "FROM"):]
    users = [rest for word, rest in final if word == "USER"]
    assert users, f"{path.name}: the final stage has no USER (it would run as root)"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0") and user.isdigit() and int(user) == 10001, \
        f"{path.name}: USER {users[-1]}: the manifests' runAsUser is 10001"
    (entry,) = [rest for word, rest in final if word == "ENTRYPOINT"]
    assert json.loads(entry)[0] == "crescent", f"{path.name}: ENTRYPOINT {entry}"
    exposed = {int(p.split("/")[0]) for word, rest in final if word == "EXPOSE" for p in rest.split()}
    assert {7300, 7400, 7401, 7500, 8000, 9300, 9400, 9500} <= exposed, f"{path.name}: EXPOSE {sorted(exposed)}"
    # Sources copied from the build context exist and are not kept out by .dockerignore.
    ignored = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")] if (REPO / ".dockerignore").exists() else []
    for word, rest in ins:
        if word in ("COPY", "ADD") and "--from=" not in rest:
            for src in rest.split()[:-1]:
                if src.startswith("--"):
                    continue
                assert (REPO / src).exists(), f"{path.name}: COPY {src}: no such path"
                assert src.strip("./").split("/")[0] not in ignored, f"{path.name}: .dockerignore drops {src}"
    # torch: the version pyproject.toml pins.
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    (pin,) = [d for d in pyproject["project"]["dependencies"] if d.startswith("torch")]
    runs = " ".join(rest for word, rest in ins if word == "RUN")
    assert pin in runs, f"{path.name}: installs no {pin}"


def test_console_script_exists():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["crescent"] == "kvstore.cli:main"


# ---------------------------------------------------------------- systemd

UNITS = ["crescent-conductor.service", "crescent-store.service", "crescent-engine@prefill.service",
         "crescent-engine@decode.service", "crescent-gateway.service"]
INSTALLED_BINARY = "/opt/crescent/bin/crescent"


def unit_file(unit: str) -> Path:
    name, at, rest = unit.partition("@")
    return SYSTEMD / (f"{name}@.service" if at else unit)


def unit_settings(unit: str) -> dict[str, list[str]]:
    """Key -> values of the unit (instance specifier %i substituted)."""
    instance = unit.partition("@")[2].removesuffix(".service")
    out: dict[str, list[str]] = {}
    for line in unit_file(unit).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        k, _, v = line.partition("=")
        out.setdefault(k.strip(), []).append(v.strip().replace("%i", instance))
    return out


def env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            k, _, v = line.partition("=")
            (env[k],) = shlex.split(v) or [""]
    return env


def exec_argv(unit: str) -> list[str]:
    """ExecStart as systemd runs it with the example EnvironmentFile: ``$VAR`` splits into
    words, ``${VAR}`` stays one."""
    s = unit_settings(unit)
    (envfile,) = s["EnvironmentFile"]
    assert envfile.startswith("/etc/crescent/") and envfile.endswith(".env"), envfile
    example = SYSTEMD / Path(envfile).name
    assert example.exists(), f"{unit}: no example {example.relative_to(REPO)} for {envfile}"
    env = env_file(example)
    argv = []
    for word in s["ExecStart"][0].split():
        if m := re.fullmatch(r"\$(\w+)", word):
            assert m.group(1) in env, f"{unit}: ${m.group(1)} is not set in {example.name}"
            argv += env[m.group(1)].split()
        else:
            argv.append(re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], word))
    return argv


@pytest.mark.parametrize("unit", UNITS)
def test_unit_command_line_parses(unit):
    argv = exec_argv(unit)
    assert argv[0] == INSTALLED_BINARY, f"{unit}: ExecStart runs {argv[0]}"
    ns = parse_cli(argv[1:], unit)
    expected = unit.removeprefix("crescent-").removesuffix(".service").split("@")
    assert [ns.command] + ([ns.role] if ns.command == "engine" else []) == expected


@pytest.mark.parametrize("unit", UNITS)
def test_unit_settings(unit):
    s = unit_settings(unit)
    for key, value in [("User", "crescent"), ("Restart", "on-failure"), ("NoNewPrivileges", "yes"),
                       ("ProtectSystem", "strict"), ("PrivateTmp", "yes"), ("KillSignal", "SIGTERM")]:
        assert s.get(key) == [value], f"{unit}: {key}={s.get(key)}, want {value}"
    assert "network-online.target" in " ".join(s.get("After", [])) and s.get("Wants"), unit
    argv = exec_argv(unit)
    writable = " ".join(s.get("ReadWritePaths", [])).split()
    if "--disk" in argv:  # the disk tier's folder must be writable under ProtectSystem=strict
        disk = flag(argv, "--disk")
        assert any(disk == p or disk.startswith(p.rstrip("/") + "/") for p in writable), f"{unit}: {disk} read-only"
    if "store" in argv:
        assert "/dev/shm" in writable and "PrivateDevices" not in s and "PrivateIPC" not in s, \
            f"{unit}: the arena in /dev/shm must be the host's, writable"
        stop = s["TimeoutStopSec"][0]
        assert stop.endswith("s") and int(stop[:-1]) > float(flag(argv, "--drain-s") or 0) + 30, \
            f"{unit}: TimeoutStopSec={stop} does not cover the drain"


@pytest.mark.parametrize("unit", UNITS)
def test_systemd_analyze_verify(unit, tmp_path):
    """`systemd-analyze verify` on a copy whose ExecStart runs this venv's crescent (verify
    checks that the binary exists and is executable; /opt/crescent is where docs/deploy.md
    installs it). Verify reports unknown keys and unparsable values as warnings with exit 0,
    so any line about the unit fails the test too."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not found")
    crescent = shutil.which("crescent", path=str(Path(__import__("sys").executable).parent))
    if crescent is None:
        pytest.skip("no crescent console script beside this Python (pip install -e .)")
    text = unit_file(unit).read_text()
    assert f"ExecStart={INSTALLED_BINARY} " in text, unit
    copy = tmp_path / unit  # an instance's name: verify loads the template's text as that instance
    copy.write_text(text.replace(f"ExecStart={INSTALLED_BINARY} ", f"ExecStart={crescent} "))
    out = subprocess.run([analyze, "verify", "--man=no", str(copy)], capture_output=True, text=True, timeout=60)
    about_unit = [ln for ln in (out.stdout + out.stderr).splitlines() if unit in ln or str(tmp_path) in ln]
    assert out.returncode == 0 and not about_unit, f"systemd-analyze verify {unit}:\n{out.stdout}{out.stderr}"
