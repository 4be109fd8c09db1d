"""Compiled CPU kernels (C, built on first use with the system compiler, loaded via ctypes)."""
