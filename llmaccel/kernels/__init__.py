"""Kernels: tensors in, tensors out. Each has a plain-PyTorch reference that runs on CPU."""
