"""nanotron: the YAML ``parallelism`` block, with the ``tokens`` batch keys and the optimizer's ZeRO stage
(merge them into a full nanotron config)."""

from __future__ import annotations

import yaml

from planner.trainers.exporting import Nearest, header
from planner.trainers.nanotron.keys import NANOTRON, NANOTRON_PP_ENGINES, NANOTRON_TP_MODES
from vocab.strategy import Strategy

SUFFIX = ".yaml"


def adjust(n: Nearest) -> None:
    if n.mesh["ep"] > 1:
        n.notes.append(f"nanotron counts expert parallelism as its own axis: dp = data-parallel ranks / ep = "
                       f"{n.mesh['dp_replicate'] * n.mesh['dp_shard'] // n.mesh['ep']}")


def render(n: Nearest, s: Strategy, cost: str) -> str:
    K, m, w = NANOTRON, s.mesh, n.workload_model()
    shard = n.values("sharding")[0] if n.units else s.default.sharding
    par = {K["dp"]: m.dp // m.ep, K["pp"]: m.pp, K["tp"]: m.tp,
           K["pp_engine"]: NANOTRON_PP_ENGINES.get(s.schedule, "1f1b"),
           K["tp_mode"]: NANOTRON_TP_MODES[s.sequence_parallel], K["tp_async"]: s.sequence_parallel,
           K["ep"]: m.ep}
    doc = {
        K["parallelism"]: par,
        K["tokens"]: {K["micro_batch"]: s.micro_batch, K["grad_accum"]: s.num_microbatches(w.global_batch),
                      K["seq_len"]: w.seq_len},
        K["optimizer"]: {K["zero_stage"]: 1 if shard == "zero1" else 0},
    }
    body = yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)
    return header(n.plan, n.label, n.losses, cost) + body
