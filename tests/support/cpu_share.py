"""Where the box's CPU went over a stretch of time: each named process's CPU-seconds and the whole
box's busy seconds, from /proc.

bench/scale.py runs every part of a cluster on one box (the API server, etcd, the controller-manager,
the operator, every gateway, every replica in one host process): a phase that grows with N may be the
operator's own work growing or the box running out of cores under everyone's (issue #53). So each
phase is charged to its processes: a named process is charged its own time, its reaped children's
(`cutime + cstime`) and the time of its live descendants that are not themselves named (each pid to
its nearest named ancestor). What no named process owns, the box's busy time less theirs, is the rest
of the box: its kernel, and any other work sharing it.

The other benches read the same figures through this module too, so /proc is parsed in one place:
`process_cpu_s` (one process's own time: a server under load), `group_cpu_s` (a process group's live
processes: a replica's server and engine core) and `read_box` (the box's ticks, its hypervisor steal
among them).

The parsing and the charging are pure; `sample` and the `read_*` / `*_cpu_s` functions alone read /proc.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# Fields of /proc/<pid>/stat after the command's closing parenthesis: 0 state, 1 ppid, 2 pgrp, ...
# 11 utime, 12 stime, 13 cutime, 14 cstime (proc(5), counted from 0 after the name).
_PPID, _PGRP, _UTIME, _STIME, _CSTIME = 1, 2, 11, 12, 14


@dataclass(frozen=True)
class ProcStat:
    ppid: int
    pgrp: int
    ticks: int   # utime + stime + cutime + cstime
    own: int     # utime + stime: the process alone, without its reaped children


def parse_stat(text: str) -> ProcStat:
    """One /proc/<pid>/stat (pure). The command may hold spaces and parentheses: split after the last ')'."""
    fields = text.rsplit(")", 1)[1].split()
    return ProcStat(int(fields[_PPID]), int(fields[_PGRP]), sum(int(f) for f in fields[_UTIME:_CSTIME + 1]),
                    sum(int(f) for f in fields[_UTIME:_STIME + 1]))


@dataclass(frozen=True)
class BoxTicks:
    """The whole box's clock ticks so far, summed over its cores."""

    busy: int    # user, nice, system, irq and softirq (guest time is inside user and nice)
    all: int     # busy + idle + iowait + steal
    steal: int   # what the hypervisor gave to other guests: a slow host, not our work
    cores: int


def parse_box(proc_stat: str) -> BoxTicks:
    """The box's ticks from /proc/stat (pure)."""
    lines = proc_stat.splitlines()
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in lines[0].split()[1:9])
    busy = user + nice + system + irq + softirq
    cores = sum(1 for ln in lines if ln.startswith("cpu") and ln[3:4].isdigit())
    return BoxTicks(busy, busy + idle + iowait + steal, steal, cores)


def steal_share(before: BoxTicks, after: BoxTicks) -> float:
    """The share of the box's ticks from one read to the next that the hypervisor took (pure)."""
    return (after.steal - before.steal) / max(after.all - before.all, 1)


def group_ticks(pgid: int, table: Mapping[int, ProcStat]) -> int:
    """utime + stime of every process of `table` in process group `pgid` (pure): the live members' own
    time (a member that exits between two reads takes its time with it)."""
    return sum(st.own for st in table.values() if st.pgrp == pgid)


def charge(roots: Mapping[str, list[int]], table: Mapping[int, ProcStat]) -> dict[str, int]:
    """Ticks per name (pure): each pid of `table` to the name of its nearest ancestor (itself included)
    among `roots`; a pid under none is nobody's."""
    owner = {pid: name for name, pids in roots.items() for pid in pids}
    out = dict.fromkeys(roots, 0)
    for pid, st in table.items():
        seen, at = 0, pid
        while at not in owner and at in table and seen < 64:
            at, seen = table[at].ppid, seen + 1
        if at in owner:
            out[owner[at]] += st.ticks
    return out


def _table() -> dict[int, ProcStat]:
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                out[int(d.name)] = parse_stat((d / "stat").read_text())
            except (OSError, ValueError, IndexError):
                pass  # gone between the listing and the read
    return out


def read_box() -> BoxTicks:
    return parse_box(Path("/proc/stat").read_text())


def process_cpu_s(pid: int) -> float:
    """utime + stime of one process (every thread of it, not its children), in seconds."""
    return parse_stat(Path(f"/proc/{pid}/stat").read_text()).own / os.sysconf("SC_CLK_TCK")


def group_cpu_s(pgid: int) -> float:
    """utime + stime of every live process in process group `pgid`, in seconds."""
    return group_ticks(pgid, _table()) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class CpuSample:
    at: float                 # time.monotonic()
    ticks: dict[str, int]     # name -> its processes' ticks so far
    box_busy: int
    box_all: int
    cores: int


def sample(roots: Mapping[str, list[int]]) -> CpuSample:
    box = read_box()
    return CpuSample(time.monotonic(), charge(roots, _table()), box.busy, box.all, box.cores)


@dataclass(frozen=True)
class CpuShare:
    """One phase: its wall time and where the box's CPU went during it."""

    wall_s: float
    cpu_s: dict[str, float]   # name -> CPU-seconds of its processes in the phase
    box_busy_s: float         # the whole box: every process, ours or not, and its kernel
    cores: int

    @property
    def rest_s(self) -> float:
        """The box's busy time no named process accounts for (its kernel, other work sharing it)."""
        return max(0.0, self.box_busy_s - sum(self.cpu_s.values()))

    @property
    def box_load(self) -> float:
        """The box's busy share of its cores over the phase: 1.0 is every core busy all along."""
        return self.box_busy_s / (self.cores * self.wall_s) if self.wall_s > 0 else 0.0

    def figures(self) -> dict[str, object]:
        return {"wall_s": round(self.wall_s, 3), "cpu_s": {k: round(v, 2) for k, v in self.cpu_s.items()},
                "rest_s": round(self.rest_s, 2), "box_busy_s": round(self.box_busy_s, 2), "cores": self.cores,
                "box_load": round(self.box_load, 3)}


def between(before: CpuSample, after: CpuSample) -> CpuShare:
    """What happened from one sample to the next."""
    hz = os.sysconf("SC_CLK_TCK")
    # The box's busy seconds: its busy share of all ticks times its cores' wall time (the ticks of
    # /proc/stat are per core, so all ticks = cores x wall x hz, whatever hz the kernel counts in).
    wall = after.at - before.at
    busy_share = (after.box_busy - before.box_busy) / max(1, after.box_all - before.box_all)
    return CpuShare(wall, {k: (after.ticks[k] - before.ticks.get(k, 0)) / hz for k in after.ticks},
                    busy_share * after.cores * wall, after.cores)
