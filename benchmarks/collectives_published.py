"""Collective bus bandwidths the cost model prices against the ones published NCCL tests measured.

    python benchmarks/collectives_published.py [--csv ../shared/calibration/hardware.csv]

Every ``measured_busbw_*`` row of the hardware file (nccl-tests and ml-engineering's
``all_reduce_bench.py`` on 2-32 GPUs: one node, part of one, four nodes over EFA) is priced with
``DeviceModel.collective_time`` on the accelerator file the row's GPU names, at the row's payload,
and turned into bus bandwidth as nccl-tests does (``bytes · factor(n) / time``). Rows whose
reduction ran in the NVSwitch (NVLS/SHARP: named so, or near the links' raw bandwidth) are listed
apart: the model prices rings and trees over the links, so it is conservative there.
"""

from __future__ import annotations

import argparse
import csv
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from costmodel.configs import AxisGroup  # noqa: E402
from costmodel.device import COLLECTIVE_FACTORS, DeviceModel  # noqa: E402
from profiler.hardware import parse_cluster  # noqa: E402

CSV = ROOT / "costmodel" / "data" / "calibration" / "hardware.csv"
#: the accelerator file of a GPU named in the hardware file
ACCELERATORS = {"A100": "a100-80gb", "H100": "h100-sxm", "H200": "h200", "B200": "b200", "MI300X": "mi300x"}
UNITS = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10}


def ranks(gpu: str) -> tuple[str, int, int] | None:
    """(accelerator file, ranks, GPUs per node) of a row's GPU description, or None."""
    name = next((a for k, a in ACCELERATORS.items() if re.search(rf"\b{k}\b", gpu)), None)
    if name is None:
        return None
    if m := re.search(r"(\d+) nodes x (\d+)", gpu):
        return name, int(m.group(1)) * int(m.group(2)), int(m.group(2))
    if m := re.search(r"(\d+) of (\d+)", gpu):
        return name, int(m.group(1)), int(m.group(2))
    if m := re.search(r"(\d+)x ", gpu):
        return name, int(m.group(1)), int(m.group(1))
    if "ranks 0-7" in gpu:
        return name, 8, 8
    return None


def payload(conditions: str) -> float | None:
    m = re.search(r"payload (\d+(?:\.\d+)?)\s*(GiB|MiB|KiB)", conditions)
    return float(m.group(1)) * UNITS[m.group(2)] if m else None


def in_switch(conditions: str, busbw: float, link_gbps: float) -> bool:
    """Whether the reduction ran in the NVSwitch (NVLS): named so, or within 10% of the links' raw
    bandwidth, which no ring over them reaches; not where a ring is named."""
    ring = any(w in conditions for w in ("NVLS off", "NVLS_ENABLE=0", "Ring", "ring"))
    return not ring and ("NVLS" in conditions or busbw > 0.9 * link_gbps)


def priced_rows(path: Path) -> list[dict]:
    """Every measured bus-bandwidth row with the model's price (``model_gbps``)."""
    out = []
    for r in csv.DictReader(path.open()):
        kind = r["metric"].removeprefix("measured_busbw_")
        if not r["metric"].startswith("measured_busbw_") or kind not in COLLECTIVE_FACTORS:
            continue
        where, nbytes = ranks(r["gpu"]), payload(r["conditions"])
        if where is None or nbytes is None:
            continue
        acc, n, per_node = where
        nodes = max(1, n // per_node)
        dev = DeviceModel(parse_cluster({"accelerator": acc, "nodes": nodes, "gpus_per_node": per_node}))
        t = float(np.asarray(dev.collective_time(kind, nbytes, AxisGroup(np.array([float(n)]), np.array([1.0]))))
                  .reshape(-1)[0])
        model = nbytes * COLLECTIVE_FACTORS[kind](n) / t / 1e9
        measured = float(r["value"])
        out.append({"gpu": r["gpu"], "collective": kind, "ranks": n, "nodes": nodes, "bytes": nbytes,
                    "measured_gbps": measured, "model_gbps": model,
                    "nvls": in_switch(r["conditions"], measured, dev.acc.scale_up.gbps)})
    return out


def _size(nbytes: float) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        if nbytes >= UNITS[unit]:
            return f"{nbytes / UNITS[unit]:g} {unit}"
    return f"{nbytes:g} B"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--csv", type=Path, default=CSV)
    a = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    rows = priced_rows(a.csv)
    print(f"benchmarks/collectives_published.py at {commit}: {len(rows)} rows of {a.csv.name}\n")
    print("| GPUs | collective | ranks (nodes) | payload | measured GB/s | model GB/s | model/measured |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: (r["nvls"], r["gpu"], -r["bytes"])):
        label = r["gpu"] + (" (in-switch reduction)" if r["nvls"] else "")
        print(f"| {label} | {r['collective']} | {r['ranks']} ({r['nodes']}) | {_size(r['bytes'])} | "
              f"{r['measured_gbps']:.0f} | {r['model_gbps']:.0f} | {r['model_gbps'] / r['measured_gbps']:.2f} |")
    ring = [r["model_gbps"] / r["measured_gbps"] for r in rows if not r["nvls"]]
    if ring:
        print(f"\nover the links (not in-switch): {len(ring)} rows, model/measured median {np.median(ring):.2f}, "
              f"range {min(ring):.2f}-{max(ring):.2f}")


if __name__ == "__main__":
    main()
