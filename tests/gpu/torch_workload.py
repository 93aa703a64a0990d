"""A PyTorch process for the GPU tests: allocates known tensors, runs a small matmul so cuBLAS
and kernels load, prints what PyTorch itself counts, then waits on stdin (then frees, exits).
The allocator comes from PYTORCH_CUDA_ALLOC_CONF set by the test."""
import json
import os
import sys

import torch

MiB = 1 << 20
x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
y = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
a = torch.randn(1024, 1024, device="cuda")
b = (a @ a).sum().item()
torch.cuda.synchronize()
print(json.dumps({"pid": os.getpid(), "reserved": torch.cuda.memory_reserved(),
                  "allocated": torch.cuda.memory_allocated(), "check": b != 0}), flush=True)
print("ready", flush=True)
sys.stdin.readline()
del x, y, a
torch.cuda.empty_cache()
print(json.dumps({"after_empty_cache": torch.cuda.memory_reserved()}), flush=True)
print("exit", flush=True)
