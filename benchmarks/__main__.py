"""``python -m benchmarks``: runs :func:`benchmarks.cli.main` (from a clone's root)."""

from .cli import main

raise SystemExit(main())
