"""W4 against TensorFlow's ParameterServerStrategy, alternated in one session.

Each round runs pstrain's W4 (``train_embedding.py``: 2 ps, 2 workers, 1,000 steps) and
TensorFlow's (``../shared/anchors/tf_ps.py --workload W4 --repeats 1``, a real TF cluster
on 127.0.0.1), the first of the two alternating from round to round, so that neither
always runs while the machine is faster. Medians over the rounds, and the ratio of the
medians, go to ``results/W4-tf-session.jsonl`` (TensorFlow's own lines too, as it prints
them); ``results/W4-tf-session.png`` plots each round of both.

TensorFlow runs in its own virtual environment, made once per machine as
``../shared/anchors/README.md`` says::

    TFENV="$(python3 -c 'import tempfile; print(tempfile.gettempdir())')/anc/tf"
    python3 -m venv "$TFENV" && "$TFENV/bin/pip" install -q tensorflow-cpu==2.21.0
    python benchmarks/against_tf.py --tf-python "$TFENV/bin/python" [--rounds 3]

``make bench TF_PYTHON="$TFENV/bin/python"`` runs it with the other workloads.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pstrain

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, emit, median, peer_run, peer_version, plot_rounds  # noqa: E402
from train_embedding import run as run_w4  # noqa: E402

ANCHOR = Path(__file__).resolve().parents[2] / "shared" / "anchors" / "tf_ps.py"
SETUP = (
    'python3 -m venv "$TFENV" && "$TFENV/bin/pip" install -q tensorflow-cpu==2.21.0 '
    "(../shared/anchors/README.md)"
)


def check_tf(python: str, anchor: Path) -> str:
    """TensorFlow's version in ``python``; a clear error if that interpreter or the anchor
    script is not there, or has no TensorFlow."""
    if not anchor.is_file():
        raise SystemExit(f"against_tf: the anchor script {anchor} is not there (--anchor PATH)")
    return peer_version(python, "tensorflow", "TensorFlow", "against_tf: --tf-python", SETUP)


def tf_round(python: str, anchor: Path, steps: int) -> dict:
    """One TensorFlow W4 run: its repeat line (examples/s, held-out loss, ...), every line it
    printed appended to results/W4-tf-session.jsonl as it printed them."""
    cmd = [
        python,
        str(anchor),
        "--workload",
        "W4",
        "--workers",
        "2",
        "--ps",
        "2",
        "--repeats",
        "1",
        "--steps",
        str(steps),
    ]
    return peer_run(cmd, "against_tf: TensorFlow's W4", "W4-tf-session.jsonl", timeout=1800)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tf-python", required=True, help="the Python of a virtual environment with tensorflow-cpu 2.21"
    )
    parser.add_argument("--anchor", type=Path, default=ANCHOR, help="tf_ps.py (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1000, help="W4 steps of each run (both systems)")
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 100:
        parser.error("--rounds must be at least 1 and --steps at least 100")
    version = check_tf(args.tf_python, args.anchor)
    ours: list[dict] = []
    theirs: list[dict] = []
    for i in range(args.rounds):
        for system in ("pstrain", "tf") if i % 2 == 0 else ("tf", "pstrain"):
            if system == "pstrain":
                ours.append(pstrain.run(run_w4(args.steps, 2, 2)))
            else:
                theirs.append(tf_round(args.tf_python, args.anchor, args.steps))
            print(f"round {i + 1}/{args.rounds}: {system} done", file=sys.stderr, flush=True)
    os.environ["PSTRAIN_BENCH_TAG"] = "tf-session"  # emit: results/W4-tf-session.jsonl
    p = [r["examples_per_s"] for r in ours]
    t = [r["examples_per_s"] for r in theirs]
    emit(
        {
            "workers": 2,
            "ps": 2,
            "metric": "examples_per_s",
            "value": round(median(p), 1),
            "examples_per_s_each_round": [round(x) for x in p],
            "held_out_log_loss": round(median([r["held_out_log_loss"] for r in ours]), 4),
            "tf_version": version,
            "tf_examples_per_s": round(median(t), 1),
            "tf_examples_per_s_each_round": [round(x) for x in t],
            "tf_held_out_log_loss": round(median([r["heldout_logloss"] for r in theirs]), 4),
            "ratio_to_tf": round(median(p) / median(t), 3),
            "rounds": args.rounds,
            "steps": args.steps,
            "batch": 512,
            "note": "W4 against TensorFlow's ParameterServerStrategy, alternated in one session",
        },
        "W4",
    )
    plot_rounds(
        RESULTS / "W4-tf-session.png",
        {"pstrain": p, f"TensorFlow {version} PS": t},
        f"W4, 2 ps + 2 workers, alternated in one session: {median(p) / median(t):.2f}x TensorFlow (medians)",
    )


if __name__ == "__main__":
    main()
