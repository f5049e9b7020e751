"""What gloo's group really opens, measured, for the NetworkPolicy a pool gets (operator/sampler_operator/
network_policy.py; its rendering: tests/operator/unit/test_network_weights.py).

A trainer (rank 0) and two replicas' workers (ranks 1, 2) make a group exactly as a push does
(sampler_common/weight_transfer/gloo.py: a TCPStore on the trainer, `open_group` on each side, each bound to
its own loopback address), pass a chunk down the chain once (relay.py), and report their sockets while
the group is up. Found:

* the trainer listens on `master_port` (the TCPStore) and every replica worker connects to it;
* every process listens on one more port, one the kernel chose (not `master_port`);
* every PAIR of processes has a connection, the replicas' pair too (gloo connects the full mesh), made to
  the listener of the side whose address is lower: which side connects depends on addresses, not on
  ranks, so a replica is connected to, on its ephemeral port, by the trainer and by another replica.

Hence the policy: into the replicas, on every TCP port, from the trainer's pods and from the pool's own
replicas. The trainer's address is put highest here, so that both directions happen in one run.
"""

from __future__ import annotations

import json
import subprocess
import sys

from sampler_pod.testing.net import free_port
from tests.support import REPO_ROOT

ADDRESSES = ["127.0.0.30", "127.0.0.29", "127.0.0.28"]  # rank 0 (the trainer), rank 1, rank 2

RANK = r"""
import datetime, json, sys
import psutil, torch
from torch.distributed import TCPStore
from sampler_common.weight_transfer.gloo import open_group

rank, port, addresses = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
store = TCPStore(addresses[0], port, len(addresses), rank == 0, timeout=datetime.timedelta(seconds=120),
                 wait_for_workers=False)
group = open_group(store, rank, len(addresses), addresses[rank], 120)
t = torch.full((1 << 16,), rank, dtype=torch.uint8)
if rank > 0:  # down the chain once, as a push's chunks go (relay.py)
    group.recv([t], rank - 1, 0).wait()
if rank + 1 < len(addresses):
    group.send([t], rank + 1, 0).wait()
assert int(t[0]) == 0
socks = [{"status": c.status, "laddr": list(c.laddr), "raddr": list(c.raddr) if c.raddr else None}
         for c in psutil.Process().net_connections(kind="tcp")]
print(json.dumps({"rank": rank, "sockets": socks}), flush=True)
sys.stdin.readline()
"""


def _host(addr: list[object]) -> str:
    return str(addr[0]).removeprefix("::ffff:")


def test_gloo_connects_the_full_mesh_to_ephemeral_listeners_from_the_higher_address() -> None:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), str(port), json.dumps(ADDRESSES)],
                              cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for rank in range(len(ADDRESSES))]
    try:
        reports = {}
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            assert line, f"a rank exited: {p.wait(30)}"
            doc = json.loads(line)
            reports[doc["rank"]] = doc["sockets"]
    finally:
        for p in procs:
            if p.poll() is None:
                assert p.stdin is not None
                p.stdin.write("\n")
                p.stdin.flush()
        for p in procs:
            p.wait(60)

    listening = {rank: {(_host(s["laddr"]), s["laddr"][1]) for s in socks if s["status"] == "LISTEN"}
                 for rank, socks in reports.items()}
    # The trainer: the store on master_port (all addresses) and one ephemeral port on its own address.
    store = {a for a in listening[0] if a[1] == port}
    assert len(store) == 1, listening[0]
    pair_ports = {rank: {a for a in ls if a[1] != port} for rank, ls in listening.items()}
    for rank, ls in pair_ports.items():
        assert len(ls) == 1 and next(iter(ls))[0] == ADDRESSES[rank], (rank, listening[rank])
    listener_of = {next(iter(ls)): rank for rank, ls in pair_ports.items()}

    # Every replica worker is connected to the trainer's store.
    for rank in (1, 2):
        assert any(s["status"] == "ESTABLISHED" and s["raddr"] and s["raddr"][1] == port for s in reports[rank]), \
            reports[rank]
    # Every pair has one connection to a pair listener, the one of the lower address of the two.
    made: set[tuple[int, int]] = set()  # (connecting rank, listening rank)
    for rank, socks in reports.items():
        for s in socks:
            if s["status"] != "ESTABLISHED" or not s["raddr"]:
                continue
            target = listener_of.get((_host(s["raddr"]), s["raddr"][1]))
            if target is not None and target != rank:
                made.add((rank, target))
    assert made == {(0, 1), (0, 2), (1, 2)}, made  # the trainer (highest address) into both; replica to replica
    for a, b in made:
        assert ADDRESSES[a] > ADDRESSES[b]
