"""``python -m prunekit``: the ``prunekit`` command."""

from prunekit.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
