"""Megatron-LM's own command-line parser, written down as data: ``vocab/targets/keys/megatron_lm-<version>.json``.

    pip download --no-deps megatron-core==0.19.2 --python-version 3.12 --only-binary :all: -d /tmp/mc19
    unzip -q /tmp/mc19/megatron_core-0.19.2-*.whl -d /tmp/mc19/src
    python benchmarks/megatron_lm_parser.py /tmp/mc19/src

Megatron-LM's ``pretrain_gpt.py`` flags are defined by ``megatron/training/arguments.py``
(``add_megatron_arguments``), in the megatron-core 0.19.2 wheel (the 0.16.1 wheel has no
``megatron/training``), which needs Python 3.12; its parser module loads on 3.11 once ``typing.override`` exists (a decorator that returns its function, as
on 3.12). The script builds that parser in a child process and writes every action: its option
strings, destination, kind (store, store_true, ...), ``nargs``, value type (int, float, or str for any
other conversion) and choices. ``planner.trainers.megatron.parser`` rebuilds an argparse parser from
the file, so that exports and imports are checked by the definitions Megatron-LM parses with.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "vocab" / "targets" / "keys"

CHILD = r"""
import argparse, json, sys, typing, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, sys.argv[1])
if not hasattr(typing, "override"):  # Python 3.12's decorator: returns its function
    typing.override = lambda f: f
from megatron.core.package_info import __version__
from megatron.training.arguments import add_megatron_arguments

parser = argparse.ArgumentParser(allow_abbrev=False)
add_megatron_arguments(parser)
KINDS = {argparse._StoreAction: "store", argparse._StoreTrueAction: "store_true",
         argparse._StoreFalseAction: "store_false", argparse._StoreConstAction: "store_const",
         argparse._AppendAction: "append", argparse._CountAction: "count", argparse._HelpAction: "help"}
actions = []
for a in parser._actions:
    if not a.option_strings or isinstance(a, argparse._HelpAction):
        continue
    kind = KINDS.get(type(a), "store")
    typ = a.type if a.type in (int, float) else str
    actions.append({"flags": list(a.option_strings), "dest": a.dest, "kind": kind,
                    "nargs": a.nargs if isinstance(a.nargs, (int, str)) else None,
                    "type": typ.__name__,
                    "choices": [str(getattr(c, "value", c)) for c in a.choices] if a.choices else None})
print(json.dumps({"version": __version__, "actions": actions}))
"""


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not (Path(argv[0]) / "megatron" / "training" / "arguments.py").is_file():
        print("usage: python benchmarks/megatron_lm_parser.py WHEEL_DIR (an unpacked megatron-core wheel with "
              "megatron/training/arguments.py)", file=sys.stderr)
        return 2
    out = subprocess.run([sys.executable, "-c", CHILD, argv[0]], capture_output=True, text=True, check=True)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    path = OUT / f"megatron_lm-{data['version']}.json"
    body = {"package": "megatron_lm", "version": data["version"],
            "source": f"megatron/training/arguments.py add_megatron_arguments, megatron-core {data['version']} wheel",
            "actions": sorted(data["actions"], key=lambda a: a["flags"][0])}
    path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    print(f"{path.relative_to(ROOT)}: {len(body['actions'])} flags' actions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
