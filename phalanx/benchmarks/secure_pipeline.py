"""`phalanx bench secure-pipeline`: both axes of defence at once (issue 18 item 5), in the simulator.

On the preset `secure-gpt-pipeline` (1 data node + 3 stages x 4 relays, GWTF routing, SENTINEL boundary
verifiers, BTARD per stage) it runs, per seed, these cells:
- clean: no attacker;
- link: relay `link_relays` corrupts what it sends on its links (`attack.name`, a link attack), placed
  where GWTF routes traffic (relay 1, stage 2: routed in seeds 0-2 of the clean runs; session 21's relay 4
  was on no path in seed 2, `idle`);
- protocol: relay `protocol_relays` lies in its stage all-reduce (`byzantine.attack`, a protocol attack);
- forge: relay `forge_relays` forges its stage gradient (`byzantine.attack=forge_attack`, default
  approve_all, issue 18 item 2's forger); the cell runs only if an attack of that name is registered on
  the protocol axis, else it is listed as not run (caught only where the preset has btard.validators > 0);
- all: every available attacker at once (the forger only when it is not the protocol liar's key:
  `byzantine.attack` holds one name per run), under relay churn (`leave_rate`, `join_rate` per relay
  and iteration). Its Byzantine relays want to stay (`faults.stay`, `stay=true`): churn never takes them, so each
  attack runs in every seed (on session 21's merged main churn took the link attacker before it could
  lie in seeds 0 and 2: `idle` and `out` below); the plain side keeps the same relays in (the all-reduce
  liar's index too, though it is honest there).
  Both sides of a seed meet the same churn: each relay draws its fate per iteration from a stream of its
  own (`launch_churn.churn_draws`), and a leave falls `fraction x leave_span` simulated seconds after its
  iteration opens on both sides (`faults.leave_span`), not at a fraction of the last iteration's length,
  which differs between the sides. `leave_span` (0.11 s) is just under the plain clean iteration
  (0.114-0.124 s in seeds 0-2, of which 0.084-0.094 s of microbatches on both sides): a leave falls within
  its iteration on both sides, in the same phase (microbatches, then the stage aggregation). On both sides
  churn leaves a stage `stage_floor` (2) unbanned replicas, the secure side's own rule under BTARD per stage
  (with one left, the link attacker in seed 1, its ban emptied stage 2 for good). Decisions that
  legitimately differ (the stage rule counts unbanned replicas that serve the current version: a banned
  replica serves nobody, and a relay that came back is placed by other rules under BTARD per stage) are
  counted under the table (`churn` per run: iteration, relay and decision of each draw that acted).

Beside each, the same cell on the plain pipeline (mean reducer, no verifiers, no BTARD). The plain
pipeline has no all-reduce protocol to lie in, so its protocol and forge cells run the same relay lying
in the one thing its round takes from it, its stage vector (`attack.target=aggregation`, scaled by
`plain_factor`); a plain run carries one link-attack policy, so the plain `all` cell keeps the link
attacker and drops the all-reduce liar (said in the table's footer).

Per run: the final loss (the last iteration's mean train loss) against the clean run of the same side
and seed; the banned set against the Byzantine set (relay indices); steps to ban (first ban iteration
minus the attack's first iteration, per Byzantine relay; `out` for one its stage retired before its attack
began: it never lied, and counts as removed; `idle` for a link attacker that tampered no tensor: exact too);
honest relays banned; relays retired (departed leaving a
check unjudged: out for good, not banned; honest ones are listed under the goals); simulated seconds, and
for the secure side their ratio to the plain run of the same cell and to the plain clean run.
Writes runs.csv and table.txt into the output directory and prints the table. Presets: quick (3 cells,
1 seed, 24 iterations), full (every cell, 3 seeds, the preset's 40 iterations); `--set key=value`
overrides any SecurePipelineConfig field; `--set read_only=true` tabulates the runs.csv of an
earlier (or interrupted) bench in `--out` without running anything.
"""

from __future__ import annotations

import argparse
import csv
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import ConfigError
from ..runs.attack_axes import names
from ..runs.config import override
from ..runs.dp.swarm import peer_identity
from ..runs.pipeline.config import PipelineRunConfig
from ..runs.pipeline.presets import PIPELINE_PRESETS
from ..runs.pipeline.run import simulate_pipeline
from .common import bench_config

CELLS = ("clean", "link", "protocol", "forge", "all")
SIDES = ("secure", "plain")
PLAIN = ["btard.enabled=false", "sentinel.enabled=false", "allreduce.reducer=mean"]


@dataclass(frozen=True)
class SecurePipelineConfig:
    preset: str = "secure-gpt-pipeline"
    steps: int = 0  # iterations (0: the preset's)
    seeds: int = 3
    first_seed: int = 0
    cells: str = ",".join(CELLS)
    sides: str = ",".join(SIDES)
    link_attack: str = "zeros"
    # relay 1 starts in stage 2, where GWTF pairs two stage-1 relays with one stage-2 relay and leaves another idle:
    # relay 1 carries traffic in seeds 0-2 (4, 7 and 10 are each idle in one of them: relay 4 tampered nothing in seed 2)
    link_relays: str = "1"
    link_start: int = 20  # after SENTINEL's warm-up (200 tensors per link, about iteration 17 here)
    protocol_attack: str = "agg_shift"
    protocol_relays: str = "0"  # relay 0 starts in stage 1
    protocol_start: int = 10
    forge_attack: str = "approve_all"  # item 2's forger: commits -scale x its stage vector (a protocol attack)
    forge_relays: str = "8"  # relay 8 starts in stage 3
    forge_start: int = 10
    plain_factor: float = -10.0  # plain protocol / forge cells: the liar sends this x its stage vector
    leave_rate: float = 0.1  # the `all` cell's churn, per relay and iteration
    join_rate: float = 0.1
    stay: bool = True  # all: its Byzantine relays never leave by churn (faults.stay); false: churn takes them too
    leave_span: float = 0.11  # all: a leave falls within this many simulated seconds after its iteration opens, on both sides
    stage_floor: int = 2  # all: churn leaves a stage this many unbanned replicas, on both sides (the secure side's default)
    jobs: int = 1  # parallel processes (0: one per core)
    read_only: bool = False  # tabulate the runs.csv in the output directory, run nothing

    def __post_init__(self) -> None:
        if self.preset not in PIPELINE_PRESETS:
            raise ConfigError(f"preset={self.preset!r} is not a pipeline preset; allowed: {', '.join(PIPELINE_PRESETS)}")
        if self.steps < 0 or self.seeds < 1 or self.jobs < 0:
            raise ConfigError("steps and jobs must be >= 0, seeds >= 1")
        if not self.cell_list() or not set(self.cell_list()) <= set(CELLS):
            raise ConfigError(f"cells={self.cells!r}: a comma-separated subset of {', '.join(CELLS)}")
        if not self.side_list() or not set(self.side_list()) <= set(SIDES):
            raise ConfigError(f"sides={self.sides!r}: a comma-separated subset of {', '.join(SIDES)}")
        if "clean" not in self.cell_list():
            raise ConfigError("cells must include clean: every loss is compared with it")
        if not (0 <= self.leave_rate <= 1 and 0 <= self.join_rate <= 1):
            raise ConfigError("leave_rate and join_rate are probabilities in [0, 1]")
        if self.leave_span < 0 or self.stage_floor < 0:
            raise ConfigError("leave_span must be >= 0 simulated seconds (0: the last iteration's duration, per side), "
                              "stage_floor >= 0 (0: each side's own)")

    def cell_list(self) -> list[str]:
        return [c for c in self.cells.split(",") if c]

    def side_list(self) -> list[str]:
        return [s for s in self.sides.split(",") if s]

    def forge_available(self) -> bool:
        return self.forge_attack in names("protocol")


PRESETS = {
    "quick": lambda: SecurePipelineConfig(steps=24, seeds=1, cells="clean,link,protocol", jobs=2),
    "full": SecurePipelineConfig,
}


def _relays(text: str) -> list[int]:
    return sorted({int(part) for part in text.split(",") if part.strip()})


def attackers(config: SecurePipelineConfig, cell: str, side: str) -> dict[int, tuple[str, int]]:
    """The Byzantine relays of a run: relay index -> (role, first attacked iteration)."""
    roles = {
        "link": (config.link_relays, config.link_start),
        "protocol": (config.protocol_relays, config.protocol_start),
        "forge": (config.forge_relays, config.forge_start),
    }
    chosen = {"clean": [], "link": ["link"], "protocol": ["protocol"], "forge": ["forge"]}.get(cell)
    if chosen is None:  # all
        chosen = ["link"] if side == "plain" else ["link", "protocol"]
    out = {}
    for role in chosen:
        relays, start = roles[role]
        out.update({r: (role, start) for r in _relays(relays)})
    return out


def settings(config: SecurePipelineConfig, cell: str, side: str, seed: int) -> list[str]:
    """The `--set` assignments of one run on top of the preset."""
    sets = [f"seed={seed}"] + ([f"steps={config.steps}"] if config.steps else [])
    sets += PLAIN if side == "plain" else []
    if cell in ("link", "all"):
        sets += [f"attack.name={config.link_attack}", f"attack.relays={config.link_relays}", f"attack.start={config.link_start}"]
    if cell in ("protocol", "forge", "all") and not (side == "plain" and cell == "all"):
        name, relays, start = ((config.protocol_attack, config.protocol_relays, config.protocol_start) if cell != "forge"
                               else (config.forge_attack, config.forge_relays, config.forge_start))
        if side == "secure":
            sets += [f"byzantine.attack={name}", f"byzantine.relays={relays}", f"byzantine.start_step={start}"]
        else:
            sets += ["attack.name=scaling", "attack.target=aggregation", f"attack.factor={config.plain_factor}",
                     f"attack.relays={relays}", f"attack.start={start}"]
    if cell == "all":
        sets += [f"faults.leave_rate={config.leave_rate}", f"faults.join_rate={config.join_rate}",
                 f"faults.leave_span={config.leave_span}", f"faults.stage_floor={config.stage_floor}"]
        if config.stay:
            sets.append(f"faults.stay={','.join(map(str, sorted(attackers(config, 'all', 'secure'))))}")
    return sets


def run_config(config: SecurePipelineConfig, cell: str, side: str, seed: int) -> PipelineRunConfig:
    return override(PIPELINE_PRESETS[config.preset](), settings(config, cell, side, seed))


def measure(run: PipelineRunConfig, summary: dict, byzantine: dict[int, tuple[str, int]]) -> dict:
    """The bench's figures of one run (see the module docstring)."""
    relay_of = {peer_identity(run.seed, run.data_nodes + r).peer_id: r for r in range(run.relays)}
    first_ban: dict[int, int] = {}
    for ban in summary["bans"]:
        relay = relay_of.get(ban["peer"])
        if relay is not None:
            first_ban[relay] = min(first_ban.get(relay, ban["step"]), ban["step"])
    retired: dict[int, int] = {}  # relay -> the step its stage retired it at (departed:unverifiable)
    for e in summary["events"]:
        relay = relay_of.get(e["peer"]) if e["kind"] == "retire" else None
        if relay is not None:
            retired[relay] = min(retired.get(relay, e["step"]), e["step"])
    # A Byzantine relay its stage retired before its attack began never lied: nothing can ban it, and it is out of
    # the run for good (refused on every join). It counts as removed, shown as `out` (churn took it first), only
    # if it took no part from its start on: a retirement settles a round or more after the step it names, and a
    # relay that rejoined and served meanwhile could have lied unseen.
    served = {(relay_of[e["peer"]], e["it"]) for e in summary["events"]
              if e["kind"] in ("fwd", "bwd", "send", "aggregate") and e["peer"] in relay_of and e.get("in_group", True)}
    out_first = {r for r, (_, start) in byzantine.items() if r not in first_ban and retired.get(r, start) < start
                 and not any(relay == r and it >= start for relay, it in served)}
    # Likewise a link attacker that tampered no tensor (routed on no path while its attack ran): shown as `idle`.
    lied = {a["peer"] for a in summary["attacks"] if a["tampered"]}
    peer_of = {r: p for p, r in relay_of.items()}
    idle = {r for r, (role, _) in byzantine.items() if role == "link" and r not in set(first_ban) | out_first
            and peer_of[r] not in lied}
    losses = [m["loss"] for m in summary["metrics"] if m["loss"] is not None]
    mbs = summary["microbatches"]
    return {
        "final_loss": losses[-1] if losses else None,
        "byzantine": " ".join(map(str, sorted(byzantine))),
        "banned": " ".join(map(str, sorted(first_ban))),
        "exact": set(first_ban) | out_first | idle == set(byzantine),
        "steps_to_ban": " ".join(f"{r}:{first_ban[r] - start}" if r in first_ban else f"{r}:out" if r in out_first
                                 else f"{r}:idle" if r in idle else f"{r}:-" for r, (_, start) in sorted(byzantine.items())),
        "honest_banned": len(set(first_ban) - set(byzantine)),
        "retired": " ".join(map(str, sorted(retired))),  # departed leaving a check unjudged: out, not banned
        # tensors (or all-reduce vectors) the link-attack relays tampered: 0 means the attacker never lied
        "tampered": sum(bool(a["tampered"]) for a in summary["attacks"]) if run.attack.name != "none" else None,
        "finished": sum(mb["outcome"] == "ok" for mb in mbs), "slots": len(mbs),
        "simulated_seconds": summary["simulated_seconds"],
        "leaves": sum(e["kind"] == "leave" for e in summary["events"]),
        "joins": sum(e["kind"] == "join" for e in summary["events"]),
        "churn": " ".join(f"{it}:{relay}:{code}" for it, relay, code in churn_decisions(summary["events"], relay_of)),
    }


CHURN_CODES = {("returned", ""): "R", ("left", ""): "L", ("kept", "stage"): "S", ("kept", "down"): "D"}


def churn_decisions(events: list[dict], relay_of: dict[str, int]) -> list[tuple[int, int, str]]:
    """Each churn draw that acted, as (iteration drawn, relay index, code): R returned, L left, and a leave kept
    from taking its relay by S the stage rule, D its relay gone already (another fault)."""
    return sorted((e["it"], relay_of[e["peer"]], CHURN_CODES[(e["decision"], e["why"])])
                  for e in events if e["kind"] == "churn")


def churn_comparison(secure: str, plain: str) -> str:
    """The two sides' churn decisions of one seed (runs.csv `churn` strings): how many (iteration, relay) draws
    acted the same, and each that did not (secure code / plain code, '-' where that side's draw did nothing)."""
    sides = [{tuple(map(int, d.split(":")[:2])): d.split(":")[2] for d in text.split()} for text in (secure, plain)]
    keys = sorted(set(sides[0]) | set(sides[1]))
    differ = [f"{it}:{relay} {sides[0].get((it, relay), '-')}/{sides[1].get((it, relay), '-')}" for it, relay in keys
              if sides[0].get((it, relay)) != sides[1].get((it, relay))]
    return f"{len(keys) - len(differ)} of {len(keys)} the same" + (f"; differ: {', '.join(differ)}" if differ else "")


def run_one(config: SecurePipelineConfig, cell: str, side: str, seed: int) -> dict:
    start = time.perf_counter()
    run = run_config(config, cell, side, seed)
    summary = simulate_pipeline(run, progress=False)
    return {"cell": cell, "side": side, "seed": seed, **measure(run, summary, attackers(config, cell, side)),
            "wall_seconds": round(time.perf_counter() - start, 1)}


def runs_of(config: SecurePipelineConfig) -> list[tuple[str, str, int]]:
    cells = [c for c in config.cell_list() if c != "forge" or config.forge_available()]
    seeds = range(config.first_seed, config.first_seed + config.seeds)
    return [(cell, side, seed) for seed in seeds for cell in cells for side in config.side_list()]


def run_bench(config: SecurePipelineConfig, out: Path, log=print) -> list[dict]:
    """Every run of `config`, in `config.jobs` processes; rows are written to runs.csv as they come."""
    out.mkdir(parents=True, exist_ok=True)
    specs = runs_of(config)
    rows: list[dict] = []

    def keep(row: dict) -> None:
        rows.append(row)
        log(f"{row['cell']:>8} {row['side']:>6} seed {row['seed']}: loss {row['final_loss']:.4f}, banned [{row['banned']}] "
            f"of [{row['byzantine']}], {row['simulated_seconds']:.1f} sim s ({row['wall_seconds']:.0f} s)")
        rows.sort(key=lambda r: (r["seed"], CELLS.index(r["cell"]), SIDES.index(r["side"])))
        with open(out / "runs.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)

    jobs = config.jobs or os.cpu_count() or 1
    if jobs == 1:
        for spec in specs:
            keep(run_one(config, *spec))
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            for future in as_completed([pool.submit(run_one, config, *spec) for spec in specs]):
                keep(future.result())
    return rows


def read_rows(path: Path) -> list[dict]:
    """The rows of a runs.csv written by `run_bench` (finished runs only), with their types back."""
    numbers = {"seed": int, "final_loss": float, "honest_banned": int, "tampered": int, "finished": int, "slots": int,
               "simulated_seconds": float, "leaves": int, "joins": int, "wall_seconds": float}
    with open(path, newline="") as f:
        return [{**r, **{k: cast(r[k]) if r[k] != "" else None for k, cast in numbers.items() if k in r}, "exact": r["exact"] == "True"}
                for r in csv.DictReader(f)]


def _pct(value: float | None, reference: float | None) -> str:
    return "-" if value is None or not reference else f"{100 * (value / reference - 1):+.2f}"


def _lies(row: dict) -> str:
    return "?" if "tampered" not in row else "-" if row["tampered"] is None else str(row["tampered"])


def _ratio(value: float | None, reference: float | None) -> str:
    return "-" if value is None or not reference else f"{value / reference:.2f}"


def format_table(rows: list[dict], config: SecurePipelineConfig) -> str:
    """One line per (cell, seed): the secure run, then the plain run beside it; goals under the table."""
    by = {(r["cell"], r["side"], r["seed"]): r for r in rows}
    steps = config.steps or PIPELINE_PRESETS[config.preset]().steps
    lines = [
        f"secure pipeline: {config.preset}, {steps} iterations; link: {config.link_attack} by relay(s) {config.link_relays} "
        f"from {config.link_start}; protocol: {config.protocol_attack} by {config.protocol_relays} from {config.protocol_start}; "
        f"forge: {config.forge_attack} by {config.forge_relays} from {config.forge_start}"
        f"{'' if config.forge_available() else ' (not available: no protocol attack of that name)'}; "
        f"all: link + protocol at churn leave {config.leave_rate} / join {config.join_rate}"
        f"{' (its attackers stay: faults.stay)' if config.stay else ''}",
        "loss %: final loss against the clean run of the same side and seed (clean secure: against clean plain); "
        "x plain: simulated time over the plain run of the same cell; x clean: over the plain clean run; "
        "lies: tensors the link-attack relays tampered (0: the attacker was on no path; '-': no link attacker); "
        "retired: relays a stage retired (departed leaving a check unjudged: out for good, not banned); "
        "steps to ban 'out': a Byzantine relay retired before its attack began, 'idle': a link attacker that tampered "
        "no tensor (neither lied: counted as exact)",
        f"{'cell':>8} {'seed':>4} | {'loss %':>7} {'byz':>5} {'lies':>5} {'banned':>9} {'exact':>5} {'steps to ban':>12} "
        f"{'honest':>6} {'retired':>7} {'sim s':>7} {'x plain':>7} {'x clean':>7} | {'plain loss %':>12} {'lies':>5} {'banned':>7} {'sim s':>7}",
    ]
    for cell in CELLS:
        for seed in sorted({r["seed"] for r in rows}):
            s, p = by.get((cell, "secure", seed)), by.get((cell, "plain", seed))
            if s is None and p is None:
                continue
            cs, cp = by.get(("clean", "secure", seed)), by.get(("clean", "plain", seed))
            ref = cp if cell == "clean" else cs
            left = (f"{_pct(s['final_loss'], ref and ref['final_loss']):>7} {s['byzantine'] or '-':>5} {_lies(s):>5} {s['banned'] or '-':>9} "
                    f"{'yes' if s['exact'] else 'NO':>5} {s['steps_to_ban'] or '-':>12} {s['honest_banned']:>6} "
                    f"{s.get('retired') or '-':>7} "
                    f"{s['simulated_seconds']:>7.1f} {_ratio(s['simulated_seconds'], p and p['simulated_seconds']):>7} "
                    f"{_ratio(s['simulated_seconds'], cp and cp['simulated_seconds']):>7}") if s else f"{'-':>92}"
            right = (f"{_pct(p['final_loss'], cp and cp['final_loss']):>12} {_lies(p):>5} {p['banned'] or '-':>7} "
                     f"{p['simulated_seconds']:>7.1f}") if p else "-"
            lines.append(f"{cell:>8} {seed:>4} | {left} | {right}")
    lines.append("")
    lines += goals(rows)
    if "all" in config.cell_list():
        lines.append("plain 'all': the link attacker and churn only (a plain run carries one link-attack policy)")
        lines.append("churn of 'all', per seed: draws that acted (iteration:relay, secure/plain: R returned, L left, a leave "
                     "kept by S the stage rule, D one gone already; - nothing)")
        for seed in sorted({r["seed"] for r in rows}):
            s, p = by.get(("all", "secure", seed)), by.get(("all", "plain", seed))
            if s and p and s.get("churn") is not None and p.get("churn") is not None:
                lines.append(f"  seed {seed}: {churn_comparison(s['churn'], p['churn'])}")
    if "forge" in config.cell_list() and not config.forge_available():
        lines.append(f"forge: not run, no protocol attack named {config.forge_attack!r} yet (issue 18 item 2)")
    return "\n".join(lines)


def goals(rows: list[dict]) -> list[str]:
    """Issue 18's goals over the secure runs: exact bans, loss within 3 % of clean, no honest ban, <= 1.2x."""
    secure = [r for r in rows if r["side"] == "secure"]
    by = {(r["cell"], r["side"], r["seed"]): r for r in rows}
    missed = {"exact bans": [], "loss within 3 %": [], "no honest ban": [], "overhead <= 1.2x plain": []}
    for r in secure:
        name = f"{r['cell']}/{r['seed']}"
        clean = by.get(("clean", "secure", r["seed"]) if r["cell"] != "clean" else ("clean", "plain", r["seed"]))
        plain = by.get((r["cell"], "plain", r["seed"]))
        if not r["exact"]:
            missed["exact bans"].append(name)
        if clean and r["final_loss"] is not None and abs(r["final_loss"] / clean["final_loss"] - 1) > 0.03:
            missed["loss within 3 %"].append(name)
        if r["honest_banned"]:
            missed["no honest ban"].append(name)
        if plain and r["simulated_seconds"] > 1.2 * plain["simulated_seconds"]:
            missed["overhead <= 1.2x plain"].append(name)
    lines = [f"goal {goal}: {'met' if not cells else 'missed in ' + ', '.join(cells)}" for goal, cells in missed.items()]
    honest_out = [f"{r['cell']}/{r['seed']}: {' '.join(out)}" for r in secure
                  if (out := sorted(set((r.get("retired") or "").split()) - set(r["byzantine"].split())))]
    if honest_out:  # not bans (nothing proved them liars), but out of the run for good
        lines.append(f"honest relays retired (departed leaving a check unjudged): {', '.join(honest_out)}")
    return lines


def run_cli(args: argparse.Namespace) -> int:
    """`phalanx bench secure-pipeline --preset quick|full [--set seeds=1 --set jobs=2 ...]`."""
    config, out = bench_config(args, "secure-pipeline", PRESETS)
    rows = read_rows(out / "runs.csv") if config.read_only else run_bench(config, out)
    table = format_table(rows, config)
    (out / "table.txt").write_text(table + "\n")
    print(table)
    print(f"wrote {out / 'runs.csv'} and {out / 'table.txt'}")
    return 0
