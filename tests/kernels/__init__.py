"""The kernels against their torch references: the CPU's native ones, Triton's (interpreted on the CPU), CUDA at real
shapes."""
