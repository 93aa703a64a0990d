"""Swap (issue 46): an idle holder's GPU memory moved to host memory by the driver's own
checkpoint (cuCheckpointProcess*), and brought back at its next CUDA call. agent.py makes the
driver calls, in a child of the enforcer; swapper.py is the part that decides and keeps the
state; idle.py the pure choice of whom to swap."""
