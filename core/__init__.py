"""convgpu: transparent GPU-memory accounting and sharing for containers."""
__version__ = "0.1.0"
