"""Compiler options of the CPU reference kernels."""

# Strict IEEE fp32 (no contraction into FMA) keeps the reference's bits
# identical across compilers and flags; -O3 and no errno let the inner loops
# vectorize.
CPU_KERNEL_COPTS = [
    "-O3",
    "-fno-math-errno",
    "-ffp-contract=off",
]
