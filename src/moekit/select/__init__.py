"""Expert-subnetwork selection (RISE, ESFT, baselines), selective fine-tuning and pruning."""
from moekit.select.registry import SELECTORS, Selector, select
from moekit.select.selection import Selection
from moekit.select import baselines, esft, rise  # importing registers the methods in SELECTORS

__all__ = ["SELECTORS", "Selection", "Selector", "select", "baselines", "esft", "rise"]
