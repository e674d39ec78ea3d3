"""moekit: Mixture-of-Experts models from dense checkpoints."""
from moekit.errors import MoekitError
from moekit.io import load, save
from moekit.moe import MoELayer, MoESpec, RouterSpec, moe_layers
from moekit.upcycle import upcycle

__all__ = ["MoELayer", "MoESpec", "MoekitError", "RouterSpec", "load", "moe_layers", "save", "upcycle"]
