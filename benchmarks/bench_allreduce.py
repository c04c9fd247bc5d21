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

Gradient list: the scaling benchmark's model's trainable variables (53
tensors, ~2 MB as float32 in the full run), all-reduced as one list per call
in float32, bfloat16 and float16, each call including the casts
`gradient_compression` adds (float32 -> wire dtype -> float32). The ratio
bf16/float32 is the communication time per step the option saves (goal <= 0.5).

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


def collective(sizes: list[int], quick: bool, timeout: float) -> dict:
    from stratkit.launch import launch

    with tempfile.TemporaryDirectory(prefix="stratkit-bench-allreduce-") as tmp:
        result = Path(tmp) / "result.json"
        config = {"sizes": [[s, iterations(s, quick)] for s in sizes], "result": str(result),
                  "model": {k: (QUICK_MODEL if quick else FULL_MODEL)[k]
                            for k in ("image", "classes", "width", "blocks")},
                  "dtypes": WIRE_DTYPES, "grad_rounds": 1 if quick else 4, "grad_iters": 3 if quick else 15}
        out = io.StringIO()
        started = time.monotonic()
        outcome = launch([python(), str(TASK)], workers=2, timeout=timeout, stdout=out, stderr=out,
                         env=clean_env(STRATKIT_BENCH_ALLREDUCE=json.dumps(config)), handle_signals=False)
        if not outcome.ok or not result.exists():
            raise SystemExit(f"all-reduce benchmark failed (exit {outcome.returncode}):\n{outcome.report}\n"
                             f"{out.getvalue()[-4000:]}")
        data = json.loads(result.read_text())
        data["wall_seconds"] = time.monotonic() - started
        return data


def gradient_table(gradients: list[dict]) -> list[dict]:
    """One row per wire dtype: median time of the gradient list's all-reduce, and its ratio to float32."""
    base = next((statistics.median(g["seconds"]) for g in gradients if g["dtype"] == "float32"), None)
    rows = []
    for g in gradients:
        t = statistics.median(g["seconds"])
        q1, _, q3 = statistics.quantiles(g["seconds"], n=4) if len(g["seconds"]) > 1 else (t, t, t)
        rows.append({"dtype": g["dtype"], "compression": {"float32": "None", "bfloat16": "'bf16'",
                                                          "float16": "'fp16'"}.get(g["dtype"], "?"),
                     "tensors": g["tensors"], "MB on wire": g["bytes_on_wire"] / 1e6, "time_ms": t * 1e3,
                     "q1_ms": q1 * 1e3, "q3_ms": q3 * 1e3, "vs float32": t / base if base else None,
                     "max rel error": g["max_relative_error"], "calls": len(g["seconds"]), "seconds": g["seconds"]})
    return rows


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    args = parser.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    started = time.monotonic()
    load = os.getloadavg()

    tcp_before = tcp_loopback(sizes, args.quick)
    reduce = collective(sizes, args.quick, timeout=120.0 if args.quick else 600.0)
    tcp_after = tcp_loopback(sizes, args.quick)

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
    gradient_rows = gradient_table(reduce.get("gradients", []))
    if gradient_rows:
        print_table(f"Gradient list of the scaling model, one all-reduce per step, by wire dtype "
                    f"(gradient_compression; goal bf16/float32 <= {GRADIENT_GOAL})",
                    [{k: v for k, v in row.items() if k != "seconds"} for row in gradient_rows])
        ratio = next((r["vs float32"] for r in gradient_rows if r["dtype"] == "bfloat16"), None)
        if ratio is not None:
            print(f"communication per step, bf16 / float32 = {ratio:.3f} "
                  f"(goal <= {GRADIENT_GOAL}: {'met' if ratio <= GRADIENT_GOAL else 'not met'})")
    payload = {"quick": args.quick, "workers": n, "gradient_rows": gradient_rows, "gradient_goal": GRADIENT_GOAL,
               "bf16_over_float32": next((r["vs float32"] for r in gradient_rows if r["dtype"] == "bfloat16"), None),
               "strategy": reduce["strategy"], "threads": reduce["threads"],
               "bus_factor": factor, "tcp_bandwidth_Bps": tcp_bandwidth, "tcp_peak_from_bytes": PEAK_FROM,
               "tcp_before": tcp_before, "tcp_after": tcp_after, "rows": rows,
               "peak_busbw_MBps": max(r["busbw_MBps"] for r in rows),
               "peak_busbw_over_tcp": max(r["busbw/TCP"] for r in rows),
               "definition": {"algbw": "bytes / median seconds per all-reduce", "busbw": "algbw * 2(n-1)/n",
                              "bound": "(S/B) * 2(n-1)/n with B = tcp_bandwidth_Bps"},
               "loadavg_before": load, "loadavg_after": os.getloadavg(),
               "wall_seconds": time.monotonic() - started}
    if not all(r["correct"] for r in rows):
        print("WARNING: an all-reduce returned a wrong sum", file=sys.stderr)
    print(f"wrote {write_result('allreduce' + ('-quick' if args.quick else ''), payload)}")
    return payload


if __name__ == "__main__":
    main()
