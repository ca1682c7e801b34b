"""Train your own model with a shardplan plan under torchrun.

    torchrun --standalone --nproc-per-node 2 examples/torchrun_train.py --plan plan.json
    torchrun --standalone --nproc-per-node 2 examples/torchrun_train.py            # built-in ZeRO-3 demo plan

The script is a plain training loop; the plan enters in three lines: ``apply_plan`` (shards the
model as the plan says), ``build_optimizer`` (an optimizer over what this rank steps, with the
plan's gradient hooks) and ``train_step`` (forward + backward for any plan, pipelines included).
Replace ``make_model`` and ``batches`` with your model and data: the runtime knows the reference
``runtime.model.Transformer`` and Hugging Face ``LlamaForCausalLM`` / ``GPT2LMHeadModel``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from runtime import apply_plan, build_optimizer, local_batch, state_bytes, train_step
from runtime.mesh import backend_for, device_type
from runtime.model import TINY_MODELS, Transformer
from vocab.plan import load_plan
from vocab.strategy import LayerStrategy, Mesh, Strategy


def make_model() -> torch.nn.Module:
    """Your model; every rank must build it identically (same seed)."""
    torch.manual_seed(0)
    return Transformer(TINY_MODELS["tiny-llama"])


def batches(vocab: int, seq_len: int, global_batch: int, steps: int):
    """Your data: here synthetic tokens, one global batch per step (``local_batch`` picks this rank's part)."""
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        data = torch.randint(0, vocab, (global_batch, seq_len + 1), generator=g)
        yield data[:, :-1], data[:, 1:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", help="plan JSON; default: ZeRO-3 over all processes")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--global-batch", type=int, default=8)
    args = ap.parse_args()

    dev = device_type()
    if dev == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend_for(dev))
    world, rank = dist.get_world_size(), dist.get_rank()
    plan = load_plan(args.plan) if args.plan else Strategy(mesh=Mesh(dp_shard=world),
                                                           default=LayerStrategy(sharding="zero3"))
    strategy = getattr(plan, "strategy", plan)

    model = apply_plan(make_model(), plan, n_microbatches=max(1, args.global_batch // strategy.mesh.dp))
    opt = build_optimizer(model, torch.optim.AdamW, lr=1e-3)
    info = model._shardplan  # the mesh, this rank's data-parallel index, what was applied
    vocab = TINY_MODELS["tiny-llama"].vocab

    for step, (x, y) in enumerate(batches(vocab, args.seq_len, args.global_batch, args.steps)):
        # this rank's rows and, with context parallelism or TSP, its tokens of each sequence
        x, y = local_batch(model, x), local_batch(model, y)
        loss = train_step(model, x.to(dev), y.to(dev))  # None on pipeline ranks without the loss
        opt.step()
        mem = state_bytes(model, opt)
        opt.zero_grad(set_to_none=True)
        if loss is not None and info.mesh.coord("tp") == 0 and info.mesh.dp_rank == 0:
            print(f"step {step} rank {rank}: local loss {float(loss):.4f} "
                  f"params {mem['param_bytes']} B optimizer {mem['optim_bytes']} B", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
