"""A Python test module run against the real daemon (run_python_tests.sh)."""

def daemon_py_test(name, module, size = "large", tags = [], data = []):
    native.sh_test(
        name = name,
        size = size,
        srcs = ["run_python_tests.sh"],
        args = [module],
        data = [
            module,
            "//client:liboptimd_step_channel.so",
            "//client/python:optimd_py",
            "//proto:optimd_py_proto",
            "//server:optimd",
        ] + data,
        tags = tags,
    )
