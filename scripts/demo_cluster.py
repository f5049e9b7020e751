"""The operator's story on the local single-node cluster (`./scripts/demo.sh`, run inside the node tier's
private network namespace by scripts/k8s/node-exec.sh; demo.sh brings the cluster up and builds the images).

  0. helm install the chart (the project's operator image)
  1. apply a SamplerPool of 2 (real vLLM CPU engine, the embedded tiny model, the project's CPU sampler
     image): the operator creates its two SamplerReplicas and its gateway
  2. `kubectl get sp,sr` while they come up
  3. sample through the gateway, the pool's one address (greedy, the same prompt, both replicas answer)
  4. a trainer's RL loop through the gateway (examples/rl_loop.py --push network): the Tinker SDK samples
     groups, a toy reward, a policy-gradient step in torch, the parameters pushed over the network with
     `sampler_client` (`Pool.push_weights`: vLLM's weight-transfer protocol, gloo; no checkpoint written);
     each push is declared by its digest and rolled out (`kubectl get sp` while it runs)
  5. one replica's pod is lost mid-run (deleted as step 1 of the loop starts sampling)
  6. the loop is unharmed: the gateway samples on the replica left, the operator brings the lost one back
     at the pool's weights, which it catches up from its peer (no checkpoint holds them), and the next
     push waits for it; every step finishes, every batch at its step's weights, the reward up
  7. a durable copy of the loop's last weights saved from a replica (`GET /v1/weights/staged`: one
     safetensors file), then the README's push of it from disk (`python -m sampler_client push ... --wait`),
     then `kubectl get sp,sr` and the Events

The README's quickstart block is this story's script: every command in it is run here as written
(`Quickstart`), with three node-tier differences, each said where it happens: helm gets the node tier's
values file added, `pool.yaml` is the demo's pool (the tiny model, the CPU image, host network), and the
`kubectl port-forward` line is not run (the gateway listens on the node's network: GATEWAY points there).
A README command the story no longer runs fails the story (`Quickstart.check_all_run`) and a unit test
(tests/unit/test_readme.py) checks the block's commands are the ones the story knows.

The pool mounts a checkpoints volume for step 7 alone (the README's push is from disk); the loop's
network pushes write nothing to it (the node-tier test checks; tests/operator/node/
test_pool_network_push_node.py runs network pushes into a pool whose pods mount no volume at all).

The replica story this demo told before the pool (weights declared on a SamplerReplica, a write failing
midway, the pod replaced at the declared weights) is tested on the node tier (tests/operator/node/
test_node_tier.py); two more vLLM starts would take the demo past 5 minutes.

`run_story()` returns what happened, read back from the API server and the pods; the node-tier test
(tests/operator/node/test_demo_story.py) runs this same function and asserts on it and on the cluster.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
QUICKSTART_MARK = "<!-- quickstart: ./scripts/demo.sh runs these commands (scripts/demo_cluster.py) -->"
# Each README quickstart command, by how it starts, and where the story runs it. None: not run (why: above).
QUICKSTART_STEPS: dict[str, str | None] = {
    "kubectl create namespace ": "0", "helm install ": "0", "kubectl apply ": "1", "kubectl get ": "2-7",
    "KEY=": "3", "ADMIN=": "4", "kubectl port-forward ": None, "curl ": "3", "python -m sampler_client push ": "7",
}
CACHE = Path(os.environ.get("SAMPLER_CACHE_DIR") or Path.home() / ".cache" / "sampler-operator")
IMAGES_LIST = CACHE / "images" / "images.list"
STEPS = 7
PROMPT = [1, 17, 42, 99, 123, 7]
T = TypeVar("T")


@dataclass
class StoryConfig:
    namespace: str = "sampler-demo"              # the SamplerPool
    operator_namespace: str = "sampler-system"   # the chart's release
    release: str = "sampler-operator"
    replica_port: int = 18101                    # hostNetwork: replica i listens on replica_port + i
    gateway_port: int = 18110
    liveness_port: int = 18180
    checkpoints: Path = CACHE / "demo" / "checkpoints"
    loop_steps: int = 3                          # the RL loop's policy updates
    timeout_s: float = 420                       # per wait; a warm run takes ~4 min in all
    out: Callable[[str], None] = print


@dataclass
class StoryResult:
    pool: str = "demo"
    replicas: list[str] = field(default_factory=list)
    tables: list[str] = field(default_factory=list)               # `kubectl get sp,sr` outputs, in order
    samples: list[dict[str, Any]] = field(default_factory=list)   # step 3: /v1/sample through the gateway
    sampled_by: list[str] = field(default_factory=list)           # ... and the replica that answered each
    loop_lines: list[str] = field(default_factory=list)           # what the RL loop printed
    loop: dict[str, Any] = field(default_factory=dict)            # its summary (steps, rewards, labels)
    killed: dict[str, str] = field(default_factory=dict)          # the lost pod: replica, name, uid
    caught_up: dict[str, Any] = field(default_factory=dict)       # its replacement's first `ok` /health
    events: list[dict[str, Any]] = field(default_factory=list)
    final_status: dict[str, Any] = field(default_factory=dict)    # the pool's
    readme_sample: dict[str, Any] = field(default_factory=dict)   # step 3: the README's curl, its answer
    readme_push: dict[str, Any] = field(default_factory=dict)     # step 7: the README's push, its label and answer
    seconds: float = 0.0


class Story:
    def __init__(self, cfg: StoryConfig) -> None:
        self.cfg = cfg
        self.t0 = time.monotonic()
        self.kubectl_bin = os.environ.get("KUBECTL", "kubectl")
        self.helm_bin = os.environ.get("HELM", "helm")
        self.images = read_images()
        self.pool = "demo"
        self.replicas = [f"{self.pool}-0", f"{self.pool}-1"]
        self.victim = self.replicas[1]
        self._keys: dict[str, str] = {}
        self.quickstart = Quickstart(cfg, readme_quickstart(README.read_text()))
        self._say_lock = threading.Lock()

    # ---------------------------------------------------------------- narration and small runners
    def say(self, msg: str) -> None:
        with self._say_lock:   # the loop's reader and the table watcher narrate from their threads
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
        p = subprocess.run([self.helm_bin, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
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

    def pool_status(self) -> dict[str, Any]:
        return self.kjson("-n", self.cfg.namespace, "get", "sp", self.pool).get("status") or {}

    def get_tables(self) -> str:
        # the README's `kubectl get`, with a fresh discovery cache: the CRDs may be newer than kubectl's cached
        # API list
        return self.quickstart.run("kubectl get ", self.shell_env(),
                                   extra=f" --cache-dir {shlex.quote(str(CACHE / 'demo' / 'kube-cache'))}")

    def key(self, admin: bool = False) -> str:
        """The pool's key, read by the README's `KEY=` / `ADMIN=` lines: from the Secret the operator generated
        (`<pool>-sampler-keys`; the demo's spec names none). The API key samples; the admin key pushes
        weights. The operator never rotates them (a replacement pod gets the same keys)."""
        var = "ADMIN" if admin else "KEY"
        if var not in self._keys:
            self._keys[var] = self.quickstart.value(var, self.shell_env())
        return self._keys[var]

    def shell_env(self) -> dict[str, str]:
        """What the README's commands find in their shell: kubectl, helm and the venv's python on PATH, the
        gateway's address (the port-forward line's GATEWAY) and the keys read so far."""
        path = [str(Path(b).parent) for b in (self.kubectl_bin, self.helm_bin) if os.sep in b]
        path += [str(Path(sys.executable).parent), os.environ.get("PATH", "")]
        return {**os.environ, "PATH": os.pathsep.join(path), "GATEWAY": self.gateway, **self._keys}

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.cfg.gateway_port}"   # hostNetwork: the node's namespace

    def watcher(self, r: StoryResult) -> Callable[[], None]:
        """Print `kubectl get sp,sr` when a column other than AGE changed; else a heartbeat every 15 s."""
        last: list[Any] = [None, time.monotonic()]

        def show() -> None:
            t = self.get_tables()
            key = [ln.rsplit(None, 1)[0] for ln in t.splitlines() if ln.strip()]
            if key != last[0]:
                last[0], last[1] = key, time.monotonic()
                r.tables.append(t)
                self.say(t.rstrip())
            elif time.monotonic() - last[1] > 15:
                last[1] = time.monotonic()
                self.say(f"  ... (+{int(time.monotonic() - self.t0)}s) waiting")
        return show

    # ---------------------------------------------------------------- the story
    def run(self) -> StoryResult:
        cfg, r = self.cfg, StoryResult(pool=self.pool, replicas=list(self.replicas))
        self.clean()
        # the watched namespace first: the chart puts the operators' KopfPeering object there
        self.quickstart.run("kubectl create namespace ", self.shell_env())
        self.step(0, f"helm install {cfg.release} charts/sampler-operator -n {cfg.operator_namespace} "
                     f"(image {self.images['operator']})")
        self.install_operator()

        self.step(1, f"kubectl apply: a SamplerPool of 2 (vLLM CPU engine, tiny model, image "
                     f"{self.images['sampler-cpu']}) and its gateway")
        model = tiny_model()
        cfg.checkpoints.mkdir(parents=True, exist_ok=True)
        os.chmod(cfg.checkpoints, 0o755)     # the replicas read it as their own user
        import yaml

        # the README's `kubectl apply -f pool.yaml`, pool.yaml being the demo's pool
        with TemporaryDirectory() as d:
            (Path(d) / "pool.yaml").write_text(yaml.safe_dump(self.pool_body(model), sort_keys=False))
            self.say(self.quickstart.run("kubectl apply ", self.shell_env(), cwd=Path(d)).rstrip())
        self.gateway_token()

        self.step(2, "kubectl get sp,sr, while the operator creates the replicas, their pods and the gateway "
                     "(vLLM starts in ~1-2 min)")
        show = self.watcher(r)
        show()
        self.wait(lambda: (s := self.pool_status()).get("readyReplicas") == 2 and s.get("replicas") == 2,
                  "the pool's 2 replicas Ready", on_tick=show)
        self.wait(lambda: sum(x["eligible"] for x in get_json(self.gateway + "/health").get("replicas", [])) == 2,
                  "the gateway routing to both", on_tick=show)
        show()

        self.step(3, f"sample through the gateway ({self.gateway}, the pool's one address), greedy, the same "
                     "prompt, with the pool's API key")
        self.say(f"  the operator generated the keys: kubectl -n {cfg.namespace} get secret "
                 f"{self.pool}-sampler-keys -o jsonpath='{{.data.api-key}}' | base64 -d")
        seen: set[str] = set()
        for _ in range(16):   # least-loaded routing: the replicas take turns; stop once both answered
            code, out, replica = post_gateway(self.gateway + "/v1/sample", {
                "prompts": [PROMPT], "sampling_params": {"max_tokens": 8, "temperature": 0.0}}, self.key())
            if code != 200:
                raise RuntimeError(f"sample through the gateway: HTTP {code} {out}")
            r.samples.append(out)
            r.sampled_by.append(replica)
            if replica not in seen:
                seen.add(replica)
                self.say(f"  answered by {replica}: tokens {tokens(out)}  weights {out['weights_label']}")
            if len(seen) == 2:
                break
        out = self.quickstart.run("curl ", self.shell_env())
        try:
            r.readme_sample = json.loads(out)
        except ValueError:
            raise RuntimeError(f"the README's curl: not a sample's answer: {out[:500]}") from None
        if "weights_label" not in r.readme_sample:
            raise RuntimeError(f"the README's curl: not a sample's answer: {out[:500]}")
        self.say(f"  the README's curl: tokens {tokens(r.readme_sample)}  weights {r.readme_sample['weights_label']}")

        self.step(4, f"a trainer's RL loop through the gateway, {cfg.loop_steps} updates (examples/rl_loop.py "
                     "--push network): Tinker SDK samples -> reward -> torch step -> the parameters pushed over "
                     "the network (sampler_client, vLLM's weight transfer, gloo), wait")
        self.say("  reward = share of token ids 64..127 in a completion; every batch must come from its step's "
                 "weights (X-Sampler-Weights-Spans); no checkpoint is written: each push is declared by its "
                 "digest (spec.weights.sha256) and rolled out, one replica at a time")
        self.run_loop(r, model, show)

        self.step(7, "a durable copy of the loop's last weights, saved from a replica (GET /v1/weights/staged), "
                     "and the README's push of it from disk (python -m sampler_client push ... --wait); then "
                     "kubectl get sp,sr, and the Events")
        self.readme_push(r)
        t = self.get_tables()
        r.tables.append(t)
        self.say(t.rstrip())
        r.events = [e for e in self.kjson("-n", cfg.namespace, "get", "events")["items"]
                    if e["involvedObject"].get("kind") in ("SamplerPool", "SamplerReplica")]
        for e in sorted(r.events, key=lambda e: e.get("lastTimestamp") or "")[-14:]:
            self.say(f"  {e['type']:<8} {e['reason']:<18} {e['involvedObject']['kind']}/"
                     f"{e['involvedObject']['name']}: {e['message'][:110]}")
        r.final_status = self.pool_status()
        self.quickstart.check_all_run()
        r.seconds = time.monotonic() - self.t0
        self.say(f"\ndone in {r.seconds:.0f}s. The cluster stays up: scripts/k8s/node-exec.sh kubectl -n "
                 f"{cfg.namespace} get sp,sr,pods ; stop it with `make cluster-down`.")
        return r

    def run_loop(self, r: StoryResult, model: Path, show: Callable[[], None]) -> None:
        """Steps 4-6: the loop as a subprocess (as a trainer runs it), its lines narrated; the victim's
        pod deleted on the loop's own word that step 1's weights serve (its sampling starts); the
        tables shown while it runs, so the rollouts and the replacement are seen as they happen."""
        cfg = self.cfg
        summary = CACHE / "demo" / "rl-summary.json"
        summary.unlink(missing_ok=True)
        argv = [sys.executable, str(ROOT / "examples" / "rl_loop.py"), "--gateway", self.gateway,
                "--api-key", self.key(), "--admin-key", self.key(admin=True), "--model", str(model),
                "--push", "network", "--run", self.pool, "--steps", str(cfg.loop_steps),
                "--push-timeout", str(cfg.timeout_s), "--summary", str(summary)]
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        # Its stderr (the client's per-replica progress, library warnings) to a file: the story narrates
        # the loop's own lines, and a failure shows the file's end.
        err_path = CACHE / "demo" / "rl-loop.stderr"
        with open(err_path, "w") as err:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        done = threading.Event()

        victim_url = f"http://127.0.0.1:{cfg.replica_port + self.replicas.index(self.victim)}"

        def kill() -> None:
            pod = self.status(self.victim)["podName"]
            uid = self.kjson("-n", cfg.namespace, "get", "pod", pod)["metadata"]["uid"]
            old_start = get_json(victim_url + "/health").get("started_at")
            self.step(5, f"{self.victim}'s pod {pod} is lost mid-run (kubectl delete pod --force), as step 1 of "
                         "the loop starts sampling")
            self.kubectl("-n", cfg.namespace, "delete", "pod", pod, "--force", "--grace-period=0", "--wait=false")
            r.killed = {"replica": self.victim, "name": pod, "uid": uid, "started_at": old_start}
            self.step(6, "the loop goes on: the gateway samples on the replica left; the operator makes a new pod, "
                         "which catches the pool's weights up from its peer, and the next push returns once it "
                         "serves them")

        def caught_up() -> None:
            """The replacement's first `ok`: where its weights came from (a peer: no checkpoint holds them)."""
            h = get_json(victim_url + "/health")
            if h.get("status") == "ok" and h.get("started_at") != r.killed["started_at"]:
                r.caught_up = h
                self.say(f"  {self.victim}'s new pod serves {h.get('weights_label')}, its weights from "
                         f"{h.get('weights_source')} (verified against sha256 {str(h.get('weights_sha256'))[:16]})")

        def watch() -> None:
            while not done.wait(1.0):
                with contextlib.suppress(RuntimeError, OSError, subprocess.TimeoutExpired):
                    show()
                if r.killed and not r.caught_up:
                    with contextlib.suppress(OSError, ValueError):
                        caught_up()

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\n")
                r.loop_lines.append(line)
                self.say(f"  | {line}")
                if not r.killed and line.startswith(f"  pushed {self.pool}-step-1"):
                    kill()
            rc = proc.wait(timeout=cfg.timeout_s)
        finally:
            done.set()
            watcher.join(30)
            if proc.poll() is None:
                proc.kill()
        if rc != 0:
            raise RuntimeError(f"the RL loop failed (exit {rc}); its last lines:\n" + "\n".join(r.loop_lines[-20:])
                               + f"\nits stderr ({err_path}):\n" + err_path.read_text()[-3000:])
        r.loop = json.loads(summary.read_text())
        rewards = [s["reward"] for s in r.loop["steps"]]
        self.say(f"  every step finished; rewards {rewards}; every batch at its step's label; no checkpoint "
                 f"written; the lost replica {self.victim} is back on {self.status(self.victim).get('podName')}")

    def readme_push(self, r: StoryResult) -> None:
        """The README's push, run as written: its checkpoint is a durable copy of the loop's last weights,
        which went over the network only: a replica's kept copy of them (`GET /v1/weights/staged`, one
        safetensors file, the admin key), saved at the path the README names (the pods see cfg.checkpoints
        at /checkpoints), so the pool rolls out to its label from disk."""
        argv = shlex.split(self.quickstart.command("python -m sampler_client push "))
        path, label = argv[argv.index("--checkpoint") + 1], argv[argv.index("--label") + 1]
        if not path.startswith("/checkpoints/"):
            raise RuntimeError(f"the README pushes {path}: the demo's pods see their checkpoints at /checkpoints")
        digest = r.loop["pushed_sha256"][f"{self.pool}-step-{self.cfg.loop_steps}"]
        dest = self.cfg.checkpoints / path.removeprefix("/checkpoints/")
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        req = urllib.request.Request(f"http://127.0.0.1:{self.cfg.replica_port}/v1/weights/staged?sha256={digest}",
                                     headers={"X-API-Key": self.key(admin=True)})
        with urllib.request.urlopen(req, timeout=120) as resp, open(dest / "model.safetensors", "wb") as f:
            shutil.copyfileobj(resp, f)
        # The replicas read the volume as their own user.
        dest.chmod(0o755)
        (dest / "model.safetensors").chmod(0o644)
        self.say(f"  saved {self.replicas[0]}'s copy of {self.pool}-step-{self.cfg.loop_steps} (sha256 "
                 f"{digest[:16]}) as {path}/model.safetensors")
        out = self.quickstart.run("python -m sampler_client push ", self.shell_env(), cwd=ROOT)
        r.readme_push = {"label": label, "answer": json.loads(out)}
        self.say(f"  pushed {label}: every replica serves it")

    # ---------------------------------------------------------------- pieces
    def clean(self) -> None:
        """A previous run's pool, replicas, release and namespaces go first (their pods hold the demo's host
        ports). The pool before its replicas (else it would make them again), both before the operator:
        kopf keeps a finalizer on each (for its daemon), which the running operator removes; with no
        operator left, the finalizers are dropped by hand. (The demo's own namespaces only.)"""
        cfg = self.cfg
        released = bool(self.helm("status", cfg.release, "-n", cfg.operator_namespace, check=False))
        if self.kubectl("get", "namespace", cfg.namespace, "--ignore-not-found", "-o", "name").strip():
            self.say(f"removing the previous demo run (namespace {cfg.namespace}, release {cfg.release})...")
            # Before their namespace: deleting the namespace also deletes the operator's RoleBinding in
            # it, after which the operator could no longer remove its finalizers.
            for kind, what in (("sp", "SamplerPools"), ("sr", "SamplerReplicas")):
                names = self.kubectl("-n", cfg.namespace, "get", kind, "-o", "name").split()
                if not names:
                    continue
                if not released:
                    for name in names:
                        self.kubectl("-n", cfg.namespace, "patch", name, "--type", "merge",
                                     "-p", '{"metadata":{"finalizers":null}}')
                self.kubectl("-n", cfg.namespace, "delete", kind, "--all", "--wait=false")
                self.wait(lambda k=kind: not self.kubectl("-n", cfg.namespace, "get", k, "-o", "name").strip(),
                          f"the previous {what} deleted")
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
            # Node-tier quirks (no CNI, no endpoints for the `kubernetes` Service, no ServiceAccount admission
            # plugin): the operator shares the node's network to reach the API server and the pods at 127.0.0.1,
            # and mounts its token Secret.
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
        # the README's helm install, plus the node tier's values (a real cluster needs none of them)
        out = self.quickstart.run("helm install ", self.shell_env(), extra=f" -f {shlex.quote(str(vf))}")
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

    def pool_body(self, model: Path) -> dict[str, Any]:
        models = model.parent
        template = {
            # the pods see the host's model cache at /models: not at its host path, which lies under the
            # image's /root, a directory only root may cross (the sampler runs as a non-root uid)
            "model": f"/models/{model.name}", "image": self.images["sampler-cpu"], "imagePullPolicy": "Never",
            "engine": "vllm", "hostNetwork": True, "port": self.cfg.replica_port,
            "engineArgs": {"dtype": "float32", "maxModelLen": 512, "maxNumSeqs": 32,
                           "kvCacheMemoryBytes": 64 << 20, "enforceEager": True},
            "resources": {"limits": {"memory": "4Gi"}, "requests": {"cpu": "500m", "memory": "1Gi"}},
            "health": {"periodSeconds": 2, "timeoutSeconds": 2, "failureThreshold": 3, "startupTimeoutSeconds": 600},
            # the loop pushes over the network (vLLM's weight transfer, gloo on CPU)
            "weightTransfer": {"backend": "gloo"},
            "checkpoints": {"allowedRoots": ["/checkpoints"], "volumes": [
                {"name": "checkpoints", "mountPath": "/checkpoints",
                 "source": {"hostPath": {"path": str(self.cfg.checkpoints), "type": "Directory"}}}]},
            # data only: the tiny model from the host's model cache; the code is the image's. Two CPU engines
            # share the node's cores: vLLM's default binding would pin both to one (docs/guide/operations.md).
            "pod": {"terminationGracePeriodSeconds": 5,
                    "env": [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "nobind"}],
                    "volumes": [{"name": "models", "hostPath": {"path": str(models), "type": "Directory"}},
                                {"name": "dshm", "emptyDir": {"medium": "Memory"}}],
                    "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True},
                                     {"name": "dshm", "mountPath": "/dev/shm"}]}}
        # Node-tier quirks, as the operator's: the gateway shares the node's network (no CNI; the API
        # server at 127.0.0.1, which the `kubernetes` Service cannot list as its endpoint) and mounts its
        # account's token Secret (this API server has no ServiceAccount admission plugin; gateway_token()
        # makes the Secret).
        token = {"name": "sa-token", "secret": {"secretName": f"{self.pool}-gateway-token"}}
        mount = {"name": "sa-token", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": True}
        return {"apiVersion": "sampler.rl.dev/v1alpha1", "kind": "SamplerPool", "metadata": {"name": self.pool},
                "spec": {"replicas": 2, "template": template,
                         "rollout": {"maxUnavailable": 1}, "routing": {"versionPolicy": "Latest"},
                         "gateway": {"port": self.cfg.gateway_port, "hostNetwork": True,
                                     "env": [{"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
                                             {"name": "KUBERNETES_SERVICE_PORT", "value": "6443"}],
                                     "volumes": [token], "volumeMounts": [mount]}}}

    def gateway_token(self) -> None:
        """The token Secret of the gateway's ServiceAccount, once the operator made the account (the
        controller-manager fills it in; the kubelet retries the gateway pod's mount until then)."""
        account = f"{self.pool}-gateway"
        self.wait(lambda: self.kubectl("-n", self.cfg.namespace, "get", "serviceaccount", account,
                                       "--ignore-not-found", "-o", "name").strip(), f"ServiceAccount {account}")
        self.kubectl("-n", self.cfg.namespace, "apply", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/service-account-token",
            "metadata": {"name": f"{self.pool}-gateway-token",
                         "annotations": {"kubernetes.io/service-account.name": account}}}))


# -------------------------------------------------------------------- the README's quickstart
def readme_quickstart(readme: str) -> list[str]:
    """The commands of the README's quickstart: the ```bash block after QUICKSTART_MARK, one command per
    entry (a line ending in a backslash continues), a trailing `  # comment` dropped."""
    if QUICKSTART_MARK not in readme:
        raise ValueError(f"README.md has no quickstart block (the line {QUICKSTART_MARK!r})")
    block = readme.split(QUICKSTART_MARK, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands: list[str] = []
    current = ""
    for line in block.splitlines():
        line = re.sub(r"\s{2,}#.*$", "", line).rstrip()
        current += line + "\n"
        if not line.endswith("\\"):
            if current.strip():
                commands.append(current.strip())
            current = ""
    return commands


class Quickstart:
    """The README's quickstart commands, run by the story as written. A run in other namespaces (the
    node-tier test's) has the README's names replaced by its own; with the defaults nothing is replaced."""

    def __init__(self, cfg: StoryConfig, commands: list[str]) -> None:
        default = StoryConfig()
        names = {default.namespace: cfg.namespace, default.operator_namespace: cfg.operator_namespace,
                 default.release: cfg.release}
        self.commands: dict[str, str] = {}
        for c in commands:
            prefix = [p for p in QUICKSTART_STEPS if c.startswith(p)]
            if len(prefix) != 1:
                raise ValueError(f"README quickstart: the demo does not know how to run {c!r}")
            if prefix[0] in self.commands:
                raise ValueError(f"README quickstart: two commands start with {prefix[0]!r}")
            for old, new in names.items():
                # a name as a word of its own, not inside a path (charts/sampler-operator stays)
                c = re.sub(rf"(?<![\w/.-]){re.escape(old)}(?![\w/.-])", new, c)
            self.commands[prefix[0]] = c
        if set(self.commands) != set(QUICKSTART_STEPS):
            raise ValueError(f"README quickstart: missing {sorted(set(QUICKSTART_STEPS) - set(self.commands))}")
        self.ran: set[str] = set()

    def command(self, prefix: str) -> str:
        return self.commands[prefix]

    def run(self, prefix: str, env: dict[str, str], extra: str = "", cwd: Path = ROOT) -> str:
        """Run the README's command (and `extra`, appended) in bash; its stdout. A failure raises."""
        p = subprocess.run(["bash", "-o", "pipefail", "-c", "set -e\n" + self.commands[prefix] + extra], env=env,
                           cwd=cwd, capture_output=True, text=True, timeout=900)
        if p.returncode:
            raise RuntimeError(f"README quickstart: `{self.commands[prefix]}` failed ({p.returncode}): "
                               f"{p.stderr.strip()[-2000:]}")
        self.ran.add(prefix)
        return p.stdout

    def value(self, var: str, env: dict[str, str]) -> str:
        """Run the README's `VAR=$(...)` line and return what it set."""
        return self.run(f"{var}=", env, extra=f'\nprintf %s "${var}"')

    def check_all_run(self) -> None:
        skipped = {p for p, step in QUICKSTART_STEPS.items() if step is None}
        if missed := set(self.commands) - self.ran - skipped:
            raise RuntimeError(f"README quickstart: the story did not run {sorted(missed)}")


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


def tokens(resp: dict[str, Any]) -> list[int]:
    return resp["results"][0]["sequences"][0]["tokens"]


def post_gateway(url: str, body: dict[str, Any], key: str, timeout: float = 300) -> tuple[int, dict[str, Any], str]:
    """POST through the gateway: the HTTP code, the JSON body and the replica that answered (the gateway
    names it in X-Sampler-Replica)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "X-API-Key": key})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), r.headers.get("X-Sampler-Replica", "")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), e.headers.get("X-Sampler-Replica", "")


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
