"""bench/scale.py's section of docs/benchmarks.md: the table, each target of issue #53 against what the
run measured, and one picture per control loop against N (a line per G). Plain numbers in, text and
PNGs out: the figures are redrawn only by running the benchmark."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from bench.plots import DOCS, _plt

PICTURES = {
    "api": "API requests per minute at steady state",
    "health": "/health reads per second per replica at steady state",
    "resources": "CPU and RSS at steady state",
    "rollouts": "push -> Complete",
    "switch": "the routing switch",
    "replacement": "a replacement: uncertain_weights -> Ready",
    "adapters": "an adapter push -> servable, 64 runs declared",
    "pick": "a pick in the gateway",
}


def path(loop: str) -> Any:
    return DOCS / f"bench-scale-{loop}.png"


def _get(r: Any, *keys: str) -> Any:
    """r[k1][k2]...: None where a key is missing. A step may be an object (a Replacement) as well as
    a dict (the same figures read back from --json)."""
    for k in keys:
        r = r.get(k) if isinstance(r, dict) else getattr(r, k, None)
        if r is None:
            return None
    return r


def _total(d: dict[str, float] | None, where: Callable[[str], bool] = lambda k: True) -> float | None:
    return None if d is None else round(sum(v for k, v in d.items() if where(k)), 1)


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _replacement(r: dict[str, Any], key: str) -> float | None:
    ready: float | None = _get(r, *key.split("."), "ready_s")
    return ready


def row(r: dict[str, Any]) -> dict[str, Any]:
    """One size's figures, flat (what the table and the pictures read)."""
    st = r.get("steady") or {}
    keep, drain = r.get("keep") or {}, r.get("drain") or {}
    batches = math.ceil(r["n"] / max(1, r["n"] // 10))
    return {
        "n": r["n"], "g": r["g"],
        "op_api": _total(st.get("operator")), "gw_api": _total(st.get("gateways")),
        "op_writes": _total(st.get("operator_writes")), "gw_writes": _total(st.get("gateway_writes")),
        "gw_lease_writes": _total(st.get("gateway_writes"), lambda k: k.endswith(" leases")),
        "health_gw": _get(st, "health", "gateways", "mean"), "health_op": _get(st, "health", "operator", "mean"),
        "op_cpu": st.get("operator_cpu_pct"), "gw_cpu": st.get("gateway_cpu_pct"),
        "op_rss": st.get("operator_rss_mb"), "gw_rss": st.get("gateway_rss_mb"),
        "keep_s": keep.get("push_s"), "keep_dip": keep.get("dip_s"), "keep_loads": keep.get("loads_s"),
        "drain_s": drain.get("push_s"), "drain_dip": drain.get("dip_s"), "drain_loads": drain.get("loads_s"),
        "drain_loading": drain.get("loading_s"), "keep_loading": keep.get("loading_s"),
        "keep_tail": keep.get("tail_s"), "drain_tail": drain.get("tail_s"),
        "drain_batches": batches,
        "fence_s": keep.get("fence_s"), "open_s": keep.get("open_s"), "acks_s": keep.get("acks_s"),
        "drain_fence_s": drain.get("fence_s"),
        "replace_s": _replacement(r, "replacement"), "replace_rollout_s": _replacement(r, "keep_replacing.replacement"),
        "adapter_s": _get(r, "adapters", "push_s"), "pick_us": r.get("pick_us"), "error": r.get("error"),
        "load1": r.get("load1"), "keep_gw_cpu": _get(keep, "cpu", "cpu_s", "gateways"),
        "keep_box_load": _get(keep, "cpu", "box_load"), "keep_op_cpu": _get(keep, "cpu", "cpu_s", "operator"),
        "drain_box_load": _get(drain, "cpu", "box_load"), "drain_op_cpu": _get(drain, "cpu", "cpu_s", "operator"),
        "replace_box_load": _get(r, "replacement", "cpu", "box_load"),
        "replace_rollout_box_load": _get(r, "keep_replacing", "replacement", "cpu", "box_load"),
        "replace_rollout_op_cpu": _get(r, "keep_replacing", "replacement", "cpu", "cpu_s", "operator"),
    }


COLUMNS = [("N", "n", 0), ("G", "g", 0), ("operator API/min", "op_api", 1), ("gateways API/min", "gw_api", 1),
           ("operator writes/min", "op_writes", 1), ("gateways writes/min", "gw_writes", 1),
           ("/health reads/s/replica: gateways", "health_gw", 2), ("operator", "health_op", 2),
           ("CPU % operator / gateway", None, 0), ("RSS MB operator / gateway", None, 0),
           ("Keep push -> Complete s", "keep_s", 2), ("Keep dip s", "keep_dip", 2),
           ("Drain (10%) push -> Complete s", "drain_s", 2), ("fence s", "fence_s", 2), ("open s", "open_s", 2),
           ("replacement s (idle / in a rollout)", None, 0), ("adapter push s", "adapter_s", 2),
           ("pick us", "pick_us", 1)]


def table(rows: list[dict[str, Any]]) -> str:
    head = "| " + " | ".join(c for c, _, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * len(COLUMNS)]
    for x in rows:
        cells = []
        for title, key, digits in COLUMNS:
            if title.startswith("CPU"):
                cells.append(f"{_fmt(x['op_cpu'], 1)} / {_fmt(x['gw_cpu'], 1)}")
            elif title.startswith("RSS"):
                cells.append(f"{_fmt(x['op_rss'])} / {_fmt(x['gw_rss'])}")
            elif title.startswith("replacement"):
                cells.append(f"{_fmt(x['replace_s'])} / {_fmt(x['replace_rollout_s'])}")
            else:
                cells.append(_fmt(x[key], digits) if digits else _fmt(x[key]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _at(rows: list[dict[str, Any]], n: int, g: int, key: str) -> Any:
    return next((x[key] for x in rows if x["n"] == n and x["g"] == g), None)


def targets(rows: list[dict[str, Any]]) -> list[str]:
    """Each target of issue #53 against the run: met, not met (with the figures), or not measured."""
    ns, gs = sorted({x["n"] for x in rows}), sorted({x["g"] for x in rows})
    lo, hi, g_lo, g_hi = ns[0], ns[-1], gs[0], gs[-1]
    out = []

    def say(what: str, ok: bool | None, detail: str, why: str = "") -> None:
        """`why`: what the run measured beside a missed target (the box's load, the operator's own CPU)."""
        because = f"; {why}" if why and ok is False else ""
        out.append(f"- {what}: **{'met' if ok else 'not met' if ok is not None else 'not measured'}** "
                   f"({detail}{because})")

    def box(n: int, g: int, load: str, op: str | None = None) -> str:
        """The box's load (and the operator's own CPU) over one phase at one size, for `say`'s why."""
        busy = _at(rows, n, g, load)
        if busy is None:
            return ""
        cpu = None if op is None else _at(rows, n, g, op)
        mine = "" if cpu is None else f", the operator's own CPU {cpu:.2f} s"
        return f"at N={n} G={g} the box was busy {_pct(busy)} of its cores{mine}: see the CPU table below"

    ow = [x["op_writes"] for x in rows if x["op_writes"] is not None]
    gw_other = [round((x["gw_writes"] or 0) - (x["gw_lease_writes"] or 0), 1) for x in rows
                if x["gw_writes"] is not None]
    say("the operator writes nothing at steady state", all(v == 0 for v in ow) if ow else None,
        f"writes/min per size: {ow}")
    say("the gateways write nothing at steady state but their Lease renewals", all(v == 0 for v in gw_other)
        if gw_other else None, f"other writes/min per size: {gw_other}; Lease renewals/min: "
        f"{[x['gw_lease_writes'] for x in rows]}")
    for g in gs:
        h = [_at(rows, n, g, "health_gw") for n in ns]
        say(f"/health reads per replica flat in G (G={g})", None if None in h else max(h) <= 1.5 * 2.0,
            f"gateways' reads/s per replica at N={ns}: {h}; one reader per interval is 2.0")
    for key, name, factor in (("keep_s", "Keep push -> Complete at N={hi} <= 3 x at N={lo}", 3.0),):
        for g in gs:
            a, b = _at(rows, lo, g, key), _at(rows, hi, g, key)
            say(name.format(hi=hi, lo=lo) + f" (G={g})", None if a is None or b is None else b <= factor * a,
                f"{_fmt(a)} s -> {_fmt(b)} s", box(hi, g, "keep_box_load", "keep_op_cpu"))
    for g in gs:
        per = [(n, _at(rows, n, g, "drain_s"), _at(rows, n, g, "drain_loading"), _at(rows, n, g, "drain_batches"))
               for n in ns]
        over = [None if s is None or loads is None else round((s - loads) / b, 3) for n, s, loads, b in per]
        say(f"Drain: no more than 0.1 s of overhead per batch (G={g})",
            None if None in over else max(o for o in over if o is not None) <= 0.1,
            f"(push -> Complete - the time some load ran) / batches at N={ns}: {over} s",
            box(hi, g, "drain_box_load", "drain_op_cpu"))
    for key in ("fence_s", "open_s"):
        for n in ns:
            a, b = _at(rows, n, g_lo, key), _at(rows, n, g_hi, key)
            say(f"{key[:-2]} at G={g_hi} <= 1.5 x at G={g_lo} (N={n})",
                None if a is None or b is None or g_lo == g_hi else b <= 1.5 * a, f"{_fmt(a, 3)} -> {_fmt(b, 3)} s",
                f"over those Keep pushes the box was busy {_pct(_at(rows, n, g_lo, 'keep_box_load'))} -> "
                f"{_pct(_at(rows, n, g_hi, 'keep_box_load'))} of its cores and the gateways took "
                f"{_fmt(_at(rows, n, g_lo, 'keep_gw_cpu'))} -> {_fmt(_at(rows, n, g_hi, 'keep_gw_cpu'))} CPU-s")
    for g in gs:
        for key, what in (("replace_s", "idle"), ("replace_rollout_s", "in a rollout")):
            a, b = _at(rows, lo, g, key), _at(rows, hi, g, key)
            load = "replace_box_load" if key == "replace_s" else "replace_rollout_box_load"
            say(f"a replacement ({what}) at N={hi} within 2 x at N={lo} (G={g})",
                None if a is None or b is None else b <= 2 * a, f"{_fmt(a)} -> {_fmt(b)} s", box(hi, g, load))
    at_hi = [x for x in rows if x["n"] == hi]
    say(f"operator RSS <= 300 MB at N={hi}", all((x["op_rss"] or 1e9) <= 300 for x in at_hi) if at_hi else None,
        f"{[x['op_rss'] for x in at_hi]} MB")
    say(f"each gateway's RSS <= 200 MB at N={hi}", all((x["gw_rss"] or 1e9) <= 200 for x in at_hi) if at_hi else None,
        f"{[x['gw_rss'] for x in at_hi]} MB")
    say(f"a pick <= 50 us at N={hi}", all((x["pick_us"] or 1e9) <= 50 for x in at_hi) if at_hi else None,
        f"{[x['pick_us'] for x in at_hi]} us")
    return out


# The box's processes a phase's CPU is charged to (ScalePool.processes, tests/support/cpu_share.py),
# in the CPU table's order, with their column titles.
PROCESSES = (("operator", "operator"), ("gateways", "gateways (sum)"), ("replica host", "replica host"),
             ("kube-apiserver", "apiserver"), ("etcd", "etcd"), ("kube-controller-manager", "kcm"),
             ("bench", "bench (proxies, clients)"))
# What stays on the control plane of a cluster where the replicas and the gateways have CPUs of their own.
CONTROL_PLANE = ("operator", "kube-apiserver", "etcd", "kube-controller-manager")
PHASES = (("Keep", ("keep",)), ("Drain", ("drain",)), ("replacement in a rollout", ("keep_replacing", "replacement")))
WRITES = ("create", "update", "patch", "delete", "deletecollection")  # tests/support/api_counts.WRITE_VERBS
# A phase whose box was busy this share of its cores or more ran as fast as the box let it.
CPU_BOUND = 0.85


def cpu_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per size and timed phase: its wall time and where the box's CPU went (CpuShare.figures)."""
    out = []
    for r in results:
        for phase, keys in PHASES:
            c = _get(r, *keys, "cpu")
            if c is None:
                continue
            cpu = c["cpu_s"]
            api = _get(r, *keys, "operator_api")
            writes = None if api is None else sum(k for what, k in api.items() if what.split(" ")[0] in WRITES)
            out.append({"n": r["n"], "g": r["g"], "phase": phase, "wall_s": c["wall_s"], "cpu": cpu, "writes": writes,
                        "rest_s": c["rest_s"], "box_busy_s": c["box_busy_s"], "cores": c["cores"],
                        "box_load": c["box_load"], "control_s": sum(cpu.get(k, 0.0) for k in CONTROL_PLANE)})
    return out


def cpu_table(rows: list[dict[str, Any]]) -> str:
    head = ["N", "G", "phase", "wall s", *(f"{t} CPU-s" for _, t in PROCESSES), "rest of the box CPU-s",
            "box busy / (cores x wall)", "operator ms / replica", "control plane ms / replica",
            "operator writes / replica"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for x in rows:
        cells = [str(x["n"]), str(x["g"]), x["phase"], _fmt(x["wall_s"]),
                 *(_fmt(x["cpu"].get(k)) for k, _ in PROCESSES), _fmt(x["rest_s"]), f"{100 * x['box_load']:.0f}%",
                 f"{1000 * x['cpu'].get('operator', 0.0) / x['n']:.1f}", f"{1000 * x['control_s'] / x['n']:.1f}",
                 "-" if x["writes"] is None else f"{x['writes'] / x['n']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cpu_at(rows: list[dict[str, Any]], n: int, g: int, phase: str) -> dict[str, Any] | None:
    return next((x for x in rows if x["n"] == n and x["g"] == g and x["phase"] == phase), None)


def _per_replica(rows: list[dict[str, Any]], phase: str, g: int, lo: int, hi: int) -> str | None:
    """How one phase grew from N=lo to N=hi, per replica added: its wall time against the box's CPU
    (each process's share), the box's over its cores. None when either size lacks the phase."""
    a, b = _cpu_at(rows, lo, g, phase), _cpu_at(rows, hi, g, phase)
    if a is None or b is None or hi == lo:
        return None
    per = 1000 / (hi - lo)
    wall = (b["wall_s"] - a["wall_s"]) * per
    box = (b["box_busy_s"] - a["box_busy_s"]) * per
    parts = ", ".join(f"{title} {(b['cpu'].get(k, 0.0) - a['cpu'].get(k, 0.0)) * per:.0f}" for k, title in PROCESSES)
    return (f"{phase} at G={g}, N={lo} -> {hi}: the wall time grew {wall:.0f} ms per replica added; the box's busy "
            f"CPU {box:.0f} ms per replica ({parts}, the rest of the box "
            f"{(b['rest_s'] - a['rest_s']) * per:.0f}), that is {box / b['cores']:.0f} ms of its {b['cores']} cores "
            f"per replica; the box was busy {100 * b['box_load']:.0f}% of its cores through the phase at N={hi}")


def reading(rows: list[dict[str, Any]], cpu: list[dict[str, Any]]) -> str:
    """What the run shows about each target it misses, from its own figures: per phase, how much of the
    box's CPU was the operator's and how much everyone else's, and what a cluster would keep of it."""
    if not rows:
        return ""
    ns, gs = sorted({x["n"] for x in rows}), sorted({x["g"] for x in rows})
    lo, hi = ns[0], ns[-1]
    out = []
    for phase in ("Keep", "Drain"):
        for g in gs:
            line = _per_replica(cpu, phase, g, lo, hi)
            if line is not None:
                out.append(f"- {line}.")
    for g in gs:
        for phase in ("Keep", "Drain", "replacement in a rollout"):
            x = _cpu_at(cpu, hi, g, phase)
            if x is None:
                continue
            op = x["cpu"].get("operator", 0.0)
            per = f"{1000 * op / hi:.1f} ms per replica, " if phase in ("Keep", "Drain") else ""
            bound = ("CPU-bound on the box" if x["box_load"] >= CPU_BOUND
                     else "not CPU-bound: the box had idle CPU, so part of the time was waiting")
            if x["box_busy_s"] > 0 and x["rest_s"] > 0.2 * x["box_busy_s"]:
                bound += (f"; {100 * x['rest_s'] / x['box_busy_s']:.0f}% of the box's busy time was none of this "
                          f"benchmark's processes: other work on the box")
            out.append(
                f"- {phase} at N={hi}, G={g}: {_fmt(x['wall_s'])} s of wall time, the box busy "
                f"{100 * x['box_load']:.0f}% of its {x['cores']} cores ({bound}). The operator's own CPU: "
                f"{op:.2f} s ({per}{100 * op / x['wall_s']:.0f}% of one core); the "
                f"control plane's (operator, API server, etcd, controller-manager): {x['control_s']:.2f} s; the "
                f"replicas' host, the gateways and the bench's proxies and clients, which a cluster runs on CPUs of "
                f"their own: {sum(x['cpu'].get(k, 0.0) for k in ('replica host', 'gateways', 'bench')):.2f} s. "
                f"On such a cluster the operator, one Python process, still spends {op:.2f} s of CPU on this phase: "
                f"a floor for it at this size, {op / x['wall_s']:.2f} of the wall time measured here."
                + _trace_note(rows, hi, g, phase))
    out += _keep_target_lines(rows, cpu)
    out += _switch_lines(rows)
    out += _replacement_lines(rows)
    return "\n".join(out)


def _keep_target_lines(rows: list[dict[str, Any]], cpu: list[dict[str, Any]]) -> list[str]:
    """The Keep target (N=hi within 3 x N=lo) against the operator's own CPU at N=hi: what no cluster
    takes off the operator, one Python process, however many CPUs its replicas and gateways get."""
    ns = sorted({x["n"] for x in rows})
    lo, hi = ns[0], ns[-1]
    out = []
    for g in sorted({x["g"] for x in rows}):
        base, x = _at(rows, lo, g, "keep_s"), _cpu_at(cpu, hi, g, "Keep")
        if base is None or x is None or hi == lo:
            continue
        allowed, op = 3 * base, x["cpu"].get("operator", 0.0)
        moved = sum(x["cpu"].get(k, 0.0) for k in ("replica host", "gateways", "bench"))
        verdict = ("within it: on such a cluster the operator's own work leaves room for the target"
                   if op <= allowed else
                   "beyond it: the operator's work per replica has to shrink for the target to be met "
                   "anywhere, not only the box grow")
        out.append(
            f"- Keep's target at G={g}: 3 x the N={lo} push is {allowed:.2f} s. At N={hi} the operator's own CPU "
            f"in the push was {op:.2f} s ({1000 * op / hi:.1f} ms per replica), the API server's and etcd's "
            f"{x['cpu'].get('kube-apiserver', 0.0) + x['cpu'].get('etcd', 0.0):.2f} s (several cores on a real "
            f"control plane), and what a cluster runs elsewhere (the replicas, the gateways, this bench) "
            f"{moved:.2f} s. The operator's {op:.2f} s is {verdict}.")
    return out


def _trace_note(rows: list[dict[str, Any]], n: int, g: int, phase: str) -> str:
    """From the rollout trace, where a push's time went besides the loads (Keep and Drain only)."""
    key = {"Keep": "keep", "Drain": "drain"}.get(phase)
    x = next((r for r in rows if r["n"] == n and r["g"] == g), None)
    if key is None or x is None or x[f"{key}_loads"] is None:
        return ""
    tail = x[f"{key}_tail"]
    return (f" The rollout trace: from the first load sent to the last answered {_fmt(x[f'{key}_loads'])} s "
            f"(some load running {_fmt(x[f'{key}_loading'])} s of it); from the last replica's status write to "
            f"Complete {_fmt(tail)} s (its watch event through kopf to the pool's loop, and the pool's status write).")


def _switch_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The fence and the opening from G_lo to G_hi gateways at each N, beside what the gateways' CPU
    and the box did during that Keep push: each gateway takes every replica's events of a rollout."""
    gs = sorted({x["g"] for x in rows})
    if len(gs) < 2:
        return []
    out = []
    for n in sorted({x["n"] for x in rows}):
        a, b = (next((x for x in rows if x["n"] == n and x["g"] == g), None) for g in (gs[0], gs[-1]))
        if a is None or b is None or a["fence_s"] is None or b["fence_s"] is None:
            continue
        out.append(
            f"- The routing switch at N={n}: fence {_fmt(a['fence_s'], 3)} s at G={gs[0]}, {_fmt(b['fence_s'], 3)} s "
            f"at G={gs[-1]} (opening {_fmt(a['open_s'], 3)} -> {_fmt(b['open_s'], 3)} s). During those Keep pushes "
            f"the gateways took {_fmt(a['keep_gw_cpu'])} -> {_fmt(b['keep_gw_cpu'])} CPU-s together, the box was "
            f"busy {_pct(a['keep_box_load'])} -> {_pct(b['keep_box_load'])} of its cores, and its 1-minute load "
            f"average at the size's start was {_fmt(a['load1'])} -> {_fmt(b['load1'])}. Each gateway watches every "
            f"replica (sampler_gateway/discovery/kube.py): a rollout's replica writes reach all G of them, and "
            f"each acknowledges the fence with a Lease write of its own.")
    return out


def _replacement_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Each size's replacement idle against during a rollout, with the box's load over each."""
    out = []
    for x in rows:
        if x["replace_s"] is None or x["replace_rollout_s"] is None:
            continue
        out.append(
            f"- A replacement at N={x['n']}, G={x['g']}: {_fmt(x['replace_s'])} s idle (the box busy "
            f"{_pct(x['replace_box_load'])}), {_fmt(x['replace_rollout_s'])} s during a Keep rollout (busy "
            f"{_pct(x['replace_rollout_box_load'])}, the operator {_fmt(x['replace_rollout_op_cpu'])} CPU-s of it).")
    return out


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"


def body(results: list[dict[str, Any]], steady_s: float, clients: int) -> str:
    rows = [row(r) for r in results]
    errors = [f"- N={x['n']} G={x['g']}: {x['error']}" for x in rows if x["error"]]
    pics = "\n\n".join(f"![{title}](bench-scale-{loop}.png)" for loop, title in PICTURES.items())
    loads = ", ".join(f"N={r['n']} G={r['g']}: {r.get('load1', 0):.2f}" for r in results)
    return f"""Each size (N replicas, G gateways) on its own fresh API server:

{table(rows)}

Method: envtest (a real etcd, kube-apiserver v1.20 and kube-controller-manager on 127.0.0.1), the operator
process, a SamplerPool of N replicas whose pods are the real sampler app on the fake engine, all N in
one process (`tests/support/replica_host.py`), and G gateway processes with kube discovery and their
own routing Leases (`tests/support/scale_pool.py`). The operator and the gateways reach the API server
through a counting proxy each (`tests/support/api_counts.py`), so "API/min" is each side's own. Steady
state: {steady_s:.0f} s with nothing changing and no client, after the pool settled (each replica's
declared load recorded, every Lease acknowledging the routing). `/health` reads are counted at the
replicas, by who read. Rollouts: pushed through a gateway as a trainer does
(`Pool.push(wait=True)`, push -> Complete), Keep then Drain with maxUnavailable N // 10, under {clients}
closed-loop clients spread over the gateways (16-token samples); the dip is the last answer on the old
label to the first on the new, the fence Fence(Y) written -> Open(Y) written and the opening Fence(Y)
written -> the last gateway enforcing Open(Y), from the rollout trace. A replacement: a replica's pod made to
report `uncertain_weights`, timed to the replica Ready on its new pod, once while a third (Keep) rollout
ran and once idle. An adapter push: 3 pushes with 64 runs declared (median). A pick: `Pool.choose` over N
ready replicas in one process. The 1-minute load average at each size's start: {loads}. 2 cores, shared by
the API server, etcd, the operator, every gateway and every replica.

The targets of issue #53:

{chr(10).join(targets(rows))}

{chr(10).join(errors)}

Where the CPU went in each timed phase (the push -> Complete of the Keep and the Drain rollouts, and the
replacement's uncertain_weights -> Ready during the third rollout), per process (`tests/support/cpu_share.py`:
utime + stime from `/proc/<pid>/stat`, a process's children included; the gateways summed; the bench is this
process: the counting proxies every API request of the operator and the gateways crosses, the clients and the
trainer). The rest of the box is its busy time (`/proc/stat`) that none of these accounts for: the kernel, and
any other work sharing the box. A phase whose box was busy about all of its cores' time ran as fast as the box
let it, whoever's CPU that was:

{cpu_table(cpu_rows(results))}

{reading(rows, cpu_rows(results))}

{pics}
"""


def _series(rows: list[dict[str, Any]], key: str) -> dict[int, tuple[list[int], list[float]]]:
    out: dict[int, tuple[list[int], list[float]]] = {}
    for g in sorted({x["g"] for x in rows}):
        pts = sorted((x["n"], x[key]) for x in rows if x["g"] == g and x[key] is not None)
        out[g] = ([p[0] for p in pts], [p[1] for p in pts])
    return out


def _panel(ax: Any, rows: list[dict[str, Any]], lines: list[tuple[str, str]], ylabel: str) -> None:
    import matplotlib.ticker

    for key, name in lines:
        for g, (xs, ys) in _series(rows, key).items():
            if xs:
                ax.plot(xs, ys, marker="o", label=f"{name}, G={g}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({x["n"] for x in rows}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("replicas (N)")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


PANELS: dict[str, list[tuple[list[tuple[str, str]], str]]] = {
    "api": [([("op_api", "operator"), ("gw_api", "gateways")], "requests / min"),
            ([("op_writes", "operator"), ("gw_writes", "gateways")], "writes / min")],
    "health": [([("health_gw", "gateways"), ("health_op", "operator")], "reads / s / replica")],
    "resources": [([("op_cpu", "operator"), ("gw_cpu", "a gateway")], "CPU, % of one core"),
                  ([("op_rss", "operator"), ("gw_rss", "a gateway")], "RSS, MB")],
    "rollouts": [([("keep_s", "Keep"), ("keep_loading", "Keep: some load running")], "s"),
                 ([("drain_s", "Drain 10%"), ("drain_loading", "Drain: some load running")], "s")],
    "switch": [([("fence_s", "fence (Keep)"), ("drain_fence_s", "fence (Drain)"), ("acks_s", "acks (Keep)")], "s"),
               ([("open_s", "opening (Keep)"), ("keep_dip", "dip (Keep)"), ("drain_dip", "dip (Drain)")], "s")],
    "replacement": [([("replace_s", "idle"), ("replace_rollout_s", "during a Keep rollout")], "s")],
    "adapters": [([("adapter_s", "push -> servable")], "s")],
    "pick": [([("pick_us", "Pool.choose")], "us")],
}


def draw(results: list[dict[str, Any]]) -> None:
    rows = [row(r) for r in results]
    plt = _plt()
    for loop, panels in PANELS.items():
        fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), dpi=110, squeeze=False)
        for ax, (lines, ylabel) in zip(axes[0], panels, strict=True):
            _panel(ax, rows, lines, ylabel)
        fig.suptitle(PICTURES[loop], fontsize=10)
        fig.tight_layout()
        fig.savefig(path(loop))
        plt.close(fig)
