"""Task definitions: lm-eval YAMLs for the seven benchmarks and the embedded
synthetic suite, their scoring helpers and the embedded task generators."""
