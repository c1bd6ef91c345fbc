"""`python -m duet` is the `duet` command."""

from duet.cli import main

raise SystemExit(main())
