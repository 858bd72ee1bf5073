"""``python -m mlxcluster`` = the ``mlxcluster`` command."""

from .cli import main

main()
