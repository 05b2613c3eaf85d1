"""Compute ops for the engine. Each op has a torch reference (the CPU path and the test oracle) and, where it
pays, a Triton implementation for CUDA; `llamaterm.kernels.dispatch` picks one per call. Imports torch and triton
only: nothing of the engine or the app."""
