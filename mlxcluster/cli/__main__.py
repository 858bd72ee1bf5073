"""``python -m mlxcluster.cli`` = the ``mlxcluster`` command."""

from . import main

main()
