"""Which replica takes a request for one adapter version, and what it unloads to make room (pure;
docs/design/lora-pool.md, "Placement").

1. A **holder**: among the eligible replicas that hold the version (loaded, or being loaded for
   another request), the least loaded. The version's weights and its cached prefixes are there.
   Among several holders, the endpoint scorer's preferences come first (routing/score.py, the
   version's blocks being its own, keyed by its engine name): the holder a burst of this prompt went
   to while it has room, else the holder with most of the prompt's blocks unless it is hot against
   the least loaded holder (`hot`: the scorer's load gate).
2. Else a replica that **loads it on demand**: the least loaded one with room, a free slot first,
   else a slot whose least-recently-used version has no request in flight (it is unloaded first).
   Versions the pool no longer declares go before any declared one, whatever their last use; then
   versions of a run holding more than its share of the pool's slots (the slots over the runs
   that hold one or ask for one): a run that loaded versions on every replica while another run
   waits for a slot gives up its own least recently used first, so one run cannot keep the others
   to loading and unloading on every request.
   Between replicas equally loaded that must each unload, the one whose victims were used least
   recently: the pool's LRU version goes, not whichever replica the tie-break turn names (a
   version just used on one replica is not unloaded while an older one idles on another).
3. With `capacity` (the gateway's `--replica-capacity`), holders at it spill over to step 2, as an
   affinity key spills over in `picker.pick`: one hot version does not queue behind one replica
   while another has room. Everyone at capacity: the least loaded holder, else loader.
4. None of them: no placement. The caller waits (lora/router.py): for a replica, as any request
   without an eligible replica does; or, when every slot holds a version with requests in flight,
   for a slot, in its turn.

Two inputs let the caller take turns for slots (lora/router.py, "Waiting for a slot"):
- a version **closing** on a replica takes no new request there (it is neither a holder nor a
  version that replica may load again) and is the first victim once idle: the one version that the
  request whose turn it is waits for;
- `load=False` places only on a holder: a request that must not take a slot now (others wait for one
  before it) still runs where its version is loaded. A replica whose `loads` is False (the gateway's
  view of its slots was just proven wrong) is a holder only.

What holds whatever the inputs (tests/gateway/test_adapter_placement.py, property tests):
- a version with a request in flight on a replica is never chosen to be unloaded there;
- the chosen replica holds the version, or has room for it once the evictions are done: an adapter
  request is never sent where it would be answered by the base model or another version;
- a replica without LoRA slots (`slots` 0) is never chosen;
- a version closing on a replica is never placed there;
- with `load=False`, and on a replica whose `loads` is False, nothing is loaded or unloaded.

`slots` is how many versions a replica may hold at once: its engine's `max_cpu_loras` (vLLM's own
LRU of loaded adapters; past it vLLM would evict behind the gateway's back). `max_loras`, the
versions one engine step may batch, bounds only how many run at once there, not what it holds.
In-flight counts are the gateway's own (every request it has open, per replica and version); a
replica's unload is also guarded on its own count (`DELETE /v1/adapters/{name}` is a 409 while that
adapter has requests in flight there), since another gateway's requests are not counted here.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReplicaAdapters:
    name: str
    slots: int  # versions it may hold at once (max_cpu_loras); 0: LoRA not enabled
    load: int  # requests in flight on the replica, all versions and the base model
    # engine name -> when it was last used (monotonic; a larger value is more recent). Includes the
    # versions being loaded now: they hold a slot and a request for them waits for the load.
    loaded: Mapping[str, float] = field(default_factory=dict)
    in_flight: Mapping[str, int] = field(default_factory=dict)  # engine name -> requests in flight
    # Versions closing here: they take no new request, and go first once idle (module docstring).
    closing: frozenset[str] = frozenset()
    loads: bool = True  # False: a holder only, no load or unload here now


@dataclass(frozen=True)
class Placement:
    replica: str
    engine_name: str
    load: bool  # the replica must load the version first
    evict: tuple[str, ...] = ()  # versions to unload on it first, in this order
    # Why this replica (its routing decision's rule): burst, prefix or holder (the least loaded), load.
    why: str = field(default="holder", compare=False)


def run_of(engine_name: str) -> str:
    """The run of a pool version's engine name (`<run>.<step>.<serial>`); any other adapter name is
    a run of its own."""
    return engine_name.split(".", 1)[0]


def runs_over_share(replicas: Sequence[ReplicaAdapters], wanted: str) -> frozenset[str]:
    """Pure: the runs holding more than their share of the pool's slots, the share being the slots
    over the runs that hold a version or ask for one (`wanted`'s run)."""
    slots = sum(r.slots for r in replicas if r.slots > 0)
    held: dict[str, int] = {}
    for r in replicas:
        if r.slots > 0:
            for n in r.loaded:
                held[run_of(n)] = held.get(run_of(n), 0) + 1
    share = slots / len(set(held) | {run_of(wanted)})
    return frozenset(run for run, n in held.items() if n > share)


def victims(replica: ReplicaAdapters, keep: str, declared: Collection[str],
            over: Collection[str] = frozenset()) -> tuple[str, ...] | None:
    """The versions to unload on `replica` so that `keep` fits, or None when it cannot be made room
    for: too few idle versions. Never one with a request in flight, never `keep` itself; versions no
    longer declared first, then those of the runs `over` their share (`runs_over_share`), then the
    least recently used."""
    if replica.slots <= 0 or not replica.loads:
        return None
    need = len([n for n in replica.loaded if n != keep]) - replica.slots + 1
    if need <= 0:
        return ()
    idle = [n for n in replica.loaded if n != keep and replica.in_flight.get(n, 0) <= 0]
    idle.sort(key=lambda n: (n not in replica.closing, n in declared, run_of(n) not in over, replica.loaded[n], n))
    return tuple(idle[:need]) if len(idle) >= need else None


def place(engine_name: str, replicas: Sequence[ReplicaAdapters], *, declared: Collection[str],
          capacity: int | None = None, turn: int = 0, load: bool = True, overlap: Mapping[str, float] | None = None,
          burst: str | None = None, hot: Callable[[int, int], bool] | None = None) -> Placement | None:
    """The placement of one request for `engine_name` among the eligible `replicas` (ready, not
    draining, allowed by the version policy), or None when no replica can take it now. `load=False`:
    only a holder (module docstring). `overlap`, `burst`, `hot`: the endpoint scorer's preferences
    among holders (the fraction of the prompt each replica holds, where its burst went, and whether a
    load is hot against the least loaded holder's)."""
    # A replica where the version is closing takes no request for it.
    lora = [r for r in replicas if r.slots > 0 and engine_name not in r.closing]
    holders = sorted((r for r in lora if engine_name in r.loaded), key=lambda r: (r.load, r.name))
    over = runs_over_share(lora, engine_name)
    loaders: list[tuple[ReplicaAdapters, tuple[str, ...]]] = []
    for r in lora if load else ():
        if engine_name in r.loaded:
            continue
        evict = victims(r, engine_name, declared, over)
        if evict is not None:
            loaders.append((r, evict))

    def staleness(r: ReplicaAdapters, evict: tuple[str, ...]) -> tuple[bool, bool, float]:
        # Unloading only undeclared versions beats any declared one; then only versions of runs over
        # their share; then the most recent use among the victims, least first.
        return (any(n in declared for n in evict), any(run_of(n) not in over for n in evict),
                max((r.loaded[n] for n in evict), default=0.0))

    # Least loaded; a free slot before an eviction; the least recently used victims; the rotating
    # turn spreads the ties left (an idle pool's free slots).
    loaders.sort(key=lambda re: (re[0].load, len(re[1]), staleness(*re), re[0].name))

    shares = overlap or {}

    def first_holder() -> Placement:
        least = holders[0].load
        joined = next((r for r in holders if r.name == burst and (capacity is None or r.load < capacity)), None)
        if joined is not None:
            return Placement(joined.name, engine_name, load=False, why="burst")
        cached = [r for r in holders if shares.get(r.name, 0.0) > 0 and (hot is None or not hot(r.load, least))]
        if cached:
            best = max(cached, key=lambda r: (shares[r.name], -r.load))
            return Placement(best.name, engine_name, load=False, why="prefix")
        tied = [r for r in holders if r.load == least]
        return Placement(tied[turn % len(tied)].name, engine_name, load=False)

    def first_loader() -> Placement:
        best = loaders[0]
        rank = (best[0].load, len(best[1]), staleness(*best))
        tied = [re for re in loaders if (re[0].load, len(re[1]), staleness(*re)) == rank]
        r, evict = tied[turn % len(tied)]
        return Placement(r.name, engine_name, load=True, evict=evict, why="load")

    if holders and (capacity is None or holders[0].load < capacity):
        return first_holder()
    if loaders and (capacity is None or loaders[0][0].load < capacity):
        return first_loader()
    if holders:
        return first_holder()
    if loaders:
        return first_loader()
    return None


def to_close(engine_name: str, replicas: Sequence[ReplicaAdapters], *, declared: Collection[str],
             tenure: Mapping[tuple[str, str], float]) -> tuple[str, str] | None:
    """The (replica, version) to close so that `engine_name`, whose turn it is and which no replica
    can place now, gets the next slot that frees: a version on a replica that could load it, versions
    the pool no longer declares first, then those of runs over their share of the slots, then the one
    that has held its slot longest (`tenure`: when this gateway loaded it; 0 for one it did not), so
    that slots go round the versions that wait. None: no replica could ever make room."""
    lora = [r for r in replicas if r.slots > 0 and r.loads and engine_name not in r.loaded]
    over = runs_over_share(lora, engine_name)
    choices = [(r, n) for r in lora for n in r.loaded if n not in r.closing]
    if not choices:
        return None
    r, n = min(choices, key=lambda rn: (rn[1] in declared, run_of(rn[1]) not in over,
                                        tenure.get((rn[0].name, rn[1]), 0.0), rn[0].load, rn[0].name, rn[1]))
    return r.name, n
