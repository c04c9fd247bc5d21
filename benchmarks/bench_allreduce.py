"""All-reduce bus bandwidth of MultiWorkerMirrored (2 workers, loopback) vs loopback TCP in the same run.

Collective: 2 worker processes started by `stratkit.launch.launch(workers=2)`
(stratkit's thread defaults: one intra-op thread each on 2 cores), strategy from
`stratkit.make_strategy()` (MultiWorkerMirrored, ring all-reduce over gRPC),
`replica_context.all_reduce(SUM, x)` in a tf.function on one float32 tensor of
S bytes, S from 1 KiB to 100 MiB; per size, warm-up, then each call timed
(median reported). As nccl-tests defines them:

    algbw = S / t            busbw = algbw * 2(n-1)/n   (n = 2 workers: busbw = algbw)

TCP: the same host's loopback, measured in this run both before and after the
collective: one receiver process, this process sending S bytes with sendall
and waiting for a 1-byte acknowledgement (one-way, single stream, the same
sizes). B = the median one-way bandwidth over the transfers of >= 16 MiB.

Gradient lists: the trainable variables of (a) the scaling benchmark's model
(53 tensors, 0.5 M values, 2 MB as float32 in the full run) and (b) a large
dense MLP (1024 -> 2048 -> 2048 -> 1024 -> 10: 8 tensors, 8.4 M values,
34 MB), each all-reduced as one list per call in float32, bfloat16 and
float16, each call including the casts `gradient_compression` adds (float32
-> wire dtype -> float32). Dtypes alternate order over 4 rounds; a row's
`vs float32` is the mean over rounds of the per-round median ratio, with its
min and max. The ratio bf16/float32 is the communication time per step the
option saves (goal <= 0.5).

Links: both lists on plain loopback (CPU- and latency-bound: this machine
moves bytes between two processes far faster than a network), and on a
rate-limited link: the 2 workers in a private network namespace whose `lo`
is shaped with tc (link.py), modelling nodes on 1 GbE and on 2.5 GbE. A
one-way TCP transfer inside each shaped namespace checks the rate in force.
`--links none` skips them; where user namespaces or tc are missing they are
skipped with the reason printed and stored.

Anchor (nccl-tests): an all-reduce of S bytes over links of bandwidth B takes
at least (S/B) * 2(n-1)/n, i.e. busbw <= B. busbw/B is the fraction of the
link the collective reaches (1.0 = at the bound). Caveat: the ring sends in
both directions at once, and on loopback both directions share the same cores
as the copies themselves, so B (one direction alone) is an optimistic link.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import link  # noqa: E402
from common import print_table, write_result  # noqa: E402
from jobs import TASKS, clean_env, kill_all, python  # noqa: E402
from bench_scaling import FULL as FULL_MODEL, QUICK as QUICK_MODEL  # noqa: E402

TASK = TASKS / "allreduce_task.py"
KIB, MIB = 1024, 1024 * 1024
FULL_SIZES = [KIB, 4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB, 100 * MIB]
QUICK_SIZES = [KIB, 64 * KIB, MIB, 16 * MIB]
PEAK_FROM = 16 * MIB
WIRE_DTYPES = ["float32", "bfloat16", "float16"]
GRADIENT_GOAL = 0.5  # bf16 time / float32 time
SCALING_LIST = "scaling model"
DENSE_LIST = "dense MLP"
#: A large dense model: 1024 inputs -> 2048 -> 2048 -> 1024 -> 10, 8.4 M float32 values (34 MB of gradients).
DENSE_FULL = {"kind": "dense", "inputs": 1024, "hidden": [2048, 2048, 1024], "classes": 10}
DENSE_QUICK = {"kind": "dense", "inputs": 64, "hidden": [128], "classes": 10}
#: The rate-limited links measured (see link.py): 1 GbE and 2.5 GbE per node. 10 GbE would need lo at
#: 20 Gbit/s, more than loopback TCP itself moves on 2 shared cores, so it would measure the CPU again.
FULL_LINKS = [link.GBE_1, link.GBE_2_5]
QUICK_LINKS = [link.GBE_1]
TCP_CHECK_SIZES = [16 * MIB, 64 * MIB]
QUICK_TCP_CHECK_SIZES = [4 * MIB]

RECEIVER = r"""
import socket, struct, sys
size = int(sys.argv[1])
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", 0))
server.listen(1)
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
view = memoryview(bytearray(size))
def exactly(n):
    got = 0
    while got < n:
        k = conn.recv_into(view[got:n])
        if not k:
            sys.exit(0)
        got += k
while True:
    exactly(8)
    n = struct.unpack("!Q", view[:8])[0]
    if n == 0:
        break
    exactly(n)
    conn.sendall(b"k")
"""


def iterations(size: int, quick: bool) -> int:
    """Enough calls to time small sizes well, few for the large ones (bounded bytes per size)."""
    if quick:
        return 3
    return max(5, min(100, (256 * MIB) // size))


def tcp_loopback(sizes: list[int], quick: bool) -> list[dict]:
    """One-way loopback TCP: per size, the median time to deliver S bytes and get a 1-byte ack."""
    receiver = subprocess.Popen([python(), "-c", RECEIVER, str(max(sizes))], stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        port = int(receiver.stdout.readline())
        sender = socket.create_connection(("127.0.0.1", port))
        sender.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = memoryview(bytearray(max(sizes)))
        results = []
        for size in sizes:
            times = []
            for i in range(2 + iterations(size, quick)):
                start = time.perf_counter()
                sender.sendall(struct.pack("!Q", size))
                sender.sendall(payload[:size])
                if sender.recv(1) != b"k":
                    raise RuntimeError("the TCP receiver stopped")
                if i >= 2:  # the first two warm the socket buffers
                    times.append(time.perf_counter() - start)
            results.append({"bytes": size, "seconds": times, "median_seconds": statistics.median(times),
                            "bandwidth": size / statistics.median(times)})
        sender.sendall(struct.pack("!Q", 0))
        sender.close()
        receiver.wait(timeout=30)
        return results
    finally:
        kill_all([receiver])


def gradient_lists(quick: bool) -> list[dict]:
    """The gradient lists timed per wire dtype: the scaling model's and a large dense model's."""
    scaling = {k: (QUICK_MODEL if quick else FULL_MODEL)[k] for k in ("image", "classes", "width", "blocks")}
    rounds = 2 if quick else 4
    return [{"name": SCALING_LIST, "kind": "resnet", **scaling, "dtypes": WIRE_DTYPES, "rounds": rounds,
             "iters": 2 if quick else 15},
            {"name": DENSE_LIST, **(DENSE_QUICK if quick else DENSE_FULL), "dtypes": WIRE_DTYPES, "rounds": rounds,
             "iters": 2 if quick else 5}]


def collective(sizes: list[int], lists: list[dict], quick: bool, timeout: float,
               on: link.Link | None = None) -> dict:
    """The all-reduce task on 2 workers: on plain loopback (launched here), or `on` a shaped link."""
    from stratkit.launch import launch

    with tempfile.TemporaryDirectory(prefix="stratkit-bench-allreduce-") as tmp:
        result = Path(tmp) / "result.json"
        config = {"sizes": [[s, iterations(s, quick)] for s in sizes], "result": str(result), "lists": lists}
        env = clean_env(STRATKIT_BENCH_ALLREDUCE=json.dumps(config))
        started = time.monotonic()
        if on is None:
            out = io.StringIO()
            outcome = launch([python(), str(TASK)], workers=2, timeout=timeout, stdout=out, stderr=out, env=env,
                             handle_signals=False)
            ok, why = outcome.ok, f"exit {outcome.returncode}:\n{outcome.report}\n{out.getvalue()[-4000:]}"
        else:
            done = link.run_shaped(link.launch_command([python(), str(TASK)], 2, timeout), on, env, timeout + 60)
            ok, why = done.returncode == 0, f"exit {done.returncode} on {on.name}:\n{done.stdout[-4000:]}"
        if not ok or not result.exists():
            raise SystemExit(f"all-reduce benchmark failed ({why}")
        data = json.loads(result.read_text())
        data["wall_seconds"] = time.monotonic() - started
        return data


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4)
    return q1, q3


def gradient_table(gradients: list[dict], on: link.Link | None = None) -> list[dict]:
    """One row per (list, wire dtype): median time per call, and its ratio to float32 per round with the spread.

    `vs float32` is the mean over rounds of (this dtype's median call / float32's median call in
    the same round); min/max are over the rounds. On a shaped link, `link bound_ms` is the
    least time the link allows: with 2 workers each node sends the whole list once
    (S * 2(n-1)/n = S) at the node's rate.
    """
    rows = []
    for g in gradients:
        base = next(b for b in gradients if b["list"] == g["list"] and b["dtype"] == "float32")
        flat = [t for r in g["round_seconds"] for t in r]
        ratios = [statistics.median(mine) / statistics.median(theirs)
                  for mine, theirs in zip(g["round_seconds"], base["round_seconds"])]
        t = statistics.median(flat)
        q1, q3 = _quartiles(flat)
        rows.append({"list": g["list"], "link": on.name if on else "loopback", "dtype": g["dtype"],
                     "compression": {"float32": "None", "bfloat16": "'bf16'", "float16": "'fp16'"}.get(g["dtype"], "?"),
                     "tensors": g["tensors"], "values": g["values"], "MB on wire": g["bytes_on_wire"] / 1e6,
                     "time_ms": t * 1e3, "q1_ms": q1 * 1e3, "q3_ms": q3 * 1e3,
                     "link bound_ms": g["bytes_on_wire"] / on.node_bytes_per_s * 1e3 if on else None,
                     "vs float32": statistics.fmean(ratios), "vs min": min(ratios), "vs max": max(ratios),
                     "rounds": len(ratios), "max rel error": g["max_relative_error"], "calls": len(flat),
                     "seconds": flat, "round_seconds": g["round_seconds"]})
    return rows


def tcp_check(on: link.Link, sizes: list[int], quick: bool) -> list[dict]:
    """One-way TCP inside a namespace shaped to `on`: proves the rate limit is in force (expect ~2L)."""
    done = link.run_shaped([python(), str(Path(__file__).resolve()), *(["--quick"] if quick else []),
                            "--tcp-only", *map(str, sizes)], on, clean_env(), 300)
    if done.returncode != 0:
        raise SystemExit(f"TCP check on {on.name} failed (exit {done.returncode}):\n{done.stdout[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def shaped_links(links: list[link.Link], quick: bool, timeout: float) -> tuple[list[dict], list[dict]]:
    """The gradient lists on each rate-limited link: (gradient rows, one record per link with TCP and load)."""
    why = link.unavailable()
    if why:
        print(f"rate-limited links skipped: {why}", flush=True)
        return [], [{"link": on.name, "skipped": why} for on in links]
    rows, records = [], []
    for on in links:
        load = os.getloadavg()
        started = time.monotonic()
        tcp = tcp_check(on, QUICK_TCP_CHECK_SIZES if quick else TCP_CHECK_SIZES, quick)
        reduce = collective([], gradient_lists(quick), quick, timeout, on=on)
        rows += gradient_table(reduce["gradients"], on)
        records.append({"link": on.name, "node_mbit": on.node_mbit, "lo_mbit": on.lo_mbit, "case": on.case,
                        "tc": link.shape_script(on), "tcp_one_way": tcp,
                        "tcp_one_way_MBps": statistics.median(r["bandwidth"] for r in tcp) / 1e6,
                        "loadavg_before": load, "loadavg_after": os.getloadavg(),
                        "wall_seconds": time.monotonic() - started})
    return rows, records


def print_gradient_rows(rows: list[dict]) -> None:
    print_table(f"Gradient lists, one all-reduce per step, by wire dtype (gradient_compression); 'vs float32' = "
                f"mean over rounds of the per-round median ratio (goal bf16 <= {GRADIENT_GOAL})",
                [{k: ("-" if v is None else v) for k, v in row.items()
                  if k not in ("seconds", "round_seconds", "compression")} for row in rows])


def ratio_of(rows: list[dict], list_name: str, on: str, dtype: str = "bfloat16") -> float | None:
    return next((r["vs float32"] for r in rows if r["list"] == list_name and r["link"] == on and r["dtype"] == dtype),
                None)


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    parser.add_argument("--links", default=None,
                        help="comma-separated rate-limited links to measure the gradient lists on ("
                             f"{', '.join(link.LINKS)}), or 'none' (default: all; with --quick: 1 GbE)")
    parser.add_argument("--tcp-only", nargs="*", type=int, default=None, metavar="BYTES",
                        help=argparse.SUPPRESS)  # link.py's check, run inside a shaped namespace
    args = parser.parse_args(argv)
    if args.tcp_only is not None:
        print(json.dumps(tcp_loopback(args.tcp_only, args.quick)))
        return {}
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    if args.links is None:
        links = QUICK_LINKS if args.quick else FULL_LINKS
    else:
        links = [link.LINKS[name] for name in args.links.split(",") if name != "none"]
    timeout = 120.0 if args.quick else 600.0
    started = time.monotonic()
    load = os.getloadavg()

    tcp_before = tcp_loopback(sizes, args.quick)
    reduce = collective(sizes, gradient_lists(args.quick), args.quick, timeout)
    tcp_after = tcp_loopback(sizes, args.quick)
    load_loopback = os.getloadavg()
    shaped_rows, shaped = shaped_links(links, args.quick, timeout)

    peak_samples = [size / t for run in (tcp_before, tcp_after) for r in run if r["bytes"] >= PEAK_FROM
                    for size, t in [(r["bytes"], s) for s in r["seconds"]]]
    tcp_bandwidth = statistics.median(peak_samples)
    n = reduce["workers"]
    factor = 2 * (n - 1) / n
    rows = []
    for r, before, after in zip(reduce["results"], tcp_before, tcp_after):
        t = statistics.median(r["seconds"])
        algbw = r["bytes"] / t
        busbw = algbw * factor
        tcp_same = statistics.median([before["bandwidth"], after["bandwidth"]])
        rows.append({"size": _size(r["bytes"]), "bytes": r["bytes"], "iters": r["iters"], "time_ms": t * 1e3,
                     "algbw_MBps": algbw / 1e6, "busbw_MBps": busbw / 1e6,
                     "tcp_same_size_MBps": tcp_same / 1e6, "busbw/TCP": busbw / tcp_bandwidth,
                     "bound_ms": r["bytes"] / tcp_bandwidth * factor * 1e3, "correct": r["correct"],
                     "seconds": r["seconds"]})
    print_table(f"MWMS all-reduce, {n} workers on loopback; TCP loopback B = {tcp_bandwidth / 1e6:,.0f} MB/s "
                f"(bound: t >= S/B * 2(n-1)/n)",
                [{k: v for k, v in row.items() if k not in ("bytes", "seconds")} for row in rows])
    all_gradient_rows = gradient_table(reduce.get("gradients", [])) + shaped_rows
    print_gradient_rows(all_gradient_rows)
    for record in shaped:
        if "skipped" not in record:
            print(f"{record['link']}: lo shaped to {record['lo_mbit']} Mbit/s (2 x {record['node_mbit']} Mbit/s per "
                  f"node); one TCP stream inside measured {record['tcp_one_way_MBps']:,.0f} MB/s; load "
                  f"{record['loadavg_before'][0]:.2f} -> {record['loadavg_after'][0]:.2f}")
    ratios = {f"{name} @ {on}": ratio_of(all_gradient_rows, name, on)
              for name in (SCALING_LIST, DENSE_LIST) for on in ["loopback", *(lk.name for lk in links)]}
    for key, ratio in ratios.items():
        if ratio is not None:
            print(f"communication per step, bf16 / float32, {key} = {ratio:.3f} "
                  f"(goal <= {GRADIENT_GOAL}: {'met' if ratio <= GRADIENT_GOAL else 'not met'})")
    gradient_rows = [r for r in all_gradient_rows if r["list"] == SCALING_LIST and r["link"] == "loopback"]
    payload = {"quick": args.quick, "workers": n, "gradient_rows": gradient_rows, "gradient_goal": GRADIENT_GOAL,
               "bf16_over_float32": ratio_of(all_gradient_rows, SCALING_LIST, "loopback"),
               "gradient_sets": all_gradient_rows, "bf16_over_float32_by": ratios, "links": shaped,
               "gradient_lists": gradient_lists(args.quick),
               "strategy": reduce["strategy"], "threads": reduce["threads"],
               "bus_factor": factor, "tcp_bandwidth_Bps": tcp_bandwidth, "tcp_peak_from_bytes": PEAK_FROM,
               "tcp_before": tcp_before, "tcp_after": tcp_after, "rows": rows,
               "peak_busbw_MBps": max(r["busbw_MBps"] for r in rows),
               "peak_busbw_over_tcp": max(r["busbw/TCP"] for r in rows),
               "definition": {"algbw": "bytes / median seconds per all-reduce", "busbw": "algbw * 2(n-1)/n",
                              "bound": "(S/B) * 2(n-1)/n with B = tcp_bandwidth_Bps",
                              "vs float32": "mean over alternating rounds of the per-round median time ratio "
                                            "(dtype / float32), with min and max over the rounds"},
               "loadavg_before": load, "loadavg_after_loopback": load_loopback, "loadavg_after": os.getloadavg(),
               "wall_seconds": time.monotonic() - started}
    if not all(r["correct"] for r in rows):
        print("WARNING: an all-reduce returned a wrong sum", file=sys.stderr)
    print(f"wrote {write_result('allreduce' + ('-quick' if args.quick else ''), payload)}")
    return payload


if __name__ == "__main__":
    main()
