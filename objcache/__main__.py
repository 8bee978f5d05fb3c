"""`python -m objcache` runs the CLI."""

from __future__ import annotations

from objcache.cli import main

raise SystemExit(main())
