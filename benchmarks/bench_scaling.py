"""Scaling efficiency of 2-worker MultiWorkerMirrored training on loopback, against a fair baseline.

Model: the ResNet-style conv net of examples/resnet_synthetic.py on synthetic
images, trained through `stratkit.Trainer`. The 2-worker job is what users run:
`stratkit.launch.launch(..., workers=2)` (TF_CONFIG, MultiWorkerMirrored,
ring all-reduce over gRPC on 127.0.0.1), one intra-op thread per worker, the
same per-replica batch as a single job.

Fair baseline: on one host the 2 workers share the cores, the memory bus and
the caches, so "2 workers vs 1 worker alone" mixes the cost of distribution
with the cost of contention. The baseline is therefore TWO INDEPENDENT
single-worker jobs (no TF_CONFIG, stratkit's one_device) running AT THE SAME
TIME with the same settings: both print READY after their warm-up epoch and
start their measured epochs together on the parent's GO; only epochs that end
before the first job finished count (so neither job ever runs alone).

    efficiency = examples/s(2-worker job) / (examples/s(job A) + examples/s(job B))   goal >= 0.97
    naive      = examples/s(2-worker job) / (2 x examples/s(one job alone))

Rates are steady state: per-epoch wall times from an epoch-level callback,
epoch 0 (tracing, connection set-up) excluded, median over the measured
epochs.

Rounds: one figure from one run cannot tell a 3% gain from noise on 2 shared
cores (the same job measured 0.89-1.02 in four rounds). So every row is
measured in each of >= 3 rounds (`--rounds`, default 3); a round runs every
setting's 2-worker job next to its baseline pair, and the order of settings
(and of the jobs inside a setting) alternates between rounds. A row's
efficiency is the mean over rounds of (2-worker rate / baseline pair rate of
the same round), shown with its min, max and standard deviation. The load
average is recorded before and after the run and around every job.

Rows measured by default: stratkit's defaults, and `gradient_compression`
"bf16" and "fp16" (2-worker job only: single jobs have no all-reduce, so the
default's pair of the same round is their baseline). Then the default and
"bf16" with the 2 workers on a rate-limited link: a private network
namespace whose loopback is shaped with tc to model nodes on 1 Gigabit
Ethernet (link.py); their baseline is again the default's pair of the same
round (single jobs send nothing over any link), and bf16's `vs default` is
against the default on the same link.

Knobs stratkit controls, one row each with `--variants all` (each vs the default, otherwise equal):
  * gradient packing: `Trainer(bytes_per_pack=...)` -> CommunicationOptions
    (0 = one pack for all gradients, TF's default);
  * threads: intra-op per worker (stratkit launch: cores // tasks = 1 here; 2
    oversubscribes the cores), inter-op (TF default = cores; 1 shown);
  * input prefetch: prefetch(AUTOTUNE) (what stratkit's input path adds) vs none.
Rows that change threads or prefetch get their own simultaneous baseline pair
(those settings apply to single jobs too); packing rows share the default's.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import link  # noqa: E402
from common import print_table, write_result  # noqa: E402
from jobs import TASKS, JobFailed, clean_env, python, run_barrier_group, thread_vars  # noqa: E402

GOAL = 0.97
TASK = TASKS / "scaling_task.py"

FULL = {"image": 32, "classes": 10, "width": 16, "blocks": [1, 1, 1, 1], "per_replica_batch": 32,
        "steps": 16, "epochs": 5, "examples_per_worker": 512}
QUICK = {"image": 16, "classes": 10, "width": 4, "blocks": [1, 1], "per_replica_batch": 8,
         "steps": 3, "epochs": 3, "examples_per_worker": 64}


@dataclass(frozen=True)
class Setting:
    name: str
    intra: int | None = 1
    inter: int | None = None      # None: TensorFlow's default (the number of cores)
    prefetch: bool = True
    bytes_per_pack: int = 0
    own_baseline: bool = True     # False: compare with the default's baseline pair (single jobs ignore it)
    gradient_compression: str | None = None
    link: str | None = None       # a link.LINKS name: the 2-worker job runs on a tc-shaped loopback
    reference: str | None = None  # `vs default` compares with this setting's 2-worker rate (None: DEFAULT)


DEFAULT = Setting("stratkit default (intra 1, inter TF default, prefetch AUTOTUNE, one pack)")
COMPRESSION = [
    Setting("gradient_compression='bf16'", gradient_compression="bf16", own_baseline=False),
    Setting("gradient_compression='fp16'", gradient_compression="fp16", own_baseline=False),
]
#: The same job on a 1 GbE link per node (link.py): where the gradient exchange is bandwidth-bound.
ON_LINK = [
    Setting("default on 1 GbE", link=link.GBE_1.name, own_baseline=False),
    Setting("gradient_compression='bf16' on 1 GbE", gradient_compression="bf16", link=link.GBE_1.name,
            own_baseline=False, reference="default on 1 GbE"),
]
VARIANTS = [
    *COMPRESSION,
    *ON_LINK,
    Setting("bytes_per_pack=256 KiB", bytes_per_pack=256 * 1024, own_baseline=False),
    Setting("bytes_per_pack=1 MiB", bytes_per_pack=1024 * 1024, own_baseline=False),
    Setting("intra-op 2 per worker (oversubscribed)", intra=2),
    Setting("inter-op 1 per worker", inter=1),
    Setting("no prefetch", prefetch=False),
]
DEFAULT_VARIANTS = [v.name for v in COMPRESSION + ON_LINK]
QUICK_VARIANTS = ["gradient_compression='bf16'", "default on 1 GbE"]


def _config(model: dict, setting: Setting, result: Path, barrier: bool) -> str:
    return json.dumps({**model, "prefetch": setting.prefetch, "bytes_per_pack": setting.bytes_per_pack,
                       "gradient_compression": setting.gradient_compression, "barrier": barrier,
                       "result": str(result)})


def _rates(record: dict, until: float | None = None) -> tuple[list[float], bool]:
    """examples/s of each measured epoch (epoch 0 excluded), only epochs ending by `until` when given."""
    epochs = record["epochs"][1:]
    examples = record["steps"] * record["global_batch"]
    kept = [e for e in epochs if until is None or e[1] <= until + 1e-6]
    ok = bool(kept)
    return [examples / (end - start) for start, end in (kept or epochs)], ok


def run_two_workers(model: dict, setting: Setting, timeout: float, work: Path) -> dict:
    from stratkit.launch import launch

    result = work / "two"
    env = clean_env(**thread_vars(setting.intra, setting.inter),
                    STRATKIT_BENCH_SCALING=_config(model, setting, result, barrier=False))
    load = os.getloadavg()
    started = time.monotonic()
    if setting.link is None:
        out = io.StringIO()
        outcome = launch([python(), str(TASK)], workers=2, env=env, timeout=timeout, stdout=out, stderr=out,
                         handle_signals=False)
        failed = None if outcome.ok else f"exit {outcome.returncode}:\n{outcome.report}\n{out.getvalue()[-3000:]}"
    else:
        on = link.LINKS[setting.link]
        done = link.run_shaped(link.launch_command([python(), str(TASK)], 2, timeout), on, env, timeout + 60)
        failed = None if done.returncode == 0 else f"exit {done.returncode} on {on.name}:\n{done.stdout[-3000:]}"
    wall = time.monotonic() - started
    if failed:
        raise JobFailed(f"2-worker job failed ({failed}")
    chief = json.loads(Path(f"{result}.0").read_text())
    rates, _ = _rates(chief)
    return {"examples_per_sec": statistics.median(rates), "per_epoch": rates,
            "steps_per_sec": statistics.median(rates) / chief["global_batch"], "wall_seconds": wall,
            "loadavg_before": load, "loadavg_after": os.getloadavg(), "strategy": chief["strategy"],
            "replicas": chief["replicas"], "global_batch": chief["global_batch"], "params": chief["params"],
            "gradient_bytes": chief["gradient_bytes"], "gradient_tensors": chief["gradient_tensors"],
            "threads": chief["threads"]}


def run_independent(model: dict, setting: Setting, count: int, timeout: float, work: Path) -> dict:
    """`count` single-worker jobs started together at a barrier; their summed steady-state examples/s."""
    results = [work / f"single{i}" for i in range(count)]
    envs = [clean_env(**thread_vars(setting.intra, setting.inter), STRATKIT_CLUSTER_ENV="none",
                      STRATKIT_BENCH_SCALING=_config(model, setting, results[i], barrier=True))
            for i in range(count)]
    load = os.getloadavg()
    started = time.monotonic()
    go = run_barrier_group([python(), str(TASK)], envs, timeout, [work / f"single{i}.log" for i in range(count)])
    wall = time.monotonic() - started
    records = [json.loads(Path(f"{r}.0").read_text()) for r in results]
    overlap_end = min(r["epochs"][-1][1] for r in records)
    jobs, overlapped = [], True
    for record in records:
        rates, ok = _rates(record, until=overlap_end)
        overlapped &= ok
        jobs.append({"examples_per_sec": statistics.median(rates), "per_epoch": rates,
                     "steps_per_sec": statistics.median(rates) / record["global_batch"],
                     "started_after_go": record["epochs"][1][0] - go})
    return {"examples_per_sec": sum(j["examples_per_sec"] for j in jobs), "jobs": jobs,
            "measured_together": overlapped, "wall_seconds": wall, "loadavg_before": load,
            "loadavg_after": os.getloadavg(), "strategy": records[0]["strategy"], "threads": records[0]["threads"]}


def measure(kind: str, model: dict, setting: Setting, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="stratkit-bench-scaling-") as tmp:
        try:
            if kind == "two_workers":
                return run_two_workers(model, setting, timeout, Path(tmp))
            return run_independent(model, setting, 2 if kind == "pair" else 1, timeout, Path(tmp))
        except JobFailed as exc:
            print(f"[bench_scaling] {setting.name} / {kind}: {str(exc)[:4000]}", file=sys.stderr, flush=True)
            return {"error": str(exc)[-4000:]}


def _rate(run: dict | None) -> float | None:
    return run.get("examples_per_sec") if run else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _stats(values: list[float | None]) -> dict:
    """Mean, min, max and standard deviation over the rounds that produced a figure."""
    got = [v for v in values if v is not None]
    if not got:
        return {"mean": None, "min": None, "max": None, "sd": None, "n": 0}
    return {"mean": statistics.fmean(got), "min": min(got), "max": max(got),
            "sd": statistics.stdev(got) if len(got) > 1 else 0.0, "n": len(got)}


def run_rounds(model: dict, settings: list[Setting], rounds: int, timeout: float) -> list[dict]:
    """Measure every setting in each round, alternating the order; returns one record per round."""
    records = []
    for r in range(rounds):
        order = settings if r % 2 == 0 else settings[::-1]
        record: dict = {"round": r, "loadavg_before": os.getloadavg(), "jobs": {}}
        for setting in order:
            kinds = ["two_workers"]
            if setting is settings[0] or setting.own_baseline:
                kinds.append("pair")
            if setting is settings[0]:
                kinds.append("alone")
            jobs = {kind: measure(kind, model, setting, timeout) for kind in (kinds if r % 2 == 0 else kinds[::-1])}
            record["jobs"][setting.name] = jobs
            print(f"[bench_scaling] round {r + 1}/{rounds} {setting.name}: "
                  + ", ".join(f"{k} {_rate(v) or float('nan'):.1f} ex/s" for k, v in jobs.items()), flush=True)
        record["loadavg_after"] = os.getloadavg()
        records.append(record)
    return records


def summarise(settings: list[Setting], records: list[dict]) -> list[dict]:
    """One row per setting: means over rounds of rates and of per-round efficiency, with the spread."""
    default = settings[0]
    rows = []
    for setting in settings:
        eff, naive, vs, two, pair, alone = [], [], [], [], [], []
        for record in records:
            jobs, base = record["jobs"][setting.name], record["jobs"][default.name]
            ref = record["jobs"].get(setting.reference) if setting.reference else base
            two_rate = _rate(jobs.get("two_workers"))
            pair_rate = _rate(jobs.get("pair")) if "pair" in jobs else _rate(base.get("pair"))
            two.append(two_rate)
            pair.append(pair_rate)
            eff.append(_ratio(two_rate, pair_rate))
            vs.append(_ratio(two_rate, _rate((ref or {}).get("two_workers"))))
            if setting is default:
                alone_rate = _rate(jobs.get("alone"))
                alone.append(alone_rate)
                naive.append(_ratio(two_rate, 2 * alone_rate if alone_rate else None))
        e = _stats(eff)
        rows.append({"setting": setting.name, "2-worker ex/s": _stats(two)["mean"], "pair ex/s": _stats(pair)["mean"],
                     "alone ex/s": _stats(alone)["mean"] if setting is default else None,
                     "efficiency": e["mean"], "eff min": e["min"], "eff max": e["max"], "eff sd": e["sd"],
                     "rounds": e["n"], "naive": _stats(naive)["mean"] if setting is default else None,
                     "vs default": _stats(vs)["mean"],
                     "vs": setting.reference or "default", "link": setting.link or "loopback",
                     "raw": {"setting": asdict(setting), "efficiency_per_round": eff, "vs_default_per_round": vs,
                             "baseline": "own pair" if setting is default or setting.own_baseline
                             else "default's pair of the same round",
                             "rounds": [record["jobs"][setting.name] for record in records]}})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    parser.add_argument("--rounds", "--repeats", dest="rounds", type=int, default=None,
                        help="alternating rounds, every row measured in each (default 3; 1 with --quick)")
    parser.add_argument("--variants", default=None,
                        help="comma-separated variant names to run, or 'all' (default: "
                             f"{', '.join(DEFAULT_VARIANTS)}; with --quick: {', '.join(QUICK_VARIANTS)})")
    args = parser.parse_args(argv)
    model = QUICK if args.quick else FULL
    rounds = args.rounds or (1 if args.quick else 3)
    timeout = 180.0 if args.quick else 300.0
    chosen = args.variants or ",".join(QUICK_VARIANTS if args.quick else DEFAULT_VARIANTS)
    variants = VARIANTS if chosen == "all" else [v for v in VARIANTS if v.name in chosen.split(",")]
    links_skipped = link.unavailable() if any(v.link for v in variants) else None
    if links_skipped:
        print(f"[bench_scaling] rows on a rate-limited link skipped: {links_skipped}", flush=True)
        variants = [v for v in variants if not v.link]
    started = time.monotonic()
    load_before = os.getloadavg()

    settings = [DEFAULT, *variants]
    records = run_rounds(model, settings, rounds, timeout)
    rows = summarise(settings, records)
    info = next((job for record in records for job in [record["jobs"][DEFAULT.name].get("two_workers") or {}]
                 if "params" in job), {})

    print_table(f"2-worker MultiWorkerMirrored vs two simultaneous single-worker jobs, mean of {rounds} alternating "
                f"round(s) (goal efficiency >= {GOAL})",
                [{k: ("-" if v is None else v) for k, v in row.items() if k != "raw"} for row in rows])
    load_after = os.getloadavg()
    print(f"load average (1, 5, 15 min): before {load_before}, after {load_after}")
    failed = [row["setting"] for row in rows if row["efficiency"] is None]
    if failed:
        print(f"no figure (a job failed; see stderr and the JSON): {', '.join(failed)}")
    payload = {"quick": args.quick, "model": {**model, "params": info.get("params"),
                                              "gradient_bytes": info.get("gradient_bytes"),
                                              "gradient_tensors": info.get("gradient_tensors")},
               "rounds": rounds, "repeats": rounds, "goal_efficiency": GOAL, "workers": 2,
               "links": {s.link: {"node_mbit": link.LINKS[s.link].node_mbit, "lo_mbit": link.LINKS[s.link].lo_mbit,
                                  "case": link.LINKS[s.link].case, "tc": link.shape_script(link.LINKS[s.link])}
                         for s in settings if s.link},
               "links_skipped": links_skipped,
               "loadavg_before": load_before, "loadavg_after": load_after,
               "definition": {"efficiency": "2-worker examples/s / sum of 2 simultaneous single jobs' examples/s, "
                                            "per round; the row shows the mean over rounds and its min/max/sd",
                              "naive": "2-worker examples/s / (2 x one single job alone)",
                              "rate": "median over epochs 1.. (epoch 0 = warm-up) of steps x global batch / epoch "
                                      "seconds",
                              "rounds": "every setting measured once per round; setting order reversed every "
                                        "other round"},
               "wall_seconds": time.monotonic() - started, "rows": rows}
    print(f"wrote {write_result('scaling' + ('-quick' if args.quick else ''), payload)}")
    headline_failed = rows[0]["efficiency"] is None
    if headline_failed:
        raise SystemExit("the headline configuration failed: no scaling figure")
    return payload


if __name__ == "__main__":
    main()
