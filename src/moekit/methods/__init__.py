"""Training methods, one file each, registered in METHODS (see moekit.methods.base)."""
from moekit.methods.base import METHODS, TrainingMethod, method, method_for
from moekit.methods import dense, lora, moe, simoe  # noqa: F401  (registration)

__all__ = ["METHODS", "TrainingMethod", "method", "method_for"]
