"""Node tier, issue #33 acceptance 2: the restricted pod contexts on the REAL kubelet (dockershim, docker's
default seccomp profile for RuntimeDefault), with the REAL vLLM CPU engine.

The OpenShift case: the sampler container runs under a random uid in group 0 (spec.pod.securityContext,
the documented override), with no passwd entry for it, a read-only root, no capability and no new
privileges, and samples. What the kernel says about the process is checked (/proc/<pid>/status), not
the pod spec. (Every other node test runs its pods under the default contexts, uid 1000, as well; the
demo story checks its pool's the same way.)"""
from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from tests.operator.node.test_node_tier import (  # noqa: F401  (fixtures: api, operator, ns)
    PROMPT,
    _log,
    api,
    assert_restricted,
    cpu_engine_args,
    ns,
    operator,
    post,
    replica,
)
from tests.support import k8s as ks

pytestmark = [pytest.mark.node, pytest.mark.vllm]
k8s_node = ks.node_fixture()


def test_a_vllm_replica_under_a_random_uid_in_group_0_samples(api, ns, operator, tiny_model):  # noqa: F811
    uid = random.randrange(1_000_000, 2_000_000_000)   # as OpenShift picks: no passwd entry, no image user
    port = ks.free_port()
    t0 = time.monotonic()
    api.apply(ns, replica("ru", port, Path(tiny_model), engine="vllm",
                          engineArgs={**cpu_engine_args(), "extraArgs": []},
                          resources={"limits": {"memory": "4Gi"}, "requests": {"cpu": "500m", "memory": "1Gi"}},
                          health={"startupTimeoutSeconds": 600},
                          pod={"securityContext": {"runAsUser": uid}}))
    api.wait_ready(ns, "ru", "ru-0", timeout=600)
    _log(f"vLLM replica ru-0 (uid {uid}) Ready in {time.monotonic() - t0:.1f}s")
    pod = api.core.read_namespaced_pod("ru-0", ns)
    assert pod.spec.security_context.run_as_user == uid and pod.spec.security_context.run_as_group == 0
    assert pod.spec.security_context.seccomp_profile.type == "RuntimeDefault"
    proc = assert_restricted("ru-0", uid=uid)
    assert api.status(ns, "ru")["podName"] == "ru-0" and pod.status.container_statuses[0].restart_count == 0
    code, out = post(f"http://127.0.0.1:{port}/v1/sample",
                     {"prompts": [PROMPT], "sampling_params": {"max_tokens": 8, "temperature": 0.0}},
                     key=api.key(ns, "ru"))
    assert code == 200 and len(out["results"][0]["sequences"][0]["tokens"]) == 8, out
    log = api.pod_log(ns, "ru-0")
    assert "Permission denied" not in log and "Read-only file system" not in log, log[-3000:]
    _log(f"ru-0 sampled as uid {proc['Uid'].split()[0]}, gid {proc['Gid'].split()[0]}, seccomp {proc['Seccomp']}")
