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
    "//core:dtype.h",
    "//core:layout.h",
    "//core:optimizer.h",
    "//core:step_math.h",
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
