"""`phalanx bench gwtf --preset flow|join|table2|table2-paper`: GWTF's flow and node-addition tests.

- flow: GWTF Table V settings 1-6. Each peer runs `FlowNode` (only local
  knowledge) under the synchronous driver for at most `rounds` rounds (the last
  `settle` of them with Request Change / Redirect paused so moves in flight
  land; the same run with T=0, i.e. without annealing, is reported next to it);
  the total cost of the complete flows is compared with the optimum for the
  same number of microbatches: networkx's min-cost flow with one data node
  (settings 1-4), the multi-commodity optimum with several (5-6: each
  microbatch returns to its own data node; an integer program, `flowgraph.
  multi_commodity_optimal`), and with SWARM's greedy "closest next-stage peer
  with room". `contended=true` gives every data node the graph's whole maximum
  flow as demand, so that the data nodes compete for the bottleneck: the table
  then shows how the units are split between them.
- join: GWTF Table IV / Fig. 5 (see `phalanx.algorithms.gwtf.placement`).
- table2: the runtime's crash benchmark (`phalanx.benchmarks.gwtf_table2`).
- table2-paper: Table II in the paper's regime (`phalanx.benchmarks.gwtf_table2_paper`).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..algorithms.gwtf.config import FlowConfig
from ..algorithms.gwtf.flowgraph import (
    FlowGraph,
    build_nodes,
    max_flow,
    multi_commodity_optimal,
    node_flows,
    optimal,
    random_graph,
    swarm_greedy,
)
from ..algorithms.gwtf.placement import (
    UtilQuery,
    flood_step,
    merge_entries,
    place_capacity_first,
    place_joiners,
    place_optimal,
    place_random,
    stage_utilization,
)
from ..algorithms.gwtf.sync import SyncDriver
from ..core.errors import ConfigError
from ..core.rng import py_stream
from ..runs.config import override

# GWTF Table V: sources, relays, stages, floor(U(capacity)), floor(U(link cost))
FLOW_SETTINGS: dict[int, tuple[int, int, int, tuple[int, int], tuple[int, int]]] = {
    1: (1, 40, 8, (1, 3), (1, 20)),
    2: (1, 40, 10, (1, 3), (1, 20)),
    3: (1, 40, 8, (5, 15), (1, 20)),
    4: (1, 40, 8, (1, 3), (5, 100)),
    5: (2, 40, 8, (1, 3), (1, 20)),
    6: (4, 80, 8, (1, 3), (1, 20)),
}


@dataclass(frozen=True)
class FlowBenchConfig:
    seeds: int = 5
    rounds: int = 120
    settle: int = 20
    settings: str = "1,2,3,4,5,6"
    seed: int = 0
    contended: bool = False  # every data node demands the whole max flow (else the max flow is split between them)
    flow: FlowConfig = field(default_factory=FlowConfig)

    def __post_init__(self) -> None:
        if self.seeds < 1:
            raise ConfigError(f"seeds must be >= 1, got {self.seeds}")
        if not 0 <= self.settle < self.rounds:
            raise ConfigError(f"need 0 <= settle < rounds, got settle={self.settle} rounds={self.rounds}")
        for part in self.settings.split(","):
            if not part.strip().isdigit() or int(part) not in FLOW_SETTINGS:
                raise ConfigError(f"settings must be a comma list of 1..6, got {self.settings!r}")

    def chosen(self) -> list[int]:
        return [int(p) for p in self.settings.split(",")]


def split_demand(total: int, sources: list[str]) -> dict[str, int]:
    """`total` units over `sources` as evenly as integers allow (the first ones take the remainder),
    so that the demands add up to the maximum flow; at least 1 each."""
    per, extra = divmod(total, len(sources))
    return {d: max(1, per + (i < extra)) for i, d in enumerate(sources)}


def run_flow_case(setting: int, seed: int, config: FlowBenchConfig) -> dict:
    """One graph of one setting: GWTF, SWARM greedy and the optimum."""
    sources, relays, stages, capacity, link_cost = FLOW_SETTINGS[setting]
    graph = random_graph(py_stream(config.seed, "gwtf-flow-graph", setting, seed), sources, relays, stages,
                         capacity, link_cost, demand=10**6)
    best_value = max_flow(graph)
    demand = {d: best_value for d in graph.data} if config.contended else split_demand(best_value, sorted(graph.data))
    graph = replace(graph, demand=demand)
    optimum: dict[int, tuple[dict[str, int], float]] = {}

    def opt(units: int) -> float:
        """The least total cost of `units` microbatches, each back at its own data node."""
        if units not in optimum:
            optimum[units] = ({graph.data[0]: units}, optimal(graph, units)[1]) if sources == 1 \
                else multi_commodity_optimal(graph, units)
        return optimum[units][1]

    start = time.perf_counter()
    driver = SyncDriver(build_nodes(graph, config.flow, config.seed * 1000 + seed))
    driver.run(config.rounds - config.settle)
    used = config.rounds - config.settle + driver.settle(config.settle)
    wall = time.perf_counter() - start
    paths = driver.paths()
    value, cost = len(paths), driver.total_cost()
    per_source = [sum(1 for d, _, _ in paths if d == data) for data in sorted(graph.data)]
    most = max_flow(graph) if sources == 1 else sum(multi_commodity_optimal(graph)[0].values())
    opt_same = opt(value) if value else 0.0
    # the optimum with GWTF's split between data nodes fixed: what is lost to the split, and what within it
    at_split = multi_commodity_optimal(replace(graph, demand=dict(zip(sorted(graph.data), per_source))), value)[1] \
        if value and sources > 1 else opt_same
    greedy_search = SyncDriver(build_nodes(graph, replace(config.flow, temperature=0.0), config.seed * 1000 + seed))
    greedy_search.run(config.rounds - config.settle)
    greedy_search.settle(config.settle)
    t0_value, t0_cost = greedy_search.flow_value(), greedy_search.total_cost()
    opt_t0 = opt(t0_value) if t0_value else 0.0
    opt_full = opt(most)
    greedy = swarm_greedy(graph)
    g_value, g_cost = len(greedy), sum(c for _, _, c in greedy)
    opt_greedy = opt(g_value) if g_value else 0.0
    return {
        "setting": setting, "seed": seed, "sources": sources, "relays": relays, "stages": stages,
        "demand": most,  # the most units the graph carries home (the demands add up to it unless contended)
        "gwtf_flow": value, "gwtf_min_share": min(per_source) / value if value else 0.0,
        "gwtf_split": "/".join(map(str, per_source)),
        "optimum_split": "/".join(str(optimum[value][0][d]) for d in sorted(graph.data)) if value else "", "gwtf_cost": cost, "optimum_cost": opt_same,
        "gwtf_ratio": cost / opt_same if opt_same else float("nan"),
        "optimum_at_split": at_split, "split_ratio": at_split / opt_same if opt_same else float("nan"),
        "handovers": sum(n.handovers for n in driver.nodes.values()),
        "t0_flow": t0_value, "t0_cost": t0_cost, "t0_ratio": t0_cost / opt_t0 if opt_t0 else float("nan"),
        "swarm_flow": g_value, "swarm_cost": g_cost,
        "swarm_ratio": g_cost / opt_greedy if opt_greedy else float("nan"),
        "gwtf_per_mb": cost / value if value else float("nan"),
        "swarm_per_mb": g_cost / g_value if g_value else float("nan"),
        "optimum_per_mb": opt_full / most,
        "rounds": used, "messages": driver.messages, "wall_s": wall,
    }


def _mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f}±{statistics.stdev(values):.3f}"


def format_flow_table(rows: list[dict]) -> str:
    head = (f"{'set':>3} {'src':>3} {'relays':>6} {'stages':>6} {'flow/most':>11} {'min share':>9} {'GWTF/opt':>13} "
            f"{'split/opt':>9} {'handovers':>9} {'SWARM/opt':>13} {'GWTF c/mb':>9} {'SWARM c/mb':>10} {'opt c/mb':>8} "
            f"{'rounds':>6} {'T=0 flow':>8} {'GWTF T=0/opt':>13}")
    lines = [head, "-" * len(head)]
    for s in sorted({r["setting"] for r in rows}):
        rs = [r for r in rows if r["setting"] == s]
        share = min(r["gwtf_min_share"] for r in rs) if rs[0]["sources"] > 1 else float("nan")
        lines.append(
            f"{s:>3} {rs[0]['sources']:>3} {rs[0]['relays']:>6} {rs[0]['stages']:>6} "
            f"{sum(r['gwtf_flow'] for r in rs):>5}/{sum(r['demand'] for r in rs):<5} {share:>9.2f} "
            f"{_mean_std([r['gwtf_ratio'] for r in rs]):>13} {statistics.mean(r['split_ratio'] for r in rs):>9.3f} "
            f"{statistics.mean(r['handovers'] for r in rs):>9.1f} {_mean_std([r['swarm_ratio'] for r in rs]):>13} "
            f"{statistics.mean(r['gwtf_per_mb'] for r in rs):>9.2f} {statistics.mean(r['swarm_per_mb'] for r in rs):>10.2f} "
            f"{statistics.mean(r['optimum_per_mb'] for r in rs):>8.2f} {max(r['rounds'] for r in rs):>6} "
            f"{sum(r['t0_flow'] for r in rs):>8} {_mean_std([r['t0_ratio'] for r in rs]):>13}"
        )
    lines.append("ratios: total cost / the optimum for the same number of microbatches, each back at its own data node "
                 "(mean±std over seeds)")
    lines.append("optimum: networkx min-cost flow with one data node; with several, the multi-commodity integer program")
    lines.append("flow/most: GWTF's complete flows / the most the graph carries home; min share: the smallest fraction "
                 "of GWTF's flows any data node got (worst seed)")
    lines.append("split/opt: the optimum with GWTF's split between data nodes fixed / the optimum (1: the split costs "
                 "nothing; the rest of GWTF/opt is within each data node's flows); handovers: chains handed to "
                 "another data node per run (mean)")
    lines.append("GWTF: the configured annealing (paper: T=1.7, alpha=0.95); GWTF T=0: the same moves without worsening ones")
    return "\n".join(lines)


def run_flow(config: FlowBenchConfig, out: Path) -> list[dict]:
    rows = [run_flow_case(s, seed, config) for s in config.chosen() for seed in range(config.seeds)]
    _write_csv(out / "flow.csv", rows)
    return rows


def _write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


# GWTF Table IV at laptop scale: stages, floor(U(capacity)), floor(U(interlayer cost)), random stage sizes
JOIN_SETTINGS: dict[str, tuple[int, tuple[int, int], tuple[int, int], bool]] = {
    "1": (4, (1, 20), (1, 100), False),
    "2": (4, (1, 20), (20, 100), False),
    "3": (4, (1, 5), (1, 100), False),
    "4": (5, (1, 20), (1, 100), False),
    "5*": (4, (1, 20), (1, 100), True),
}
JOIN_POLICIES = ("gwtf", "capacity_first", "random", "optimal")


@dataclass(frozen=True)
class JoinBenchConfig:
    runs: int = 10
    relays_per_stage: int = 4
    batches: int = 3
    microbatches: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("runs", "relays_per_stage", "batches", "microbatches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")


class _JoinWorld:
    """One run: fixed pairwise link costs, the relays already placed, and a pool of candidates."""

    def __init__(self, setting: str, run: int, config: JoinBenchConfig) -> None:
        self.stages, cap_range, self.cost_range, random_sizes = JOIN_SETTINGS[setting]
        self.seed = (config.seed, setting, run)
        self.microbatches = config.microbatches
        rng = py_stream(config.seed, "gwtf-join", setting, run)
        sizes = [rng.randint(1, 2 * config.relays_per_stage - 1) if random_sizes else config.relays_per_stage
                 for _ in range(self.stages)]
        self.placed: dict[str, int] = {f"r{k}.{i}": k for k in range(self.stages) for i in range(sizes[k])}
        self.capacity = {r: int(rng.uniform(*cap_range)) for r in self.placed}
        self.candidates = [f"j{i}" for i in range(config.batches * self.stages)]
        self.capacity.update({c: int(rng.uniform(*cap_range)) for c in self.candidates})
        self._pairs: dict[tuple[str, str], float] = {}

    def pair_cost(self, a: str, b: str) -> float:
        key = (min(a, b), max(a, b))
        if key not in self._pairs:
            self._pairs[key] = float(int(py_stream(*self.seed, "pair", *key).uniform(*self.cost_range)))
        return self._pairs[key]

    def graph(self, placed: Mapping[str, int]) -> FlowGraph:
        members = tuple(tuple(sorted(r for r, k in placed.items() if k == s)) for s in range(self.stages))
        layers = [("d",), *members, ("d",)]
        cost = {(a, b): self.pair_cost(a, b) for la, lb in zip(layers, layers[1:]) for a in la for b in lb}
        return FlowGraph(("d",), members, {r: self.capacity[r] for r in placed}, {"d": 10**6}, cost)

    def iteration_cost(self, placed: Mapping[str, int]) -> float:
        """Mean path cost times the waves needed for `microbatches` at the max flow (lower is better)."""
        graph = self.graph(placed)
        value, total = optimal(graph)
        if value == 0:
            return float("inf")
        return (total / value) * (self.microbatches / value)

    def utilization(self, placed: Mapping[str, int]) -> dict[int, float]:
        """GWTF's flooded utilization query over the current min-cost flow."""
        graph = self.graph(placed)
        flow = node_flows(graph)
        entries: tuple = ()
        returned: list[UtilQuery] = []
        for k in range(self.stages):
            targets = graph.stages[k + 1] if k + 1 < self.stages else ("d",)
            returned = []
            for r in graph.stages[k]:  # each relay merges the copies it got, adds itself, forwards
                query = UtilQuery("prev", r, "d", 0, entries)
                returned += flood_step(query, r, k, graph.capacity[r], flow.get(r, 0), targets)
            entries = tuple(sorted((p, *v) for p, v in merge_entries(returned).items()))
        return stage_utilization(merge_entries(returned), self.stages)


def run_join_case(setting: str, run: int, config: JoinBenchConfig) -> list[dict]:
    world = _JoinWorld(setting, run, config)
    start_cost = world.iteration_cost(world.placed)
    rows = []
    for policy in JOIN_POLICIES:
        placed = dict(world.placed)
        rng = py_stream(config.seed, "gwtf-join-random", setting, run)
        for b in range(config.batches):
            batch = {c: world.capacity[c] for c in world.candidates[b * world.stages:(b + 1) * world.stages]}
            if policy == "gwtf":
                choice = place_joiners(batch, world.utilization(placed))
            elif policy == "capacity_first":
                choice = place_capacity_first(batch, world.stages)
            elif policy == "random":
                choice = place_random(batch, world.stages, rng)
            else:
                choice = place_optimal(batch, world.stages, lambda a, p=placed: world.iteration_cost({**p, **a}))
            placed.update(choice)
        end_cost = world.iteration_cost(placed)
        rows.append({"setting": setting, "run": run, "policy": policy, "stages": world.stages,
                     "relays": len(world.placed), "joiners": len(world.candidates),
                     "cost_before": start_cost, "cost_after": end_cost,
                     "improvement": (start_cost - end_cost) / start_cost})
    return rows


def run_join(config: JoinBenchConfig, out: Path) -> list[dict]:
    rows = [row for s in JOIN_SETTINGS for run in range(config.runs) for row in run_join_case(s, run, config)]
    _write_csv(out / "join.csv", rows)
    return rows


def format_join_table(rows: list[dict]) -> str:
    head = f"{'set':>4} {'stages':>6} " + " ".join(f"{p:>15}" for p in JOIN_POLICIES) + f" {'GWTF/opt':>9}"
    lines = [head, "-" * len(head)]
    for s in JOIN_SETTINGS:
        rs = [r for r in rows if r["setting"] == s]
        if not rs:
            continue
        cells = [_mean_std([r["improvement"] for r in rs if r["policy"] == p]) for p in JOIN_POLICIES]
        after = {p: statistics.mean(r["cost_after"] for r in rs if r["policy"] == p) for p in ("gwtf", "optimal")}
        lines.append(f"{s:>4} {rs[0]['stages']:>6} " + " ".join(f"{c:>15}" for c in cells)
                     + f" {after['gwtf'] / after['optimal']:>9.3f}")
    lines.append("improvement = (cost_before - cost_after) / cost_before, cost = mean path cost x microbatches / max flow;")
    lines.append("optimal = brute force over every assignment of each batch of S joiners to the S stages")
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    """Dispatch `phalanx bench gwtf` on --preset."""
    preset = "flow" if args.preset == "quick" else args.preset
    out = Path(args.out) if args.out else Path("runs") / f"bench-gwtf-{preset}"
    if preset == "flow":
        config = override(FlowBenchConfig(), args.set or [])
        rows = run_flow(config, out)
        print(format_flow_table(rows))
        print(f"wrote {out / 'flow.csv'}")
        return 0
    if preset == "join":
        config = override(JoinBenchConfig(), args.set or [])
        rows = run_join(config, out)
        print(format_join_table(rows))
        print(f"wrote {out / 'join.csv'}")
        return 0
    if preset == "table2":
        from .gwtf_table2 import run_cli as run_table2

        return run_table2(args)
    if preset == "table2-paper":
        from .gwtf_table2_paper import run_cli as run_table2_paper

        return run_table2_paper(args)
    raise ConfigError(f"unknown gwtf bench preset {args.preset!r}; allowed: flow, join, table2, table2-paper")
