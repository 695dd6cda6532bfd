"""``python -m exactblocks``: the ``exactblocks`` console script (see ``exactblocks.cli``)."""

from exactblocks.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
