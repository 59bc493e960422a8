"""The ``structinit`` command line: one module per command, registered by :mod:`structinit.cli.app`."""
