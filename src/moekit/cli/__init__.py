"""The `moekit` command line. The only part of moekit that prints, draws progress or exits."""
