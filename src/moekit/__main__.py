"""`python -m moekit` runs the command line."""
from moekit.cli.main import entry

entry()
