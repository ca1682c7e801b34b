"""The cost model against the published runs: per-source errors in-sample and leave-one-source-out.

    python benchmarks/validate_published.py [CSV] [--no-loso] [--json]

1. With the spec-sheet defaults of :class:`CostConstants` (no fit).
2. In-sample: constants fitted on every A/B row (what ``shardplan fit`` writes).
3. Leave-one-source-out: for each source with at least five usable rows, the constants are fitted
   on the other sources only and the held-out source is predicted — the honest estimate of how the
   model does on runs it was not fitted on.
4. Table 3's held-out predictions pooled per target the sources are priced as (``SourceRules.target``:
   megatron, torchtitan, or none).
5. How often the 10th-90th percentile error band of those held-out predictions (what ``plan`` prints)
   contains the published step, per source and per target.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from costmodel.constants import CostConstants  # noqa: E402
from costmodel.published.fit import band_slices, error_bands, fit_constants, fit_rows, held_out_records  # noqa: E402
from costmodel.published.runs import default_csv_path, load_published  # noqa: E402
from costmodel.published.validate import MIN_ROWS, Summary, source_label, summarize, validate  # noqa: E402

#: the group of the sources priced with their own rules (no trainer's target)
NO_TARGET = "no target (the source's own rules)"


def _pct(x: float | None) -> str:
    return "     -" if x is None else f"{100 * x:5.1f}%"


def table(title: str, sums: list[Summary], overall: Summary | None = None) -> str:
    lines = [title, f"{'source':44s} {'rows':>4s} {'median':>6s} {'p90':>6s} {'bias':>6s} {'rho':>6s} "
                    f"{'sweep':>9s} {'nofit':>5s} {'mem':>4s} {'memmed':>6s}  targets"]
    for s in [*sums, *([overall] if overall else [])]:
        rho = "     -" if s.spearman is None else f"{s.spearman:6.3f}"
        sweep = f"{round(s.sweep_ordered * s.sweep_pairs):4d}/{s.sweep_pairs:<4d}" if s.sweep_pairs else "        -"
        ok = {True: "met", False: "MISSED", None: "-"}[s.meets_targets] if s is not overall else ""
        lines.append(f"{source_label(s.source):44s} {s.rows:4d} {_pct(s.median_ape)} {_pct(s.p90_ape)} "
                     f"{_signed(s.bias)} {rho} {sweep} {len(s.misfits):5d} {s.memory_rows:4d} "
                     f"{_pct(s.memory_median_ape)}  {ok}")
    return "\n".join(lines)


def coverage_table(preds: list, sources: list[Summary]) -> str:
    """5. How often the error band held on the held-out rows: the 10th-90th percentile band of their
    signed step-time errors (``fit.error_bands``, as ``shardplan fit`` writes them) of the narrowest
    slice that has one (accelerator/precision, accelerator, all), per source and per target."""
    bands = error_bands(preds)
    recs = held_out_records(preds)

    def inside(h: object) -> bool:
        band = next(bands[k] for k in reversed(band_slices(h)) if k in bands)  # type: ignore[arg-type]
        return band["low"] <= h.time_error <= band["high"]  # type: ignore[attr-defined]

    lines = ["5. band coverage: held-out rows whose published step lies in the band `plan` prints (nominal 80%)",
             f"{'group':44s} {'rows':>5s} {'inside':>7s}"]
    groups = [(s.source, [h for h in recs if h.source == s.source]) for s in sources]
    targets = [p.row.target for p in preds if p.time_error is not None]  # held_out_records' rows, in order
    groups += [(name or NO_TARGET, [h for h, t in zip(recs, targets, strict=True) if t == name])
               for name in sorted(set(targets), key=lambda x: (not x, x))]
    for name, hs in [*groups, ("overall", recs)]:
        if hs:
            k = sum(map(inside, hs))
            lines.append(f"{source_label(name):44s} {len(hs):5d} {100 * k / len(hs):6.1f}%")
    return "\n".join(lines)


def _signed(x: float | None) -> str:
    return "     -" if x is None else f"{100 * x:+5.1f}%"


def misfit_lines(sums: list[Summary]) -> list[str]:
    """The published runs predicted not to fit, per source."""
    out = [f"  {source_label(s.source)}: {m}" for s in sums for m in s.misfits]
    return ["runs that ran but are predicted not to fit (peak of the worst rank, capacity):", *out] if out else []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="?", default=str(default_csv_path()))
    ap.add_argument("--no-loso", action="store_true", help="skip the leave-one-source-out refits")
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = ap.parse_args()

    rows, skipped = load_published(args.csv)
    out: dict = {}
    spec = validate(rows, skipped, lambda acc: CostConstants())
    t0 = time.time()
    result = fit_constants(rows)  # the constants `shardplan fit` writes (its bands: table 3's refits)
    fitted = validate(rows, skipped, result.constants())
    out["spec_defaults"] = spec.to_dict()
    out["in_sample"] = fitted.to_dict()
    out["constants"] = result.to_yaml()
    text = [table("1. spec-sheet defaults (no fit)", spec.sources, spec.overall), "",
            table(f"2. in-sample fit on {len(fit_rows(rows))} A/B rows ({time.time() - t0:.0f} s)",
                  fitted.sources, fitted.overall)]
    if not args.no_loso:
        held: list[Summary] = []
        preds = []
        for src in [s.source for s in fitted.sources if s.rows >= MIN_ROWS]:
            others = [r for r in rows if r.source != src]
            mine = [r for r in rows if r.source == src]
            rep = validate(mine, [], fit_constants(others).constants())
            held += rep.sources
            preds += rep.predictions
        loso_all = summarize("overall (held-out predictions pooled)", preds)
        out["leave_one_source_out"] = {"sources": [s.to_dict() for s in held], "overall": loso_all.to_dict()}
        text += ["", table("3. leave-one-source-out (each source predicted by constants fitted on the others)",
                           held, loso_all)]
        per_target = [summarize(name or NO_TARGET, [p for p in preds if p.row.target == name])
                      for name in sorted({p.row.target for p in preds}, key=lambda x: (not x, x))]
        out["leave_one_source_out"]["targets"] = [s.to_dict() for s in per_target]
        text += ["", table("4. the held-out predictions of table 3 per target each source is priced as", per_target),
                 "", coverage_table(preds, held)]
    text += ["", *misfit_lines(fitted.sources),
             "", f"skipped rows: {len(fitted.skipped)} (see `shardplan validate` for the reasons)"]
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True, default=str))
    else:
        print("\n".join(text))
        c = result.to_yaml()
        print("\nfitted constants:")
        for name, sec in {"default": c["default"], **c["accelerators"]}.items():
            consts = ", ".join(f"{k}={v:.4g}" for k, v in sec["constants"].items())
            print(f"  {name} ({sec.get('rows', 0)} rows, {sec.get('sources', 0)} sources): {consts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
