"""Kubernetes node agent: the convgpu.io/gpu-memory device plugin and limits from pods."""
