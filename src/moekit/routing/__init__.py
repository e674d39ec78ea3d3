"""Routing capture and analysis for moekit models and transformers MoE families."""
