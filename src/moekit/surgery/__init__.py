from moekit.surgery.adapters import ADAPTERS, supported_families
from moekit.surgery.locate import Slot, find_slots, slot_at

__all__ = ["ADAPTERS", "Slot", "find_slots", "slot_at", "supported_families"]
