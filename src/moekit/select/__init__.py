"""Expert-subnetwork selection (RISE, ESFT, baselines), selective fine-tuning and pruning."""
