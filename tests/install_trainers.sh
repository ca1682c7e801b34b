#!/bin/sh
# The trainers whose own loaders and parsers the tests run on the exports (docs/targets.md, "Checking
# exports"), all with --no-deps so that none of them changes the pinned torch: the releases the targets
# pin into the environment; torchtitan 0.3.0 (the torchtitan-0.3 target) and megatron-core 0.19.2 (whose
# wheel ships Megatron-LM's parser and validate_args) beside them in .trainers/, loaded by the tests in
# child processes. megatron-core 0.19.2 declares Python >= 3.12; its cp311 wheel's modules import on 3.11.
set -eu
cd "$(dirname "$0")/.."
pip install -q --no-deps -r tests/trainers.txt
pip install -q --no-deps --upgrade --target .trainers/torchtitan-0.3.0 -r tests/trainers-torchtitan-0.3.txt
pip install -q --no-deps --upgrade --ignore-requires-python --target .trainers/megatron-core-0.19.2 \
    -r tests/trainers-megatron-core-0.19.txt
