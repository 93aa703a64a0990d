"""`python -m convgpu`: the same CLI as the `convgpu` command (cli/main.py)."""
from .cli.main import main

main()
