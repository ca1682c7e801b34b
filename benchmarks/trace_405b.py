"""Trace a Llama-3.1-405B-shaped model (fake tensors, forward + backward) and report cost and totals.

Run: ``python benchmarks/trace_405b.py [--seq-len 2048] [--layers 126]``. Targets: under 60 s and
2 GiB of peak resident memory on a CPU machine.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from profiler.models import config_from_hf  # noqa: E402
from profiler.trace_factories import trace_hf_config  # noqa: E402
from profiler.transformer import build_graph  # noqa: E402

LLAMA_405B = {
    "model_type": "llama", "hidden_size": 16384, "num_hidden_layers": 126, "num_attention_heads": 128,
    "num_key_value_heads": 8, "intermediate_size": 53248, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": False,
}


def peak_rss_gib() -> float:
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=126)
    args = ap.parse_args()
    cfg = {**LLAMA_405B, "num_hidden_layers": args.layers}
    rss0 = peak_rss_gib()
    t0 = time.perf_counter()
    graph = trace_hf_config(cfg, seq_len=args.seq_len, model_id="llama3.1-405b")
    wall = time.perf_counter() - t0
    s = graph.seq_len
    print(f"layers            {args.layers}")
    print(f"seq_len           {s}")
    print(f"wall time         {wall:.1f} s")
    print(f"peak RSS          {peak_rss_gib():.2f} GiB (after imports: {rss0:.2f} GiB)")
    print(f"nodes             {len(graph.nodes)}")
    print(f"total params      {graph.total_params:,} ({graph.total_params / 1e9:.2f} B)")
    print(f"fwd FLOPs/token   {graph.fwd_flops / s:.4e}")
    print(f"train FLOPs/token {graph.train_flops / s:.4e}  (6N = {6 * graph.total_params:.4e})")
    print(f"saved act/token   {graph.act_saved_bytes / s / 2**20:.1f} MiB")
    ref = build_graph(config_from_hf(cfg), s)
    print(f"analytic preset   params {ref.total_params:,}, fwd FLOPs/token {ref.fwd_flops / s:.4e}, "
          f"train FLOPs/token {ref.train_flops / s:.4e}, saved act/token {ref.act_saved_bytes / s / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
