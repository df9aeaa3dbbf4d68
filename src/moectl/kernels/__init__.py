"""CPU kernels moectl compiles for the machine it runs on, where PyTorch's are far from the memory's
speed (bf16 products on CPUs without AVX512-BF16): :mod:`bf16_rows`, :mod:`cpu_linear`."""
