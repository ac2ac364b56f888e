"""The embedder service: text in, unit vectors out, concurrent calls batched into one model run."""
