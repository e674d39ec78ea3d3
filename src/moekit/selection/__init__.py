"""Expert-subnetwork selection (RISE, ESFT, baselines), one-shot pruning criteria (usage, REAP, EAN), selective
fine-tuning and pruning."""
from moekit.selection.registry import SELECTORS, Selector, select
from moekit.selection.selection import Selection
from moekit.selection import baselines, esft, oneshot, rise  # importing registers the methods in SELECTORS

__all__ = ["SELECTORS", "Selection", "Selector", "select", "baselines", "esft", "oneshot", "rise"]
