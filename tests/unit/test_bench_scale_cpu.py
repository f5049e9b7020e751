"""The benches' CPU accounting (tests/support/cpu_share.py) and bench/scale.py's report (bench/scale_report.py):
each process charged its own and its unnamed descendants' time, a process group's time, the box's busy
share of its cores and its steal, the readers against a real process's own count (getrusage), and the
section's CPU table and reading built from a run's figures."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from bench.scale_report import body, cpu_rows, cpu_table, reading, row
from tests.support.cpu_share import (
    BoxTicks,
    CpuSample,
    ProcStat,
    between,
    charge,
    group_cpu_s,
    group_ticks,
    parse_box,
    parse_stat,
    process_cpu_s,
    read_box,
    steal_share,
)


def test_parse_stat_reads_ppid_pgrp_all_four_times_and_the_process_own_past_a_name_with_spaces_and_parens() -> None:
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime cstime ...
    text = "42 (python (x) y) S 7 40 40 0 -1 4194304 10 0 0 0 150 30 5 2 20 0 1 0 100 0 0"
    assert parse_stat(text) == ProcStat(ppid=7, pgrp=40, ticks=150 + 30 + 5 + 2, own=150 + 30)


def test_parse_box_counts_busy_against_all_ticks_the_steal_and_the_cores() -> None:
    text = ("cpu  100 10 50 800 20 5 5 7 0 0\n"
            "cpu0 50 5 25 400 10 2 3 3 0 0\ncpu1 50 5 25 400 10 3 2 4 0 0\nintr 1\n")
    box = parse_box(text)
    assert box.busy == 100 + 10 + 50 + 5 + 5           # user nice system irq softirq
    assert box.all == box.busy + 800 + 20 + 7           # + idle iowait steal
    assert box.steal == 7
    assert box.cores == 2


def test_steal_share_is_the_hypervisor_s_share_of_the_ticks_between_two_reads() -> None:
    before = BoxTicks(busy=100, all=1000, steal=10, cores=2)
    assert steal_share(before, BoxTicks(busy=400, all=1400, steal=30, cores=2)) == 20 / 400
    assert steal_share(before, before) == 0.0          # no tick between the reads: no share, no division by 0


def test_group_ticks_sums_the_own_time_of_the_group_s_processes_alone() -> None:
    # 10 leads group 10 (its reaped children's 50 ticks are not the group's), 11 is in it, 12 is its child
    # in a group of its own, 20 is someone else's.
    table = {10: ProcStat(1, 10, ticks=150, own=100), 11: ProcStat(10, 10, ticks=7, own=7),
             12: ProcStat(10, 12, ticks=40, own=40), 20: ProcStat(1, 20, ticks=99, own=99)}
    assert group_ticks(10, table) == 100 + 7
    assert group_ticks(99, table) == 0


def test_charge_gives_each_pid_to_its_nearest_named_ancestor() -> None:
    # 1 init; 10 the bench, which started 20 (a gateway) and 30 (a kubectl, unnamed); 20 started 21;
    # 40 is someone else's.
    table = {pid: ProcStat(ppid, pgrp=1, ticks=ticks, own=ticks) for pid, ppid, ticks in
             ((1, 0, 1000), (10, 1, 5), (20, 10, 7), (21, 20, 3), (30, 10, 2), (40, 1, 99))}
    got = charge({"bench": [10], "gateways": [20], "etcd": []}, table)
    assert got == {"bench": 5 + 2, "gateways": 7 + 3, "etcd": 0}


def test_between_is_each_process_s_cpu_and_the_box_s_busy_share_of_its_cores() -> None:
    hz = os.sysconf("SC_CLK_TCK")
    before = CpuSample(10.0, {"operator": 0, "etcd": 0}, box_busy=0, box_all=0, cores=2)
    # 4 s of wall on 2 cores; the box busy 3/4 of its ticks; the operator 1 s, etcd 2 s of CPU.
    after = CpuSample(14.0, {"operator": hz, "etcd": 2 * hz}, box_busy=300, box_all=400, cores=2)
    share = between(before, after)
    assert share.wall_s == 4.0
    assert share.cpu_s == {"operator": 1.0, "etcd": 2.0}
    assert share.box_busy_s == 6.0 and share.box_load == 0.75
    assert share.rest_s == 3.0


# A process that spends its own CPU, says how much (getrusage: every thread, microseconds) and waits,
# spending none, until its stdin closes; it leads a process group of its own.
_BURNER = """
import resource, sys, time
t = time.process_time()
while time.process_time() - t < float(sys.argv[1]):
    pass
r = resource.getrusage(resource.RUSAGE_SELF)
print(r.ru_utime + r.ru_stime, flush=True)
sys.stdin.read()
"""


def test_the_readers_agree_with_the_process_s_own_count_and_the_box_s_ticks_grow() -> None:
    hz = os.sysconf("SC_CLK_TCK")
    box0 = read_box()
    proc = subprocess.Popen([sys.executable, "-c", _BURNER, "0.3"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        own = float(proc.stdout.readline())
        assert own >= 0.3
        # /proc counts utime and stime in whole ticks each (getrusage in microseconds): within two ticks.
        assert abs(process_cpu_s(proc.pid) - own) <= 2 / hz + 1e-6
        assert group_cpu_s(proc.pid) == process_cpu_s(proc.pid)        # alone in its group
        assert group_cpu_s(os.getpgrp()) > 0 and group_cpu_s(proc.pid) != group_cpu_s(os.getpgrp())
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait()
    box1 = read_box()
    assert box1.cores >= 1 and box1.busy - box0.busy >= 0.3 * hz - box1.cores  # at least the burner's ticks
    assert box1.all - box0.all >= box1.busy - box0.busy
    assert 0.0 <= steal_share(box0, box1) <= 1.0


def _cpu(wall: float, operator: float, host: float, busy: float) -> dict[str, Any]:
    cpu = {"operator": operator, "gateways": 0.5, "replica host": host, "kube-apiserver": 1.0, "etcd": 0.2,
           "kube-controller-manager": 0.0, "bench": 0.3}
    return {"wall_s": wall, "cpu_s": cpu, "rest_s": busy - sum(cpu.values()), "box_busy_s": busy, "cores": 2,
            "box_load": busy / (2 * wall)}


def _result(n: int, keep_wall: float, operator: float) -> dict[str, Any]:
    return {"n": n, "g": 2, "pick_us": 5.0, "load1": 1.0,
            "keep": {"push_s": keep_wall, "cpu": _cpu(keep_wall, operator, n / 16, 2 * keep_wall * 0.95)},
            "drain": {"push_s": 2 * keep_wall, "cpu": _cpu(2 * keep_wall, operator, n / 8, 2 * keep_wall)},
            "keep_replacing": {"replacement": {"ready_s": 3.0, "cpu": _cpu(3.0, 0.2, 1.0, 2.0)}}}


def test_cpu_rows_and_table_cover_every_timed_phase_of_every_size() -> None:
    results = [_result(16, 2.0, 0.4), _result(64, 6.0, 1.6)]
    rows = cpu_rows(results)
    assert [(x["n"], x["phase"]) for x in rows] == [
        (16, "Keep"), (16, "Drain"), (16, "replacement in a rollout"),
        (64, "Keep"), (64, "Drain"), (64, "replacement in a rollout")]
    table = cpu_table(rows).splitlines()
    assert len(table) == 2 + len(rows)
    keep64 = next(line for line in table if line.startswith("| 64 | 2 | Keep |"))
    assert "| 95% |" in keep64                       # the box busy 95% of its cores
    assert "| 25.0 |" in keep64                      # the operator: 1.6 s over 64 replicas


def test_reading_charges_the_growth_per_replica_and_says_whether_the_box_was_the_limit() -> None:
    results = [_result(16, 2.0, 0.4), _result(64, 6.0, 1.6)]
    text = reading([row(r) for r in results], cpu_rows(results))
    # 4 s more wall over 48 more replicas: 83 ms each; the operator's 1.2 s more CPU: 25 ms each.
    assert "Keep at G=2, N=16 -> 64: the wall time grew 83 ms per replica added" in text
    assert "operator 25" in text
    assert "Keep at N=64, G=2: 6.00 s of wall time, the box busy 95% of its 2 cores (CPU-bound on the box" in text
    # 11.4 s busy, 7.6 s of it the benchmark's processes: the rest (33%) was other work on the box.
    assert "CPU-bound on the box; 33% of the box's busy time was none of this benchmark's processes" in text
    assert "the operator, one Python process, still spends 1.60 s of CPU" in text
    # A phase with idle CPU on the box is said to be waiting, not CPU-bound.
    results[1]["keep"]["cpu"] = _cpu(6.0, 1.6, 4.0, 6.0)
    assert "not CPU-bound" in reading([row(r) for r in results], cpu_rows(results))


def test_the_section_carries_the_cpu_table_and_its_reading() -> None:
    results = [_result(16, 2.0, 0.4), _result(64, 6.0, 1.6)]
    text = body(results, 60, 8)
    assert "| N | G | phase | wall s | operator CPU-s |" in text
    assert "the wall time grew" in text


def test_a_missed_target_says_what_the_box_and_the_operator_did_meanwhile() -> None:
    from bench.scale_report import targets

    results = [_result(16, 2.0, 0.4), _result(64, 7.0, 1.6)]   # 7 s > 3 x 2 s
    keep = next(line for line in targets([row(r) for r in results]) if line.startswith("- Keep push"))
    assert "**not met** (2.00 s -> 7.00 s; at N=64 G=2 the box was busy 95% of its cores, the operator's own " \
           "CPU 1.60 s" in keep
    results[1] = _result(64, 5.0, 1.6)
    keep = next(line for line in targets([row(r) for r in results]) if line.startswith("- Keep push"))
    assert keep.endswith("**met** (2.00 s -> 5.00 s)")
