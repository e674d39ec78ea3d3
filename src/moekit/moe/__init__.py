from moekit.moe.experts import Experts
from moekit.moe.layer import MoELayer, SharedExpert, moe_layers
from moekit.moe.router import Router, RoutingInfo
from moekit.moe.spec import MoESpec, RouterSpec

__all__ = ["Experts", "MoELayer", "MoESpec", "Router", "RouterSpec", "RoutingInfo", "SharedExpert", "moe_layers"]
