"""Find the CUDA libraries, attach the uprobes, decode what they report."""
