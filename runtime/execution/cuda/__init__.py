"""The CUDA execution backend: llmd's model code on a local NVIDIA GPU through PyTorch, with Triton
kernels written here for the paged KV store and paged attention, CUDA graphs for decode and
verification steps, and sampling on the device.

    metadata.py   the step's integers in one buffer, padded for graph buckets
    kernels.py    Triton kernels (KV store, paged attention, split-KV combine)
    ops.py        the kernels as torch operators with fake implementations
    attention.py  the attention object the model's layers call
    sampling.py   sampling on the device, no host sync
    graphs.py     graph buckets, capture and replay (and a CPU stand-in)
    backend.py    the model runner for ``--device cuda``
    lint.py       a whole step under FakeTensorMode: device mismatches and host syncs

Importing this package needs triton; llmd imports it only when the CUDA backend is chosen.
"""
