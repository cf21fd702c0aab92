"""pip install ./client/python  (offline: add --no-build-isolation)

Installs the optimd package with its gRPC stubs: those in the tree
(optimd/v1/, kept current with the .proto by tools/check_code.sh), or,
where protoc and grpc_python_plugin are installed (Debian's
protobuf-compiler and protobuf-compiler-grpc) and the source tree is at
hand, generated anew from proto/optimd/v1/optimd.proto. Uses the torch,
grpcio and protobuf already installed.

With liboptimd_step_channel.so built (`bazel build
//client:liboptimd_step_channel.so`), it is installed too, as
optimd/_lib/liboptimd_step_channel.so: steps then run without Python
threads (optimd/_native_steps.py). OPTIMD_STEP_CHANNEL_LIB names another
copy; without either, the client steps over grpcio's stream.
"""
import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_ROOT = os.path.normpath(os.path.join(HERE, "..", "..", "proto"))
PROTO = os.path.join(PROTO_ROOT, "optimd", "v1", "optimd.proto")
STEP_CHANNEL = os.path.normpath(os.path.join(
    HERE, "..", "..", "bazel-bin", "client", "liboptimd_step_channel.so"))


class BuildWithStubs(build_py):
    """Generates optimd/v1/optimd_pb2*.py into the build directory."""

    def run(self):
        super().run()
        out = self.build_lib
        stubs = os.path.join(out, "optimd", "v1", "optimd_pb2.py")
        if os.path.exists(PROTO) and shutil.which("protoc"):
            plugin = shutil.which("grpc_python_plugin") or \
                "/usr/bin/grpc_python_plugin"
            subprocess.check_call([
                "protoc", "-I" + PROTO_ROOT, "--python_out=" + out,
                "--grpc_python_out=" + out,
                "--plugin=protoc-gen-grpc_python=" + plugin, PROTO])
        elif not os.path.exists(stubs):
            raise SystemExit(
                "cannot generate the gRPC stubs: install protoc and "
                "grpc_python_plugin (tools/setup.sh) and install from the "
                "optimd source tree")
        library = os.environ.get("OPTIMD_STEP_CHANNEL_LIB") or STEP_CHANNEL
        if os.path.exists(library):
            lib_dir = os.path.join(out, "optimd", "_lib")
            os.makedirs(lib_dir, exist_ok=True)
            shutil.copy(library, os.path.join(
                lib_dir, "liboptimd_step_channel.so"))


setup(
    name="optimd",
    version="0.5.0",
    description="Python client of the optimd optimizer-step daemon, with "
                "optimd.torch.AdamW, a drop-in torch.optim.AdamW",
    packages=["optimd", "optimd.v1"],
    python_requires=">=3.9",
    # Declared so that a clean environment knows what it needs; offline
    # installs use the ones already there (--no-deps, --no-build-isolation).
    install_requires=["grpcio", "protobuf", "torch"],
    cmdclass={"build_py": BuildWithStubs},
)
