"""Issue #33, acceptance 1: every pod body the operator can produce (a replica's, under each template
option, hostNetwork on and off; a pool gateway's) and every pod of the chart meets the Pod Security
Standards' "restricted" profile, plus a read-only root file system.

The rules are this test's own list, written from the Pod Security Standards document
(https://kubernetes.io/docs/concepts/security/pod-security-standards/, Baseline and Restricted), not a
call to an API server: Kubernetes 1.20, the project's tiers, has no PodSecurity admission. Pure, except
the chart cases, which need only the helm binary."""
from __future__ import annotations

import subprocess
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import yaml

from sampler_operator import pod_security
from sampler_operator.pool.gateway import gateway_objects
from sampler_operator.pool.plan import PoolSpec, pool_keys
from sampler_operator.replica.desired_pod import LOCK_PATH, STATE_PATH, Owner, desired_pod
from sampler_operator.replica.spec import parse_spec
from tests.support import REPO_ROOT
from tests.support import k8s as ks

# ------------------------------------------------------------------ the profile, as the document lists it
# Baseline "Capabilities": what may be added.
BASELINE_CAPABILITIES = frozenset({"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                                   "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"})
# Baseline "Sysctls": the safe set.
SAFE_SYSCTLS = frozenset({"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                          "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                          "net.ipv4.ping_group_range"})
# Restricted "Volume Types".
RESTRICTED_VOLUME_TYPES = frozenset({"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                                     "persistentVolumeClaim", "projected", "secret"})
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t"})
APPARMOR_PREFIX = "container.apparmor.security.beta.kubernetes.io/"

# Each rule: (name, the profile it belongs to, what it asks). The checks below are keyed by name.
RESTRICTED_RULES: tuple[tuple[str, str, str], ...] = (
    ("hostProcess", "baseline", "windowsOptions.hostProcess unset or false"),
    ("hostNamespaces", "baseline", "hostNetwork, hostPID, hostIPC unset or false"),
    ("privileged", "baseline", "securityContext.privileged unset or false"),
    ("capabilities.baseline", "baseline", "capabilities.add only from the baseline list"),
    ("hostPath", "baseline", "no hostPath volume"),
    ("hostPorts", "baseline", "no hostPort (with hostNetwork, the API server sets hostPort = containerPort)"),
    ("appArmor", "baseline", "AppArmor annotations unset, runtime/default or localhost/*"),
    ("seLinux", "baseline", "seLinuxOptions.type allowed, user and role unset"),
    ("procMount", "baseline", "procMount unset or Default"),
    ("seccomp.baseline", "baseline", "seccompProfile.type not Unconfined"),
    ("sysctls", "baseline", "only safe sysctls"),
    ("volumeTypes", "restricted", "only configMap, csi, downwardAPI, emptyDir, ephemeral, PVC, projected, secret"),
    ("allowPrivilegeEscalation", "restricted", "allowPrivilegeEscalation false in every container"),
    ("runAsNonRoot", "restricted", "runAsNonRoot true (pod, or every container), never false in a container"),
    ("runAsUser", "restricted", "runAsUser never 0"),
    ("seccompProfile", "restricted", "seccompProfile RuntimeDefault or Localhost (pod, or every container)"),
    ("capabilities", "restricted", "drop ALL in every container; add only NET_BIND_SERVICE"),
    ("readOnlyRootFilesystem", "issue #33", "readOnlyRootFilesystem true in every container"),
)
RULES = {name for name, _, _ in RESTRICTED_RULES}


def _containers(spec: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    for key in ("initContainers", "containers", "ephemeralContainers"):
        yield from spec.get(key) or []


def violations(pod_spec: Mapping[str, Any], annotations: Mapping[str, str] | None = None) -> set[str]:
    """The rules of RESTRICTED_RULES a pod spec breaks."""
    bad: set[str] = set()
    psc = pod_spec.get("securityContext") or {}
    containers = list(_containers(pod_spec))
    contexts = [psc] + [c.get("securityContext") or {} for c in containers]
    # --- baseline
    if any((ctx.get("windowsOptions") or {}).get("hostProcess") for ctx in contexts):
        bad.add("hostProcess")
    if any(pod_spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")):
        bad.add("hostNamespaces")
    if any((c.get("securityContext") or {}).get("privileged") for c in containers):
        bad.add("privileged")
    for c in containers:
        caps = (c.get("securityContext") or {}).get("capabilities") or {}
        if not set(caps.get("add") or []) <= BASELINE_CAPABILITIES:
            bad.add("capabilities.baseline")
    volumes = pod_spec.get("volumes") or []
    if any("hostPath" in v for v in volumes):
        bad.add("hostPath")
    for c in containers:
        for p in c.get("ports") or []:
            if p.get("hostPort") or pod_spec.get("hostNetwork"):
                bad.add("hostPorts")
    for k, v in (annotations or {}).items():
        if k.startswith(APPARMOR_PREFIX) and not (v == "runtime/default" or v.startswith("localhost/")):
            bad.add("appArmor")
    for ctx in contexts:
        se = ctx.get("seLinuxOptions") or {}
        if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            bad.add("seLinux")
    if any((c.get("securityContext") or {}).get("procMount", "Default") != "Default" for c in containers):
        bad.add("procMount")
    if any((ctx.get("seccompProfile") or {}).get("type") == "Unconfined" for ctx in contexts):
        bad.add("seccomp.baseline")
    if any(s.get("name") not in SAFE_SYSCTLS for s in psc.get("sysctls") or []):
        bad.add("sysctls")
    # --- restricted
    for v in volumes:
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_TYPES:
            bad.add("volumeTypes")
    for c in containers:
        ctx = c.get("securityContext") or {}
        if ctx.get("allowPrivilegeEscalation") is not False:
            bad.add("allowPrivilegeEscalation")
        if ctx.get("runAsNonRoot") is False or not (ctx.get("runAsNonRoot") or psc.get("runAsNonRoot")):
            bad.add("runAsNonRoot")
        seccomp = (ctx.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.add("seccompProfile")
        caps = ctx.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []) or not set(caps.get("add") or []) <= {"NET_BIND_SERVICE"}:
            bad.add("capabilities")
        if ctx.get("readOnlyRootFilesystem") is not True:
            bad.add("readOnlyRootFilesystem")
    if any(ctx.get("runAsUser") == 0 for ctx in contexts):
        bad.add("runAsUser")
    assert bad <= RULES, bad - RULES
    return bad


# ------------------------------------------------------------------ the checker can fail
def test_the_rules_catch_a_pod_that_breaks_each_of_them():
    """Controls: an empty context breaks every restricted rule; each bad field breaks its own."""
    bare = {"containers": [{"name": "c", "image": "i"}]}
    assert violations(bare) == {"allowPrivilegeEscalation", "runAsNonRoot", "seccompProfile", "capabilities",
                                "readOnlyRootFilesystem"}
    good = {"securityContext": pod_security.pod_security_context(),
            "containers": [{"name": "c", "image": "i", "securityContext": pod_security.container_security_context()}]}
    assert violations(good) == set()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"hostPID": True}, "hostNamespaces"),
        ({"volumes": [{"name": "h", "hostPath": {"path": "/"}}]}, "hostPath"),
        ({"volumes": [{"name": "n", "nfs": {"server": "s", "path": "/"}}]}, "volumeTypes"),
        ({"securityContext": {**good["securityContext"], "runAsUser": 0}}, "runAsUser"),
        ({"securityContext": {**good["securityContext"], "seccompProfile": {"type": "Unconfined"}}}, "seccompProfile"),
        ({"securityContext": {**good["securityContext"], "sysctls": [{"name": "kernel.msgmax", "value": "1"}]}},
         "sysctls"),
    ]
    for change, rule in cases:
        assert rule in violations({**good, **change}), (change, rule)
    for ctx_change, rule in [({"privileged": True}, "privileged"), ({"allowPrivilegeEscalation": True},
                                                                     "allowPrivilegeEscalation"),
                             ({"capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN"]}}, "capabilities.baseline"),
                             ({"capabilities": {"drop": ["ALL"], "add": ["SYS_NICE"]}}, "capabilities"),
                             ({"readOnlyRootFilesystem": False}, "readOnlyRootFilesystem"),
                             ({"runAsNonRoot": False}, "runAsNonRoot"), ({"procMount": "Unmasked"}, "procMount"),
                             ({"seLinuxOptions": {"type": "spc_t"}}, "seLinux")]:
        c = {**good["containers"][0], "securityContext": {**pod_security.container_security_context(), **ctx_change}}
        assert rule in violations({**good, "containers": [c]}), (ctx_change, rule)
    assert "appArmor" in violations(good, {APPARMOR_PREFIX + "c": "unconfined"})
    assert "hostPorts" in violations({**good, "containers": [{**good["containers"][0],
                                                              "ports": [{"containerPort": 1, "hostPort": 1}]}]})


# ------------------------------------------------------------------ the replicas' pods
OWNER = Owner(name="r1", namespace="ns", uid="uid-1")
BASE = {"model": "/models/tiny", "image": "sampler:dev", "port": 8123}
GPU = {"resources": {"limits": {"nvidia.com/gpu": 2, "memory": "8Gi"}, "requests": {"cpu": "2"}},
       "engineArgs": {"tensorParallelSize": 2, "enableLora": True}}
# Every option of the template that reaches the pod; hostNetwork and the user's hostPath are the only
# ones that may break a rule, and only the rules they name.
REPLICA_OPTIONS: list[tuple[str, dict[str, Any], set[str]]] = [
    ("default", {}, set()),
    ("fake engine", {"engine": "fake"}, set()),
    ("gpu, tensor parallel, LoRA", GPU, set()),
    ("declared weights and adapters", {"checkpoints": {"allowedRoots": ["/ckpt"], "volumes": [
        {"name": "ckpt", "mountPath": "/ckpt", "source": {"persistentVolumeClaim": {"claimName": "c"}}}]},
        "weights": {"checkpoint": "/ckpt/s1", "versionLabel": "s1"}, "engineArgs": {"enableLora": True},
        "adapters": [{"name": "a", "path": "/ckpt/a"}]}, set()),
    ("keys from Secrets", {"apiKeySecretRef": {"name": "k"}, "adminApiKeySecretRef": {"name": "k"}}, set()),
    ("pod overrides", {"pod": {"nodeSelector": {"gpu": "a100"}, "tolerations": [{"key": "gpu", "operator": "Exists"}],
                               "annotations": {"a": "b"}, "labels": {"team": "rl"}, "serviceAccountName": "sa",
                               "priorityClassName": "high", "terminationGracePeriodSeconds": 5,
                               "command": ["python3", "-m", "sampler_pod"],
                               "env": [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "nobind"}],
                               "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
                               "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}}, set()),
    ("another uid", {"pod": {"securityContext": {"runAsUser": 1000680000}}}, set()),
    ("hostNetwork", {"hostNetwork": True}, {"hostNamespaces", "hostPorts"}),
    ("a user's hostPath", {"pod": {"volumes": [{"name": "m", "hostPath": {"path": "/models"}}],
                                   "volumeMounts": [{"name": "m", "mountPath": "/models"}]}},
     {"hostPath", "volumeTypes"}),
    ("loosened in the CR", {"pod": {"containerSecurityContext": {"capabilities": {"drop": ["ALL"],
                                                                                  "add": ["SYS_NICE"]}}}},
     {"capabilities", "capabilities.baseline"}),   # SYS_NICE: in neither profile's list
]


@pytest.mark.parametrize("name,options,expected", REPLICA_OPTIONS, ids=[o[0] for o in REPLICA_OPTIONS])
def test_every_replica_pod_is_restricted_unless_its_template_says_otherwise(name, options, expected):
    pod = desired_pod(OWNER, parse_spec({**BASE, **options}), 3)
    assert violations(pod["spec"], pod["metadata"]["annotations"]) == expected


def test_the_replica_writes_only_to_its_emptydirs():
    """The read-only root leaves writable exactly the emptyDirs of pod_security.SAMPLER_WRITABLE, and every
    path the pod tells the sampler and its libraries to write lies under one."""
    pod = desired_pod(OWNER, parse_spec(BASE), 0)
    [c] = pod["spec"]["containers"]
    empty = {v["name"] for v in pod["spec"]["volumes"] if "emptyDir" in v}
    writable = {m["mountPath"] for m in c["volumeMounts"] if m["name"] in empty and not m.get("readOnly")}
    assert writable == {p.mount_path for p in pod_security.SAMPLER_WRITABLE} >= {"/tmp", "/var/run/sampler"}
    env = {e["name"]: e.get("value") for e in c["env"]}
    written = [LOCK_PATH, STATE_PATH] + [env[k] for k in ("HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "HF_HOME",
                                                         "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
                                                         "VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT")]
    for path in written:
        assert any(path == w or path.startswith(w + "/") for w in writable), path
    # getpass.getuser() answers without a passwd entry (an arbitrary uid has none)
    assert env["USER"] and env["LOGNAME"]


def test_a_users_env_wins_over_the_pinned_paths_and_reserved_volume_names_are_refused():
    pod = desired_pod(OWNER, parse_spec({**BASE, "pod": {"env": [{"name": "HF_HOME", "value": "/hub"}]}}), 0)
    hf = [e for e in pod["spec"]["containers"][0]["env"] if e["name"] == "HF_HOME"]
    assert hf == [{"name": "HF_HOME", "value": "/hub"}]
    for name in ("sampler-tmp", "sampler-home", "startup-lock"):
        with pytest.raises(Exception, match="reserved"):
            parse_spec({**BASE, "pod": {"volumes": [{"name": name, "emptyDir": {}}]}})


def test_a_loosened_context_is_merged_key_by_key_and_keeps_the_rest():
    spec = parse_spec({**BASE, "pod": {"securityContext": {"fsGroup": 2000},
                                       "containerSecurityContext": {"readOnlyRootFilesystem": False}}})
    pod = desired_pod(OWNER, spec, 0)
    assert pod["spec"]["securityContext"] == {**pod_security.pod_security_context(), "fsGroup": 2000}
    assert pod["spec"]["containers"][0]["securityContext"] == {
        **pod_security.container_security_context(), "readOnlyRootFilesystem": False}
    assert violations(pod["spec"]) == {"readOnlyRootFilesystem"}


# ------------------------------------------------------------------ the gateways' pods
TEMPLATE = {"model": "/models/tiny", "image": "img"}
GATEWAY_OPTIONS: list[tuple[str, dict[str, Any], set[str]]] = [
    ("default", {}, set()),
    ("replicas, port, image, resources, env, a token volume",
     {"replicas": 2, "port": 9000, "image": "gw:1", "resources": {"requests": {"cpu": "1"}},
      "env": [{"name": "X", "value": "1"}], "volumes": [{"name": "t", "secret": {"secretName": "t"}}],
      "volumeMounts": [{"name": "t", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}]}, set()),
    ("hostNetwork", {"hostNetwork": True}, {"hostNamespaces"}),
    ("loosened in the CR", {"containerSecurityContext": {"allowPrivilegeEscalation": True}},
     {"allowPrivilegeEscalation"}),
]


@pytest.mark.parametrize("name,gateway,expected", GATEWAY_OPTIONS, ids=[o[0] for o in GATEWAY_OPTIONS])
def test_every_gateway_pod_is_restricted_unless_its_pool_says_otherwise(name, gateway, expected):
    spec = {"template": TEMPLATE, "gateway": gateway}
    keys = pool_keys("p", PoolSpec.model_validate(spec))
    [dep] = [o for o in gateway_objects("p", "ns", "uid", spec, keys.api, keys.admin) if o["kind"] == "Deployment"]
    pod = dep["spec"]["template"]["spec"]
    assert violations(pod) == expected
    [c] = pod["containers"]
    assert {"name": "gateway-tmp", "mountPath": "/tmp"} in c["volumeMounts"]


# ------------------------------------------------------------------ the chart's pods
CHART = REPO_ROOT / "charts" / "sampler-operator"
CHART_OPTIONS: list[tuple[list[str], set[str]]] = [
    ([], set()),
    (["watch.allNamespaces=false", "watch.namespaces={a,b}", "peering.enabled=false", "replicaCount=2"], set()),
    (["metrics.podMonitor.enabled=true", "metrics.dashboards.enabled=true", "networkPolicy.enabled=false"], set()),
    (["hostNetwork=true"], {"hostNamespaces", "hostPorts"}),
]


def _chart_pods(sets: list[str]) -> list[tuple[str, dict[str, Any], dict[str, str]]]:
    out = subprocess.run([ks.HELM, "template", "rel", str(CHART), "--namespace", "ops",
                          *[a for s in sets for a in ("--set", s)]], check=True, capture_output=True, text=True).stdout
    pods = []
    for doc in (d for d in yaml.safe_load_all(out) if d):
        if doc["kind"] in ("Deployment", "Job", "DaemonSet", "StatefulSet", "ReplicaSet"):
            tmpl = doc["spec"]["template"]
            pods.append((f"{doc['kind']}/{doc['metadata']['name']}", tmpl["spec"],
                         (tmpl.get("metadata") or {}).get("annotations") or {}))
        elif doc["kind"] == "Pod":
            pods.append((f"Pod/{doc['metadata']['name']}", doc["spec"], doc["metadata"].get("annotations") or {}))
    return pods


@ks.needs_helm()
@pytest.mark.parametrize("sets,expected", CHART_OPTIONS, ids=[" ".join(s) or "defaults" for s, _ in CHART_OPTIONS])
def test_every_chart_pod_is_restricted(sets, expected):
    pods = _chart_pods(sets)
    assert {name.split("/")[0] for name, _, _ in pods} == {"Deployment", "Job"}   # the operator, the uninstall hook
    for name, spec, pod_annotations in pods:
        assert violations(spec, pod_annotations) == (expected if name.startswith("Deployment") else
                                                     expected - {"hostPorts"}), name


def test_a_null_in_the_override_leaves_the_uid_to_the_platform():
    """OpenShift's restricted-v2 SCC refuses a pod naming a uid outside the namespace's range: `runAsUser:
    null` drops the default, and the pod stays restricted (runAsNonRoot; the image's numeric USER)."""
    spec = parse_spec({**BASE, "pod": {"securityContext": {"runAsUser": None, "runAsGroup": None}}})
    pod = desired_pod(OWNER, spec, 0)
    assert "runAsUser" not in pod["spec"]["securityContext"] and "runAsGroup" not in pod["spec"]["securityContext"]
    assert violations(pod["spec"]) == set()
