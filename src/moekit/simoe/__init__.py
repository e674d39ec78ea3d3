"""SIMoE: sparse interpolated mixture-of-experts (Chen, Wei & Schwarz 2025)."""
from moekit.simoe.export import is_simoe, load, merge, prune, save
from moekit.simoe.model import SIMoEConfig, fixed_routing, param_counts, si_modules, simoe_upcycle

__all__ = ["SIMoEConfig", "fixed_routing", "is_simoe", "load", "merge", "param_counts", "prune", "save",
           "si_modules", "simoe_upcycle"]
