"""@triton.jit kernels only: no policy, no autograd, no dispatch."""
