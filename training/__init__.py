"""Training llmd's bundled demo models: BPE tokenizer, corpus, training loop, distillation, evaluation."""
