"""The ``packtools`` command line (``packtools.cli.main.main``): thin subcommands over the public API."""
