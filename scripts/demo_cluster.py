"""The operator's story on the local single-node cluster (`./scripts/demo.sh`, run inside the node tier's
private network namespace by scripts/k8s/node-exec.sh; demo.sh brings the cluster up and builds the images).

  0. helm install the chart (the project's operator image)
  1. apply two SamplerReplicas (real vLLM CPU engine, the embedded tiny model, the project's CPU sampler image)
  2. `kubectl get sr` while they come up
  3. sample from both
  4. declare new weights for both (`spec.weights`): the operator loads them in place, no pod restarts
  5. a trainer re-pushes those weights to one pod and the write fails midway (the documented test seam
     `test_fail_after_tensors`): the pod reports uncertain weights
  6. watch the operator replace it, and the new pod come back at the declared weights, never the base model
  7. `kubectl get sr` and the Events

`run_story()` returns what happened, read back from the API server and the pods; the node-tier test
(tests/operator/node/test_demo_story.py) runs this same function and asserts on it and on the cluster.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("SAMPLER_CACHE_DIR") or Path.home() / ".cache" / "sampler-operator")
CHART = ROOT / "charts" / "sampler-operator"
IMAGES_LIST = CACHE / "images" / "images.list"
STEPS = 7
PROMPT = [1, 17, 42, 99, 123, 7]
T = TypeVar("T")


@dataclass
class StoryConfig:
    namespace: str = "sampler-demo"              # the SamplerReplicas
    operator_namespace: str = "sampler-system"   # the chart's release
    release: str = "sampler-operator"
    ports: tuple[int, int] = (18101, 18102)      # hostNetwork: every replica on the node needs its own port
    liveness_port: int = 18180
    checkpoints: Path = CACHE / "demo" / "checkpoints"
    timeout_s: float = 420                       # per wait; a warm run takes ~3-4 min in all
    out: Callable[[str], None] = print


@dataclass
class StoryResult:
    replicas: list[str] = field(default_factory=list)
    tables: list[str] = field(default_factory=list)               # `kubectl get sr` outputs
    samples: dict[str, dict[str, Any]] = field(default_factory=dict)  # step label -> /v1/sample response
    load: dict[str, Any] = field(default_factory=dict)            # the good checkpoint load's response
    failed_load: tuple[int, dict[str, Any]] = (0, {})             # the injected failure: HTTP code, body
    uncertain_health: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    final_status: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0


class Story:
    def __init__(self, cfg: StoryConfig) -> None:
        self.cfg = cfg
        self.t0 = time.monotonic()
        self.kubectl_bin = os.environ.get("KUBECTL", "kubectl")
        self.helm_bin = os.environ.get("HELM", "helm")
        self.images = read_images()
        self.a, self.b = "demo-a", "demo-b"
        self._keys: dict[tuple[str, bool], str] = {}

    # ---------------------------------------------------------------- narration and small runners
    def say(self, msg: str) -> None:
        self.cfg.out(msg)

    def step(self, n: int, title: str) -> None:
        el = int(time.monotonic() - self.t0)
        self.say(f"\n[{n}/{STEPS} +{el // 60:02d}:{el % 60:02d}] {title}")

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        p = subprocess.run([self.kubectl_bin, *args], input=input, capture_output=True, text=True, timeout=120)
        if check and p.returncode:
            raise RuntimeError(f"kubectl {' '.join(args)}: {p.stderr.strip()}")
        return p.stdout

    def kjson(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json"))

    def helm(self, *args: str, check: bool = True) -> str:
        p = subprocess.run([self.helm_bin, *args], capture_output=True, text=True, timeout=300)
        if check and p.returncode:
            raise RuntimeError(f"helm {' '.join(args)}: {p.stderr.strip()}")
        return p.stdout

    def wait(self, fn: Callable[[], T | None], what: str, on_tick: Callable[[], None] | None = None) -> T:
        """Poll the API server / a pod until fn() returns a value (state, not time, ends the wait)."""
        deadline = time.monotonic() + self.cfg.timeout_s
        while True:
            try:
                v = fn()
            except (RuntimeError, OSError, ValueError, KeyError):
                v = None
            if v:
                return v
            if on_tick:
                on_tick()
            if time.monotonic() > deadline:
                raise TimeoutError(f"demo: timed out after {self.cfg.timeout_s:.0f}s waiting for {what}")
            time.sleep(1)

    def status(self, name: str) -> dict[str, Any]:
        return self.kjson("-n", self.cfg.namespace, "get", "sr", name).get("status") or {}

    def get_sr(self) -> str:
        # a fresh discovery cache: the CRD may be newer than kubectl's cached API list
        return self.kubectl("--cache-dir", str(CACHE / "demo" / "kube-cache"), "-n", self.cfg.namespace, "get", "sr")

    def key(self, name: str, admin: bool = False) -> str:
        """A replica's key, read as docs/operator.md tells users: from the Secret its status names (the
        operator generated it: the demo's spec names none). The API key samples; the admin key loads weights.
        Read once per replica: the operator never rotates them (a replacement pod gets the same keys)."""
        import base64
        if (name, admin) not in self._keys:
            ref = self.status(name)["adminApiKeySecretRef" if admin else "apiKeySecretRef"]
            out = self.kubectl("-n", self.cfg.namespace, "get", "secret", ref["name"], "-o",
                               f"jsonpath={{.data.{ref['key']}}}")
            self._keys[(name, admin)] = base64.b64decode(out).decode()
        return self._keys[(name, admin)]

    def url(self, name: str) -> str:
        port = self.cfg.ports[0 if name == self.a else 1]
        return f"http://127.0.0.1:{port}"   # hostNetwork pods: podIP is 127.0.0.1 in the node's namespace

    # ---------------------------------------------------------------- the story
    def run(self) -> StoryResult:
        cfg, r = self.cfg, StoryResult(replicas=[self.a, self.b])
        self.clean()
        # the watched namespace first: the chart puts the operators' KopfPeering object there
        self.kubectl("create", "namespace", cfg.namespace)
        self.step(0, f"helm install {cfg.release} charts/sampler-operator -n {cfg.operator_namespace} "
                     f"(image {self.images['operator']})")
        self.install_operator()

        self.step(1, "kubectl apply: two SamplerReplicas (vLLM CPU engine, tiny model, image "
                     f"{self.images['sampler-cpu']})")
        model = tiny_model()
        cfg.checkpoints.mkdir(parents=True, exist_ok=True)
        import yaml

        manifest = yaml.safe_dump_all(
            [self.replica(n, p, model) for n, p in zip((self.a, self.b), cfg.ports, strict=True)], sort_keys=False
        )
        self.say(self.kubectl("-n", cfg.namespace, "apply", "-f", "-", input=manifest).rstrip())

        self.step(2, "kubectl get sr, while the operator creates the pods and vLLM starts (~1-2 min)")
        last: list[Any] = [None, time.monotonic()]

        def show() -> None:
            """Print the table when a column other than AGE changed; else a heartbeat every 15 s."""
            t = self.get_sr()
            key = [ln.rsplit(None, 1)[0] for ln in t.splitlines()]
            if key != last[0]:
                last[0], last[1] = key, time.monotonic()
                r.tables.append(t)
                self.say(t.rstrip())
            elif time.monotonic() - last[1] > 15:
                last[1] = time.monotonic()
                self.say(f"  ... (+{int(time.monotonic() - self.t0)}s) vLLM is still starting")
        show()
        for name in (self.a, self.b):
            self.wait(
                lambda n=name: self.status(n).get("phase") == "Ready" and self.status(n).get("weightsVersion") == 0,
                f"{name} Ready",
                on_tick=show,
            )
        show()

        self.step(3, "sample from both (greedy, 8 tokens, the same prompt), with each replica's API key")
        ref = self.status(self.a)["apiKeySecretRef"]
        self.say(f"  the operator generated the keys: kubectl -n {cfg.namespace} get secret {ref['name']} "
                 f"-o jsonpath='{{.data.{ref['key']}}}' | base64 -d")
        for name in (self.a, self.b):
            out = self.sample(name)
            r.samples[f"{name}/base"] = out
            self.say(f"  {name}: tokens {tokens(out)}  weights_version {out['weights_version']}")

        self.step(4, "declare new weights for both: kubectl patch sr ... spec.weights = step-1 (a perturbed "
                     "checkpoint); the operator loads it in place through each pod's validated load route")
        ckpt = make_checkpoint(model, cfg.checkpoints / "step-1")
        weights = {"spec": {"weights": {"checkpoint": "/checkpoints/step-1", "versionLabel": "step-1"}}}
        for name in (self.a, self.b):
            self.say("  " + self.kubectl("-n", cfg.namespace, "patch", "sr", name, "--type", "merge",
                                         "-p", json.dumps(weights)).rstrip())
        for name in (self.a, self.b):
            self.wait(lambda n=name: (w := self.status(n).get("weights") or {}).get("label") == "step-1"
                      and w.get("declaredResult") == "Loaded", f"{name} serving step-1", on_tick=show)
        show()
        for name in (self.a, self.b):
            out = self.sample(name)
            r.samples[f"{name}/step-1"] = out
            self.say(f"  {name}: tokens {tokens(out)}  weights {out.get('weights_label')} "
                     f"(version {out['weights_version']}), same pod {self.status(name)['podName']}")
        r.load = {"checkpoint": str(ckpt), **(self.status(self.a).get("weights") or {})}

        self.step(5, f"a trainer re-pushes step-1 to {self.b} and the write fails midway "
                     "(test seam test_fail_after_tensors, enabled with --enable-test-seams for this demo only)")
        code, out = post(self.url(self.b) + "/v1/checkpoints/load",
                         {"path": "/checkpoints/step-1", "version_label": "step-1", "test_fail_after_tensors": 1},
                         key=self.key(self.b, admin=True))    # a trainer holds the admin key
        r.failed_load = (code, out)
        self.say(f"  HTTP {code} {json.dumps(out)}")
        r.uncertain_health = get_json(self.url(self.b) + "/health")
        self.say(f"  {self.b} /health: status={r.uncertain_health.get('status')} "
                 f"reason={r.uncertain_health.get('reason')}")

        self.step(6, f"the operator replaces {self.b}; the new pod loads step-1 before it is ready")
        old_pod = f"{self.b}-0"
        ev = self.wait(lambda: self.events(self.b, "UncertainWeights"), "the UncertainWeights event", on_tick=show)
        self.say(f"  event: {ev[0]['type']} {ev[0]['reason']}: {ev[0]['message']}")
        st = self.wait(lambda: (s := self.status(self.b)).get("podName") == f"{self.b}-1" and s.get("phase") == "Ready"
                       and (s.get("weights") or {}).get("label") == "step-1" and s, f"{self.b}'s replacement Ready",
                       on_tick=show)
        self.say(f"  {old_pod} -> {st['podName']} Ready at {st['weights']['label']}, "
                 f"replacements={st['replacements']}, reason {st['lastReplacement']['reason']}")
        out = self.sample(self.b)
        r.samples[f"{self.b}/replaced"] = out
        self.say(f"  {self.b}: tokens {tokens(out)}  weights {out.get('weights_label')}: the same tokens as "
                 f"{self.a} on step-1, never the base model")

        self.step(7, "kubectl get sr, and the Events")
        t = self.get_sr()
        r.tables.append(t)
        self.say(t.rstrip())
        r.events = [e for e in self.kjson("-n", cfg.namespace, "get", "events")["items"]
                    if e["involvedObject"].get("kind") == "SamplerReplica"]
        for e in sorted(r.events, key=lambda e: e.get("lastTimestamp") or ""):
            self.say(f"  {e['type']:<8} {e['reason']:<18} sr/{e['involvedObject']['name']}: {e['message']}")
        r.final_status = {n: self.status(n) for n in (self.a, self.b)}
        r.seconds = time.monotonic() - self.t0
        self.say(f"\ndone in {r.seconds:.0f}s. The cluster stays up: scripts/k8s/node-exec.sh kubectl -n "
                 f"{cfg.namespace} get sr,pods ; stop it with `make cluster-down`.")
        return r

    # ---------------------------------------------------------------- pieces
    def clean(self) -> None:
        """A previous run's replicas, release and namespaces go first (their pods hold the demo's host ports).
        Replicas before the operator: kopf keeps a finalizer on each SamplerReplica (for its daemon), which
        the running operator removes; with no operator left, the finalizers are dropped by hand.
        (The demo's own namespaces only: never anything else in the cluster.)"""
        cfg = self.cfg
        released = bool(self.helm("status", cfg.release, "-n", cfg.operator_namespace, check=False))
        if self.kubectl("get", "namespace", cfg.namespace, "--ignore-not-found", "-o", "name").strip():
            self.say(f"removing the previous demo run (namespace {cfg.namespace}, release {cfg.release})...")
            # The replicas before their namespace: deleting the namespace also deletes the operator's
            # RoleBinding in it, after which the operator could no longer remove its finalizers.
            names = self.kubectl("-n", cfg.namespace, "get", "sr", "-o", "name").split()
            if names:
                if not released:
                    for name in names:
                        self.kubectl("-n", cfg.namespace, "patch", name, "--type", "merge",
                                     "-p", '{"metadata":{"finalizers":null}}')
                self.kubectl("-n", cfg.namespace, "delete", "sr", "--all", "--wait=false")
                self.wait(lambda: not self.kubectl("-n", cfg.namespace, "get", "sr", "-o", "name").strip(),
                          "the previous SamplerReplicas deleted")
            self.kubectl("delete", "namespace", cfg.namespace, "--wait=false")
            self.wait(lambda: not self.kubectl("get", "namespace", cfg.namespace, "--ignore-not-found",
                                               "-o", "name").strip(), f"namespace {cfg.namespace} deleted")
        if released:
            self.helm("uninstall", cfg.release, "-n", cfg.operator_namespace)
        if self.kubectl("get", "namespace", cfg.operator_namespace, "--ignore-not-found", "-o", "name").strip():
            self.kubectl("delete", "namespace", cfg.operator_namespace, "--wait=false")
            self.wait(lambda: not self.kubectl("get", "namespace", cfg.operator_namespace, "--ignore-not-found",
                                               "-o", "name").strip(), f"namespace {cfg.operator_namespace} deleted")

    def install_operator(self) -> None:
        cfg = self.cfg
        values = {
            "image": {"pullPolicy": "Never"},   # repository and tag: the chart's defaults = the image just built
            "watch": {"allNamespaces": False, "namespaces": [cfg.namespace]},
            "liveness": {"port": cfg.liveness_port},
            "logLevel": "verbose",
            # Step 5 makes a write fail midway through the sampler's test seam: a demo cluster allows it (the
            # chart's default refuses replicas that enable test seams).
            "allowTestSeams": True,
            # Node-tier quirks (no CNI/kube-proxy, no ServiceAccount admission plugin): the operator shares the
            # node's network to reach the API server and the pods at 127.0.0.1, and mounts its token Secret.
            "hostNetwork": True,
            "extraEnv": [{"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
                         {"name": "KUBERNETES_SERVICE_PORT", "value": "6443"}],
            "extraVolumes": [{"name": "sa-token", "secret": {"secretName": "sampler-operator-token"}}],
            "extraVolumeMounts": [{"name": "sa-token", "readOnly": True,
                                   "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}],
        }
        vf = CACHE / "demo" / "values-node-tier.json"
        vf.parent.mkdir(parents=True, exist_ok=True)
        vf.write_text(json.dumps(values, indent=2))
        out = self.helm("install", cfg.release, str(CHART), "-n", cfg.operator_namespace, "--create-namespace",
                        "-f", str(vf))
        self.say("\n".join("  " + ln for ln in out.splitlines() if ln.strip()))
        # the chart's fullname (= its ServiceAccount): the release name when it contains the chart name
        sa = cfg.release if "sampler-operator" in cfg.release else f"{cfg.release}-sampler-operator"
        self.kubectl("-n", cfg.operator_namespace, "apply", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/service-account-token",
            "metadata": {"name": "sampler-operator-token", "annotations": {"kubernetes.io/service-account.name": sa}}}))

        def ready() -> bool:
            pods = self.kjson("-n", cfg.operator_namespace, "get", "pods", "-l",
                              f"app.kubernetes.io/instance={cfg.release}")["items"]
            return len(pods) == 1 and all(c.get("ready") for c in pods[0]["status"].get("containerStatuses", [{}]))
        self.wait(ready, "the operator pod Ready")
        self.wait(lambda: get_ok(f"http://127.0.0.1:{cfg.liveness_port}/healthz"), "the operator's liveness endpoint")
        self.say(self.kubectl("-n", cfg.operator_namespace, "get", "pods", "-o", "wide").rstrip())

    def replica(self, name: str, port: int, model: Path) -> dict[str, Any]:
        models = model.parent
        return {"apiVersion": "sampler.rl.dev/v1alpha1", "kind": "SamplerReplica", "metadata": {"name": name},
                "spec": {
                    "model": str(model), "image": self.images["sampler-cpu"], "imagePullPolicy": "Never",
                    "engine": "vllm", "hostNetwork": True, "port": port,
                    "engineArgs": {"dtype": "float32", "maxModelLen": 512, "maxNumSeqs": 32,
                                   "kvCacheMemoryBytes": 64 << 20, "enforceEager": True,
                                   "extraArgs": ["--enable-test-seams"]},
                    "resources": {"limits": {"memory": "4Gi"}, "requests": {"cpu": "500m", "memory": "1Gi"}},
                    "health": {"periodSeconds": 2, "timeoutSeconds": 2, "failureThreshold": 3,
                               "startupTimeoutSeconds": 600},
                    "replacement": {"maxReplacements": 2, "windowSeconds": 600, "backoffSeconds": 0},
                    "checkpoints": {"allowedRoots": ["/checkpoints"], "volumes": [
                        {"name": "checkpoints", "mountPath": "/checkpoints",
                         "source": {"hostPath": {"path": str(self.cfg.checkpoints), "type": "Directory"}}}]},
                    # data only: the tiny model from the host's model cache; the code is the image's
                    "pod": {"terminationGracePeriodSeconds": 5,
                            "volumes": [{"name": "models", "hostPath": {"path": str(models), "type": "Directory"}},
                                        {"name": "dshm", "emptyDir": {"medium": "Memory"}}],
                            "volumeMounts": [{"name": "models", "mountPath": str(models), "readOnly": True},
                                             {"name": "dshm", "mountPath": "/dev/shm"}]}}}

    def sample(self, name: str) -> dict[str, Any]:
        code, out = post(self.url(name) + "/v1/sample",
                         {"prompts": [PROMPT], "sampling_params": {"max_tokens": 8, "temperature": 0.0}},
                         key=self.key(name))
        if code != 200:
            raise RuntimeError(f"sample from {name}: HTTP {code} {out}")
        return out

    def events(self, name: str, reason: str) -> list[dict[str, Any]]:
        return [e for e in self.kjson("-n", self.cfg.namespace, "get", "events")["items"]
                if e["reason"] == reason and e["involvedObject"].get("name") == name]


# -------------------------------------------------------------------- helpers
def read_images() -> dict[str, str]:
    """{"operator": tag, "sampler-cpu": tag} of the last scripts/images/build.sh."""
    if not IMAGES_LIST.exists():
        raise SystemExit(f"no images built ({IMAGES_LIST} missing): run scripts/images/build.sh")
    out = {}
    for line in IMAGES_LIST.read_text().splitlines():
        tag = line.split("|")[0]
        out[tag.rsplit("/", 1)[-1].split(":", 1)[0]] = tag
    return out


def tiny_model() -> Path:
    sys.path.insert(0, str(ROOT))
    from sampler_pod.testing.tiny_model import cached_tiny_model
    return cached_tiny_model()


def make_checkpoint(model: Path, out: Path) -> Path:
    """New weights for the tiny model: every tensor nudged, a sharper head (so greedy tokens visibly change)."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(model / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    new = {}
    for name, t in tensors.items():
        t = t.float() + torch.randn(t.shape, generator=g) * 0.05
        new[name] = (t * 8.0 if name == "lm_head.weight" else t).to(tensors[name].dtype).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(new, str(out / "model.safetensors"))
    os.chmod(out / "model.safetensors", 0o644)
    return out


def tokens(resp: dict[str, Any]) -> list[int]:
    return resp["results"][0]["sequences"][0]["tokens"]


def post(url: str, body: dict[str, Any], timeout: float = 300, key: str | None = None) -> tuple[int, dict[str, Any]]:
    from sampler_pod.testing.net import post_json

    return post_json(url, body, timeout, api_key=key)


def get_json(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:      # /health answers 503 with its JSON body when not ok
        return json.loads(e.read() or b"{}")


def get_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status == 200


def run_story(cfg: StoryConfig | None = None) -> StoryResult:
    return Story(cfg or StoryConfig()).run()


def main() -> int:
    if os.environ.get("SAMPLER_K8S_TIER") != "node":
        print("run through ./scripts/demo.sh (the cluster lives in a private network namespace)", file=sys.stderr)
        return 2
    run_story(StoryConfig(out=lambda s: print(s, flush=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
