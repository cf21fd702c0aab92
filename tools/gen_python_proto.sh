#!/usr/bin/env bash
# Generates the Python gRPC stubs of proto/optimd/v1/optimd.proto into
# client/python/optimd/v1/, for using the client from the source tree with
# PYTHONPATH=client/python. (pip install and the Bazel tests generate them
# themselves.) Needs protoc and grpc_python_plugin (tools/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
protoc -Iproto --python_out=client/python --grpc_python_out=client/python \
  --plugin=protoc-gen-grpc_python=/usr/bin/grpc_python_plugin \
  proto/optimd/v1/optimd.proto
echo "generated client/python/optimd/v1/optimd_pb2.py and optimd_pb2_grpc.py"
