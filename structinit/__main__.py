"""``python -m structinit`` runs the CLI."""

from .app import main

main()
