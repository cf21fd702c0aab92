#!/usr/bin/env bash
# Runs Python test modules against the real daemon, under Debian's python3
# (which has torch). Arguments: test module file names under tests/python.
set -euo pipefail
root="$PWD"
export PYTHONPATH="$root/client/python:$root/proto/pygen"
export OPTIMD_BINARY="$root/server/optimd"
# Steps through liboptimd_step_channel.so, as an installed client with the
# library does (test_step_channel compares it with grpcio's stream).
export OPTIMD_STEP_CHANNEL_LIB="$root/client/liboptimd_step_channel.so"
# Where a test's BUILD rule carries it (data).
export OPTIMCTL_BINARY="$root/client/optimctl"
export PYTHONUNBUFFERED=1
cd "$root/tests/python"
for module in "$@"; do
  /usr/bin/python3 -m unittest -v "${module%.py}"
done
