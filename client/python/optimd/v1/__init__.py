"""Generated gRPC stubs of the optimd v1 API (proto/optimd/v1/optimd.proto).

The modules optimd_pb2 and optimd_pb2_grpc are generated, never edited: by
`pip install ./client/python`, by the Bazel build, or by
tools/gen_python_proto.sh for use from the source tree. The package path is
extended so that stubs generated into another sys.path root are found too.
"""
import pkgutil

__path__ = pkgutil.extend_path(__path__, __name__)
