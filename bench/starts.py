"""What a `python -m pdserve` start costs spawned afresh and forked from the tests' fork server (pdserve/forkserver.py).

Each round starts one instance (a tiny Llama, `pdserve serve`) and one gateway (`pdserve gateway` in front of it),
once spawned and once forked, in an order that rotates between rounds, through `pdserve.launcher` as the tests do.
Measured: the wall time from the call to the ready line (the client's clock) and the started process's own CPU
seconds up to its ready line (utime + stime from /proc, read as the call returns). Prints medians and forked/spawned
ratios.

    .venv/bin/python bench/starts.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import harness as H  # noqa: E402

from pdserve.forkserver import ENV_VAR, ForkedChild  # noqa: E402
from pdserve.launcher import Process, start, start_command, start_instance  # noqa: E402
from pdserve.modelgen import make_text_model  # noqa: E402

SMALL = ("--num-kv-blocks", "64", "--max-model-len", "256", "--log-level", "warning")


def timed(launch, forked: bool) -> tuple[float, float, Process]:
    begin = time.monotonic()
    proc = launch()
    wall, cpu = time.monotonic() - begin, H.cpu_seconds(proc.pid)
    if isinstance(proc.popen, ForkedChild) != forked:
        proc.stop()
        raise SystemExit(f"{proc.name} was {'spawned' if forked else 'forked'}, not as asked")
    return wall, cpu, proc


def one_round(model: Path, socket_path: str, order: list[str]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for how in order:
        if how == "forked":
            os.environ[ENV_VAR] = socket_path
        else:
            os.environ.pop(ENV_VAR, None)
        wall, cpu, inst = timed(lambda: start_instance(model, *SMALL, name="inst"), how == "forked")
        try:
            out[f"instance {how}"] = {"wall_s": wall, "cpu_s": cpu}
            gw_args = ["gateway", "--port", "0", "--log-level", "warning", "--both", inst.url,
                       "--protocol", "colocated"]
            wall, cpu, gw = timed(lambda: start("gateway", gw_args), how == "forked")
            gw.stop()
            out[f"gateway {how}"] = {"wall_s": wall, "cpu_s": cpu}
        finally:
            inst.stop()
    os.environ.pop(ENV_VAR, None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pdserve-starts-") as folder:
        model = make_text_model("llama", Path(folder) / "llama")
        server = start_command("forkserver", [sys.executable, "-m", "pdserve.forkserver", f"{folder}/socket"])
        try:
            rows: dict[str, list[dict[str, float]]] = {}
            for _, order in H.rotations(["spawned", "forked"], args.rounds):
                print(f"round order={order} load={H.loadavg()}", flush=True)
                for key, value in one_round(model, server.ready["socket"], order).items():
                    rows.setdefault(key, []).append(value)
        finally:
            server.stop()
    summary = {key: {m: H.median([v[m] for v in values]) for m in ("wall_s", "cpu_s")} for key, values in rows.items()}
    for key, medians in summary.items():
        print(f"{key:20s} wall {medians['wall_s']:.2f} s  cpu {medians['cpu_s']:.2f} s  (median of {args.rounds})")
    for kind in ("instance", "gateway"):
        forked, spawned = summary[f"{kind} forked"], summary[f"{kind} spawned"]
        print(f"{kind}: forked/spawned wall {forked['wall_s'] / spawned['wall_s']:.2f}x, "
              f"cpu {forked['cpu_s'] / spawned['cpu_s']:.2f}x")
    H.write_json(args.json, {"rows": rows, "summary": summary, "load": H.loadavg()})


if __name__ == "__main__":
    main()
