"""Node tier: `./scripts/demo.sh`'s story (a SamplerPool of 2 and its gateway, the RL loop through it pushing
its weights over the network, a replica lost mid-run and caught up from its peer, a durable copy pushed
from disk), run through the SAME code (scripts/demo_cluster.py run_story) on the real
single-node cluster, and checked on what the API server, the pods and the loop's summary say -- not on
what it printed.

Own namespaces, release and free ports, so it neither needs nor touches a developer's demo run."""
from __future__ import annotations

import re
import time
import uuid
from typing import Any

import pytest

from sampler_pod.testing import net
from tests.operator.node.test_node_tier import Api, assert_restricted, assert_runs_project_image, post
from tests.support import k8s as ks
from tests.support.scripts import load_script

pytestmark = [pytest.mark.node, pytest.mark.vllm]
k8s_node = ks.node_fixture()
WARM_BUDGET_S = 300      # issue #13: a warm ./scripts/demo.sh finishes in under 5 minutes


def load_demo() -> Any:
    return load_script("demo_cluster")


def test_demo_story_end_to_end(k8s_node, tmp_path):
    demo = load_demo()
    suffix = uuid.uuid4().hex[:6]
    lines: list[str] = []
    checkpoints = tmp_path / "checkpoints"
    cfg = demo.StoryConfig(namespace=f"demo-{suffix}", operator_namespace=f"demo-ops-{suffix}",
                           release=f"so-{suffix}", replica_port=net.free_ports(2), gateway_port=ks.free_port(),
                           liveness_port=ks.free_port(), checkpoints=checkpoints,
                           out=lambda s: (lines.append(s), print(s, flush=True)))
    story = demo.Story(cfg)
    api = Api(k8s_node)
    ns = cfg.namespace
    pool, victim = "demo", "demo-1"
    try:
        t0 = time.monotonic()
        r = story.run()
        elapsed = time.monotonic() - t0
        text = "\n".join(lines)
        # a progress line per step, in order
        starts = [text.index(f"[{i}/7 ") for i in range(0, 8)]
        assert starts == sorted(starts)

        # 0. the operator is the chart's Deployment, running the project's operator image
        [opod] = api.core.list_namespaced_pod(cfg.operator_namespace,
                                              label_selector=f"app.kubernetes.io/instance={cfg.release}").items
        assert_runs_project_image(opod, "operator", "operator")
        assert opod.metadata.owner_references[0].kind == "ReplicaSet"

        # 1./2. a SamplerPool of 2: its two SamplerReplicas and its gateway (the operator's image), shown by
        #    `kubectl get sp,sr` while they came up
        crs = api.custom.list_namespaced_custom_object("sampler.rl.dev", "v1alpha1", ns, "samplerreplicas")["items"]
        assert sorted(c["metadata"]["name"] for c in crs) == ["demo-0", "demo-1"]
        assert all(c["metadata"]["ownerReferences"][0]["kind"] == "SamplerPool" for c in crs)
        [gpod] = [p for p in api.live_pods(ns) if "gateway" in p.metadata.name]
        assert [c.image for c in gpod.spec.containers] == [story.images["operator"]]
        first = r.tables[0].split()
        assert first[:7] == ["NAME", "READY", "DESIRED", "WEIGHTS", "UPDATED", "RUNS", "AGE"], r.tables[0]
        assert any(not pool_row(t)["ready"] == 2 for t in r.tables), "no table showed the pool before it was Ready"

        # 3. both replicas answered through the gateway, on the base weights, with the same greedy tokens;
        #    so did the README's curl
        assert set(r.sampled_by) == {"demo-0", "demo-1"}, r.sampled_by
        assert all(s["weights_label"] == "base" and len(demo.tokens(s)) == 8 for s in r.samples)
        assert len({tuple(demo.tokens(s)) for s in r.samples}) == 1
        assert r.readme_sample["weights_label"] == "base" and demo.tokens(r.readme_sample), r.readme_sample

        # 4.-6. the RL loop: every step finished, every batch at its step's label, the reward rose; a rollout
        #    was shown in progress (fewer replicas updated than desired, at a loop label). Every push went over
        #    the network (gloo): declared by its digest, no checkpoint written for it on the volume
        assert r.loop["push"] == "network", r.loop
        labels = [f"{pool}-step-{n}" for n in range(cfg.loop_steps + 1)]
        assert sorted(r.loop["pushed_sha256"]) == labels, r.loop["pushed_sha256"]
        assert sorted(p.name for p in checkpoints.iterdir()) == ["step-1"], list(checkpoints.iterdir())
        for c in crs:
            args = api.core.read_namespaced_pod(api.status(ns, c["metadata"]["name"])["podName"],
                                                ns).spec.containers[0].args
            assert args[args.index("--weight-transfer-backend") + 1] == "gloo", args
        steps = r.loop["steps"]
        assert [s["step"] for s in steps] == list(range(cfg.loop_steps + 1)), steps
        for s in steps:
            assert s["label"] == f"{pool}-step-{s['step']}" and s["batch_labels"] == [[s["label"]]] * 4, s
        assert steps[-1]["reward"] - steps[0]["reward"] >= 0.1, [s["reward"] for s in steps]
        rows = [pool_row(t) for t in r.tables]
        assert any(row["weights"].startswith(f"{pool}-step-") and row["updated"] < 2 for row in rows), r.tables
        # ...the lost pod died mid-run (step 1's sampling came after the kill) and came back, new
        assert r.killed["replica"] == victim
        pushed_1 = next(i for i, ln in enumerate(r.loop_lines) if ln.startswith(f"  pushed {pool}-step-1"))
        after_kill = r.loop_lines[pushed_1:]
        assert any(ln.startswith("step 1:") for ln in after_kill), r.loop_lines
        assert r.killed["uid"] not in {p.metadata.uid for p in api.live_pods(ns)}
        # ...at the pool's weights, which no checkpoint held: caught up from its peer (its log says so), a
        #    loop step's weights by their digest
        log = api.pod_log(ns, api.status(ns, victim)["podName"])
        caught = re.findall(r"caught up sha256 ([0-9a-f]{64}) \(\d+ bytes\) from (\S+) in", log)
        assert caught and caught[0][1] == f"http://127.0.0.1:{cfg.replica_port}", log[-3000:]
        assert caught[0][0] in r.loop["pushed_sha256"].values(), (caught, r.loop["pushed_sha256"])
        if r.caught_up:  # what the story narrated, when its watcher saw the pod before the next push
            assert r.caught_up["weights_source"] == f"peer http://127.0.0.1:{cfg.replica_port}", r.caught_up
        # 7. the README's push, run as written, moved the whole pool to its label
        final = r.readme_push["label"]
        assert final == "step-1" and r.readme_push["answer"]["state"] == "Complete", r.readme_push
        v = api.status(ns, victim)
        assert v["phase"] == "Ready" and v["weights"]["label"] == final, v
        # ...from the durable copy saved from a replica: the loop's last weights, from disk now
        for port in (cfg.replica_port, cfg.replica_port + 1):
            h = demo.get_json(f"http://127.0.0.1:{port}/health")
            assert (h["weights_label"], h["weights_source"], h["weights_checkpoint"]) == \
                (final, "checkpoint", "/checkpoints/step-1"), h
        ev = api.events(ns, victim, "PodDeleted")
        assert ev and r.killed["name"] in ev[0].message, [e.message for e in ev]
        for c in crs:
            assert_runs_project_image(api.core.read_namespaced_pod(api.status(ns, c["metadata"]["name"])["podName"],
                                                                   ns), "sampler-cpu", "sampler")
            # issue #33: the pool ran all this (sampling, pushes, a replacement) under the restricted contexts
            assert_restricted(api.status(ns, c["metadata"]["name"])["podName"], uid=1000)
        assert_restricted(gpod.metadata.name, "gateway", uid=1000)
        assert_restricted(opod.metadata.name, "operator", uid=65532)
        # ...and the pool ends whole at the last step's weights, as the API server says
        st = api.custom.get_namespaced_custom_object("sampler.rl.dev", "v1alpha1", ns, "samplerpools", pool)["status"]
        assert (st["readyReplicas"], st["updatedReplicas"], st["targetLabel"]) == (2, 2, final), st
        code, out = post(f"http://127.0.0.1:{cfg.gateway_port}/v1/sample",
                         {"prompts": [demo.PROMPT], "sampling_params": {"max_tokens": 8, "temperature": 0.0}},
                         key=story.key())
        assert code == 200 and out["weights_label"] == final, out

        # 7. the Events the story showed are the API server's
        assert any(e["reason"] == "PodDeleted" for e in r.events)
        assert pool_row(r.tables[-1]) == {"ready": 2, "desired": 2, "weights": final, "updated": 2}

        print(f"[demo story] {elapsed:.0f}s (budget for a warm demo: {WARM_BUDGET_S}s)")
        assert elapsed < WARM_BUDGET_S
    finally:
        story.clean()


def pool_row(table: str) -> dict[str, Any]:
    """The pool's row of a `kubectl get sp,sr` output (its first table), cut at the header's column starts
    (kubectl aligns them; a value not yet set, READY or WEIGHTS early on, is blank)."""
    header, row = table.splitlines()[:2]
    cols = ["NAME", "READY", "DESIRED", "WEIGHTS", "UPDATED", "RUNS", "AGE"]
    at = [header.index(c) for c in cols] + [len(row) + 1]
    cell = {c: row[at[i]:at[i + 1]].strip().replace("<none>", "") for i, c in enumerate(cols)}
    assert cell["NAME"].endswith("/demo") or cell["NAME"] == "demo", table
    return {"ready": int(cell["READY"] or 0), "desired": int(cell["DESIRED"]), "weights": cell["WEIGHTS"],
            "updated": int(cell["UPDATED"] or 0)}
