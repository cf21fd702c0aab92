#!/usr/bin/env bash
# Generates the Python gRPC stubs of proto/optimd/v1/optimd.proto into
# client/python/optimd/v1/. They are kept in the tree, so that installing
# the client (pip install ./client/python) needs no compiler: run this
# after changing the .proto (tools/check_code.sh fails on stale stubs).
# Needs protoc and grpc_python_plugin (tools/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
protoc -Iproto --python_out=client/python --grpc_python_out=client/python \
  --plugin=protoc-gen-grpc_python=/usr/bin/grpc_python_plugin \
  proto/optimd/v1/optimd.proto
echo "generated client/python/optimd/v1/optimd_pb2.py and optimd_pb2_grpc.py"
