"""Training: recipes, the run of each task, TrainingArguments, the Trainer, engines and dry-run plans."""
