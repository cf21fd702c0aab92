"""Generates C++ protobuf and gRPC code with the system protoc (offline)."""

def grpc_cc_proto(name, src):
    """A cc_library of `src` (a path under proto/) with its gRPC stubs."""
    base = src[:-len(".proto")]
    outs = [base + ext for ext in [".pb.h", ".pb.cc", ".grpc.pb.h", ".grpc.pb.cc"]]
    native.genrule(
        name = name + "_gen",
        srcs = [src],
        outs = outs,
        cmd = ("protoc -Iproto --cpp_out=$(GENDIR)/proto --grpc_out=$(GENDIR)/proto " +
               "--plugin=protoc-gen-grpc=/usr/bin/grpc_cpp_plugin $(location %s)" % src),
    )
    native.cc_library(
        name = name,
        srcs = [base + ".pb.cc", base + ".grpc.pb.cc"],
        hdrs = [base + ".pb.h", base + ".grpc.pb.h"],
        includes = ["."],
        deps = ["@system//:grpc"],
    )
