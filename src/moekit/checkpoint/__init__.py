"""Checkpoint formats and untrusted-input checks (moekit.json / simoe.json schemas, safetensors files)."""
