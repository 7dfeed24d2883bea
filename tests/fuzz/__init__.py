"""A fuzzer of adaattn.attention against a float64 softmax, CPU and CUDA (see sdpa.py)."""
