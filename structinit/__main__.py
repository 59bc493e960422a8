"""``python -m structinit`` runs the CLI."""

from structinit.cli.app import run

if __name__ == "__main__":
    run()
