"""Compiles .cu files with nvcc (offline, from /usr/local/cuda) for sm_90."""

NVCC = "/usr/local/cuda/bin/nvcc"

# Links the CUDA runtime statically (no libcudart.so at run time; the
# driver is reached through it, never linked).
CUDART_LINKOPTS = [
    "-L/usr/local/cuda/lib64",
    "-lcudart_static",
    "-ldl",
    "-lrt",
    "-lpthread",
]

# Every header a CUDA step kernel's .cu may include (nvcc runs in the
# genrule's sandbox, which holds only the files named).
CUDA_KERNEL_HDRS = [
    "//core:block8.h",
    "//core:dtype.h",
    "//core:fp8.h",
    "//core:fp8_recipe.h",
    "//core:layout.h",
    "//core:optimizer.h",
    "//core:step_math.h",
    "//kernels:block8_stage.cuh",
    "//kernels:cuda_math.cuh",
    "//kernels:cuda_step_types.h",
    "//kernels:cuda_walk.cuh",
]

def cuda_object(name, src, hdrs = [], tags = []):
    """A .o from one .cu file: sm_90 code plus compute_90 PTX, IEEE math,
    no contraction into FMA (results match the CPU reference)."""
    native.genrule(
        name = name,
        srcs = [src] + hdrs,
        outs = [name + ".o"],
        tags = tags,
        cmd = (NVCC + " -std=c++17 -O3 -fmad=false " +
               "-gencode arch=compute_90,code=sm_90 " +
               "-gencode arch=compute_90,code=compute_90 " +
               "-Xcompiler -fPIC -I. -c $(location " + src + ") -o $@"),
    )

def optimizer_cuda_kernel(name, extra_hdrs = []):
    """The CUDA update kernel of optimizer `name`, in its own package:
    `<name>_cuda.cu` (including `<name>_cuda.h`, `<name>_math.h` and
    `extra_hdrs`) compiled into the cc_library `<name>_cuda`. Exports
    `<name>_cuda.h` and `<name>_scalars.cuh` for //kernels:step_cuda.
    Left out by --config=nocuda; GPU tests run on a GPU machine."""
    cuda_object(
        name = name + "_cuda_o",
        src = name + "_cuda.cu",
        hdrs = CUDA_KERNEL_HDRS + [name + "_cuda.h", name + "_math.h"] +
               extra_hdrs,
        tags = ["cuda"],
    )
    native.cc_library(
        name = name + "_cuda",
        srcs = [":" + name + "_cuda_o"],
        hdrs = [name + "_cuda.h"],
        linkopts = CUDART_LINKOPTS,
        tags = ["cuda"],
        deps = [
            "//core:layout",
            "//kernels:cuda_step_types",
            "@system//:absl",
        ],
    )
    native.exports_files([name + "_cuda.h", name + "_scalars.cuh"])
