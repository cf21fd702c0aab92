#!/usr/bin/env bash
# Part of tools/demo.sh: trains a small transformer language model with
# optimd.torch.AdamW (PyTorch) through the daemon at $OPTIMD_ADDRESS.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== training a small transformer LM through the daemon (PyTorch client)"
PYTHONPATH=client/python /usr/bin/python3 examples/lm_train.py \
  --address "${OPTIMD_ADDRESS:?set OPTIMD_ADDRESS}"
