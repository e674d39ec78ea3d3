"""Expert-initialization methods, one file each, registered in EXPERT_INITS."""
from moekit.init.base import EXPERT_INITS, ExpertInitConfig, InitContext
from moekit.init import btx, drop, naive, noise, scaled_copy, scratch, sources, spri, ume  # noqa: F401  (registration)

__all__ = ["EXPERT_INITS", "ExpertInitConfig", "InitContext"]
