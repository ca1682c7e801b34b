"""Published runs are priced on their own trainer's target: a source that names one (Megatron-LM and
NeMo: ``megatron``; torchtitan: ``torchtitan``) takes its loss, receive buffers, gradient dtype, ring
rotation and MoE choices from the target's file, not from copies in the source rules."""

from __future__ import annotations

from costmodel.published.runs import SOURCE_RULES, default_csv_path, load_published
from costmodel.published.validate import summarize
from vocab.strategy import WORKLOAD_CHOICES
from vocab.targets import WORKLOAD_BEHAVIOUR, load_target


def test_sources_with_a_trainer_name_its_target() -> None:
    named = {r.key: r.target for r in SOURCE_RULES}
    assert named["NVIDIA/NeMo"] == named["NVIDIA/Megatron-LM"] == "megatron"
    assert named["pytorch/torchtitan"] == "torchtitan"
    assert named["mosaicml/llm-foundry"] == ""  # Composer: no target of its own


def test_rows_are_priced_with_their_targets_behaviour() -> None:
    rows, _ = load_published(default_csv_path())
    by_target: dict[str, int] = {}
    for r in rows:
        if not r.target:
            continue
        b = load_target(r.target).behaviour
        said = {"kernels", "selective"}  # what a row may say itself (torch.compile, op-level selective)
        for f in set(WORKLOAD_BEHAVIOUR) - said:
            assert getattr(r.workload, f) == getattr(b, f)[0], (r.row, f)
        for f in said:
            assert getattr(r.workload, f) in getattr(b, f) and getattr(r.workload, f) in WORKLOAD_CHOICES[f][1]
        assert r.strategy.cp_rotate == b.cp_rotate[0]
        by_target[r.target] = by_target.get(r.target, 0) + 1
    assert by_target["megatron"] >= 50 and by_target["torchtitan"] >= 50
    nemo = [r for r in rows if r.source.startswith("NVIDIA/NeMo")]
    assert nemo and all(r.workload.cross_entropy == "fused" and r.workload.recv_buffers == "none" for r in nemo)


def test_a_summary_names_its_sources_target() -> None:
    from costmodel.published.validate import predict

    rows, _ = load_published(default_csv_path())
    preds, _ = predict([r for r in rows if r.source.startswith("NVIDIA/NeMo")][:3])
    assert summarize("nemo", preds).target == "megatron"
