"""`python -m moekit` runs the command line."""
from moekit.cli.main import main

raise SystemExit(main())
