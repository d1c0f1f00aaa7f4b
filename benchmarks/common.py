"""Shared pieces of the benchmark suite: result lines, the raw-TCP limit, plots.

Every workload prints one JSON object per measurement and appends it to
``benchmarks/results/<workload>.jsonl``; figures are medians. The limit a
transfer is compared with (raw TCP between two processes on loopback, into a
reused buffer) is measured in the same run, because this machine's loopback
speed varies by 2x across an hour.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pstrain

RESULTS = Path(__file__).resolve().parent / "results"


def emit(record: dict[str, Any], workload: str) -> None:
    """Print a result line and append it to results/<workload>.jsonl (with
    ``PSTRAIN_BENCH_TAG=t`` set, to results/<workload>-t.jsonl: runs of a comparison)."""
    line = {
        "workload": workload,
        "system": "pstrain",
        "version": pstrain.__version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **record,
    }
    text = json.dumps(line)
    print(text, flush=True)
    RESULTS.mkdir(exist_ok=True)
    tag = os.environ.get("PSTRAIN_BENCH_TAG")
    with open(RESULTS / f"{workload}{'-' + tag if tag else ''}.jsonl", "a", encoding="utf-8") as f:
        f.write(text + "\n")


_TICK = os.sysconf("SC_CLK_TCK")


def stat_cpu_seconds(path: str) -> float:
    """User + system CPU seconds so far of the process or thread whose ``/proc`` stat file
    is ``path`` (0 if it has ended)."""
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0.0


def machine_cpu() -> tuple[float, float]:
    """(busy, all) CPU seconds of the whole machine so far (/proc/stat), summed over cores."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:8]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields) - idle) / _TICK, sum(fields) / _TICK


def peer_version(python: str, module: str, name: str, who: str, how: str) -> str:
    """``module.__version__`` in the peer's interpreter ``python`` (``name``: TensorFlow,
    TorchRec), or a clear error before anything is measured: ``who`` names the script and
    its flag, ``how`` says how to make that interpreter."""
    try:
        probe = subprocess.run(
            [python, "-c", f"import {module}; print({module}.__version__)"],
            capture_output=True,
            text=True,
            timeout=300,
            env={"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "/usr/bin:/bin"},
        )
    except OSError as exc:
        raise SystemExit(f"{who} {python!r} cannot be run ({exc}); make it with {how}") from None
    if probe.returncode:
        why = (probe.stderr.strip().splitlines() or [f"exit {probe.returncode}"])[-1]
        raise SystemExit(f"{who} {python!r} has no {name} ({why}); make it with {how}")
    return probe.stdout.strip()


def peer_run(cmd: list[str], who: str, results: str, timeout: float = 3600) -> dict[str, Any]:
    """Run a peer's anchor script once: its repeat line (examples/s, held-out loss ...), every
    line it printed appended to ``results/<results>`` as it printed them."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    runs = [x for x in lines if "repeat" in x and "examples_per_s" in x]
    if done.returncode or not runs:
        raise SystemExit(
            f"{who} failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / results, "a", encoding="utf-8") as f:
        for x in lines:
            f.write(json.dumps(x) + "\n")
    return runs[0]


def one_thread_run(script: str, args: list[str], who: str) -> dict[str, Any]:
    """The last JSON line of ``script args`` run in a process whose BLAS and OpenMP use one
    thread (a compute alone, measured as one core of a step's work)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, script, *args], capture_output=True, text=True, timeout=1800, env=env
    )
    if done.returncode:
        raise SystemExit(f"{who} failed:\n{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def _tcp_sink(port_q: Any, size: int) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(size))
    while True:
        got = 0
        while got < size:
            n = conn.recv_into(buf[got:])
            if not n:
                return
            got += n
        conn.sendall(b"k")


def raw_tcp_mib_s(size: int, repeats: int = 20) -> float:
    """Median MiB/s of sending ``size`` bytes to another process over loopback TCP."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_tcp_sink, args=(q, size), daemon=True)
    proc.start()
    try:
        conn = socket.create_connection(("127.0.0.1", q.get(timeout=30)))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        data = memoryview(bytearray(os.urandom(1024)) * (size // 1024 or 1))[:size]
        times = []
        for _ in range(repeats + max(1, repeats // 10)):
            t = time.perf_counter()
            conn.sendall(data)
            conn.recv(1)
            times.append(time.perf_counter() - t)
        conn.close()
        times = times[max(1, repeats // 10) :]
        return size / (1 << 20) / median(times)
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()


def plot(
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    series: dict[str, tuple[list, list]],
    logx: bool = False,
    hline: tuple[str, float] | None = None,
    points: bool = False,
) -> None:
    """A line plot of ``series`` (label -> (xs, ys)) saved as PNG; ``points``: markers only
    (separate runs, which a line would wrongly join)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", linestyle="none" if points else "-", label=label)
    if hline is not None:
        ax.axhline(hline[1], color="grey", linestyle="--", label=hline[0])
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def plot_rounds(path: Path, series: dict[str, list[float]], title: str) -> None:
    """Each system's examples/s, round by round, as bars side by side from 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    width = 0.8 / len(series)
    for k, (label, values) in enumerate(series.items()):
        xs = [i + 1 + (k - (len(series) - 1) / 2) * width for i in range(len(values))]
        ax.bar(xs, values, width=width, label=label)
    ax.set_xticks(list(range(1, max(len(v) for v in series.values()) + 1)))
    ax.set_title(title)
    ax.set_xlabel("round")
    ax.set_ylabel("examples/s")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="lower right")
    save_figure(fig, path)


def save_figure(fig: Any, path: Path) -> None:
    """Lay ``fig`` out, write it as PNG to ``path`` and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)
