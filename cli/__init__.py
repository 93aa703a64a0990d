"""The `convgpu` command: one thin module per sub-command (main.py joins them)."""
