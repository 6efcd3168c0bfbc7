"""``python -m gmc`` (and so ``torchrun -m gmc``) runs the CLI."""
from gmc.cli.main import main

main()
