"""DeepSeek-V3's published pre-training, priced the ways its MoE layers can run.

    python benchmarks/moe_jobs.py

DeepSeek-AI, 'DeepSeek-V3 Technical Report' (arXiv 2412.19437): 2,048 H800 GPUs (section 3.1),
16-way pipeline (DualPipe) and 64-way expert parallelism over 8 nodes with ZeRO-1 data parallelism
(section 3.2), fp8 mixed precision (section 3.3), 4,096-token sequences and a batch of 15,360 of
them (section 4.2), node-limited routing to at most 4 nodes and a dispatch that sends a token once
per node (section 3.2.2), 180K H800 GPU hours per trillion tokens (section 1): 1,543 tokens/s per
GPU.

shardplan has no DualPipe schedule; the nearest it prices is the interleaved 1F1B with two virtual
stages per rank (DualPipe's two chunks per rank), on the ``any`` target (62 blocks over 32
virtual stages, unequal) with fused kernels and the fused cross-entropy, at a batch of 16,384 (the
interleaved schedule needs the micro-batches in multiples of the 16 stages). The table prices the
dispatch as an all-to-all and de-duplicated, with and without the all-to-all hidden under the
paired micro-batch's compute, and prints each against the published throughput. The report
recomputes the norms and MLA up-projections and caches fp8 activations (section 3.3.3), which
shardplan does not price: the peak memory column is over the 80 GB the run had.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from costmodel.device import DeviceModel  # noqa: E402
from costmodel.estimate import estimate  # noqa: E402
from profiler.hardware import parse_cluster  # noqa: E402
from profiler.models import load_model  # noqa: E402
from vocab.strategy import LayerStrategy, Mesh, Strategy, Workload  # noqa: E402

PUBLISHED_TPS = 1e12 / (180e3 * 3600)  # 180K GPU hours per trillion tokens
MODEL, CLUSTER, SEQ, BATCH = "deepseek-v3", "2048xh800", 4096, 16384


def strategy() -> Strategy:
    return Strategy(mesh=Mesh(pp=16, dp_shard=128, ep=64), micro_batch=1, schedule="interleaved", vpp=2,
                    default=LayerStrategy(sharding="zero1"))


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    graph, cl = load_model(MODEL, SEQ), parse_cluster(CLUSTER)
    dev = DeviceModel(cl)
    print(f"DeepSeek-V3 on {CLUSTER}, seq {SEQ}, batch {BATCH}, fp8, PP16 (2 virtual stages) EP64 ZeRO-1; "
          f"published {PUBLISHED_TPS:,.0f} tokens/s/GPU (benchmarks/moe_jobs.py at {commit})\n")
    print("| dispatch | all-to-all overlap | step s | tokens/s/GPU | over published | MFU | EP comm s | peak GiB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for dispatch in ("alltoall", "dedup"):
        for overlap in ("none", "1f1b"):
            w = Workload(seq_len=SEQ, global_batch=BATCH, precision="fp8", kernels="fused", cross_entropy="fused",
                         recv_buffers="none", moe_dispatch=dispatch, moe_overlap=overlap)
            r = estimate(graph, cl, strategy(), w, device=dev)
            print(f"| {dispatch} | {overlap} | {r.step_time_s:.2f} | {r.tokens_per_s_per_gpu:,.0f} | "
                  f"{r.tokens_per_s_per_gpu / PUBLISHED_TPS:.2f} | {r.mfu:.1%} | {r.time.comm.get('ep', 0.0):.2f} | "
                  f"{r.memory_peak_gib:.0f} |")


if __name__ == "__main__":
    main()
