"""Triton kernels, each beside the torch implementation it must equal."""
